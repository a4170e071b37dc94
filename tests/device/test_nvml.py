"""Tests for oom_magic.device.nvml: readings, MIG, processes, failures and CUDA_VISIBLE_DEVICES mapping.

NVML is driven through tests/fakes/fake_pynvml.py (a labelled fake: there is no GPU here), except
one test that runs the real nvidia-ml-py against this driverless machine.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest

from oom_magic.device.nvml import (
    Nvml,
    NvmlDevice,
    NvmlProcess,
    NvmlStatus,
    format_pci_bus_id,
    normalize_pci_bus_id,
    nvml_device_for_torch,
    ordering_note,
    visible_nvml_devices,
)
from tests.fakes.fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_VALUE_NOT_AVAILABLE,
    FakeGpu,
    FakeMig,
    FakeNvml,
    GiB,
    MiB,
)

UUID0 = "GPU-8f3a1b2c-0000-4000-8000-000000000000"
UUID1 = "GPU-8f3b9d4e-1111-4111-8111-111111111111"  # shares "GPU-8f3" with UUID0
UUID2 = "GPU-c0ffee00-2222-4222-8222-222222222222"
MIG_A = "MIG-aaaa1111-3333-5333-9333-333333333333"
MIG_B = "MIG-bbbb2222-4444-5444-9444-444444444444"


def cluster_gpus() -> list[FakeGpu]:
    """Three GPUs: a plain A100 with processes, an A100 in MIG mode (2 instances), a spare A100."""
    return [
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            total=80 * GiB,
            used=30 * GiB,
            uuid=UUID0,
            bus_id="00000000:07:00.0",
            processes=[(1001, 20 * GiB), (1002, None)],
            graphics_processes=[(1001, 20 * GiB), (1003, 512 * MiB)],
        ),
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            total=80 * GiB,
            used=10 * GiB + 600 * MiB,
            uuid=UUID1,
            bus_id="00000000:0B:00.0",
            mig=[
                FakeMig(
                    uuid=MIG_A,
                    name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                    total=40 * GiB,
                    used=10 * GiB,
                    gpu_instance_id=1,
                    compute_instance_id=0,
                    processes=[(2001, 10 * GiB)],
                ),
                FakeMig(
                    uuid=MIG_B,
                    name="NVIDIA A100-SXM4-80GB MIG 2g.20gb",
                    total=20 * GiB,
                    used=0,
                    gpu_instance_id=2,
                    compute_instance_id=0,
                    slot=3,  # MIG slots need not be contiguous
                ),
            ],
        ),
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            total=80 * GiB,
            used=0,
            uuid=UUID2,
            bus_id="00000000:48:00.0",
        ),
    ]


GPU0 = NvmlDevice(0, UUID0, "00000000:07:00.0", "NVIDIA A100-SXM4-80GB",
                  80 * GiB, 50 * GiB, 30 * GiB, False, None)
GPU1 = NvmlDevice(1, UUID1, "00000000:0B:00.0", "NVIDIA A100-SXM4-80GB",
                  80 * GiB, 80 * GiB - (10 * GiB + 600 * MiB), 10 * GiB + 600 * MiB, False, None,
                  mig_enabled=True)
MIGA = NvmlDevice(0, MIG_A, "00000000:0B:00.0", "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                  40 * GiB, 30 * GiB, 10 * GiB, True, 1, gpu_instance_id=1, compute_instance_id=0)
MIGB = NvmlDevice(3, MIG_B, "00000000:0B:00.0", "NVIDIA A100-SXM4-80GB MIG 2g.20gb",
                  20 * GiB, 20 * GiB, 0, True, 1, gpu_instance_id=2, compute_instance_id=0)
GPU2 = NvmlDevice(2, UUID2, "00000000:48:00.0", "NVIDIA A100-SXM4-80GB",
                  80 * GiB, 80 * GiB, 0, False, None)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(cluster_gpus())


@pytest.fixture
def nvml(fake: FakeNvml) -> Nvml:
    return Nvml(fake.module)


# -- start-up and status ---------------------------------------------------------------------


def test_status_reports_driver_and_starts_nvml_lazily(fake: FakeNvml) -> None:
    nvml = Nvml(fake.module)
    assert fake.init_calls == 0  # constructing does not touch NVML
    assert nvml.status == NvmlStatus(available=True, reason=None, driver_version="550.54.15")
    assert fake.init_calls == 1
    nvml.devices()
    nvml.processes(GPU0)
    assert fake.init_calls == 1


def test_nvml_starts_once_when_many_threads_ask_at_once(fake: FakeNvml) -> None:
    nvml = Nvml(fake.module)
    results: list[int] = []
    barrier = threading.Barrier(8)

    def ask() -> None:
        barrier.wait()
        results.append(len(nvml.devices()))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [5] * 8
    assert fake.init_calls == 1


def test_importing_the_module_does_not_import_pynvml_or_torch() -> None:
    code = "import sys, oom_magic.device.nvml; print('pynvml' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (NVML_ERROR_LIBRARY_NOT_FOUND, "NVML library not found (no NVIDIA driver)"),
        (
            NVML_ERROR_LIB_RM_VERSION_MISMATCH,
            "NVML driver/library version mismatch: RM has detected an NVML/RM version mismatch. "
            "(reboot, or reload the nvidia kernel module)",
        ),
        (NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver not loaded (NVML cannot reach a GPU)"),
        (NVML_ERROR_NO_PERMISSION, "NVML refused access (insufficient permissions)"),
        (999, "NVML failed to start: Unknown Error"),
    ],
)
def test_init_failure_gives_one_line_reason_and_empty_readings(code: int, reason: str) -> None:
    fake = FakeNvml(cluster_gpus(), init_error=code)
    nvml = Nvml(fake.module)
    assert nvml.status == NvmlStatus(available=False, reason=reason, driver_version=None)
    assert "\n" not in reason
    assert nvml.devices() == ()
    assert nvml.query("nvmlDeviceGetCount", default=-1) == -1
    assert nvml.processes(GPU0) == ()
    assert nvml.processes_note == reason
    assert fake.init_calls == 1  # a failed start is remembered, not retried per call


def test_missing_nvidia_ml_py_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    nvml = Nvml()
    assert nvml.status == NvmlStatus(False, "nvidia-ml-py not installed", None)
    assert nvml.devices() == ()


def _libnvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libnvml_loadable(), reason="this machine has an NVIDIA driver")
def test_real_pynvml_without_driver_is_unavailable_and_quiet() -> None:
    nvml = Nvml()  # the real nvidia-ml-py, imported lazily
    status = nvml.status
    assert status.available is False
    assert status.reason == "NVML library not found (no NVIDIA driver)"
    assert status.driver_version is None
    assert nvml.devices() == ()
    assert nvml.processes(GPU0) == ()
    assert nvml.query("nvmlDeviceGetCount", default="n/a") == "n/a"
    assert visible_nvml_devices(nvml, None) == ()
    assert nvml_device_for_torch(nvml, 0, None, cuda_visible_devices=None) is None


# -- devices ---------------------------------------------------------------------------------


def test_devices_lists_gpus_and_their_mig_instances_with_exact_readings(nvml: Nvml) -> None:
    assert nvml.devices() == (GPU0, GPU1, MIGA, MIGB, GPU2)


def test_old_bindings_returning_bytes_read_the_same(fake: FakeNvml) -> None:
    old = FakeNvml(cluster_gpus(), strings_as_bytes=True)
    nvml = Nvml(old.module)
    assert nvml.devices() == (GPU0, GPU1, MIGA, MIGB, GPU2)
    assert nvml.status.driver_version == "550.54.15"


def test_unsupported_memory_reads_none_not_zero() -> None:
    fake = FakeNvml([cluster_gpus()[2]], unsupported={"nvmlDeviceGetMemoryInfo"})
    nvml = Nvml(fake.module)
    (device,) = nvml.devices()
    assert (device.total, device.free, device.used) == (None, None, None)
    assert device.uuid == UUID2
    assert nvml.last_error == "nvmlDeviceGetMemoryInfo: Not Supported"


def test_query_never_raises(nvml: Nvml) -> None:
    assert nvml.query("nvmlDeviceGetNoSuchThing", 0, default="x") == "x"
    assert nvml.last_error == "nvmlDeviceGetNoSuchThing: not in this nvidia-ml-py"
    assert nvml.query("nvmlDeviceGetHandleByIndex", 42) is None
    assert nvml.last_error == "nvmlDeviceGetHandleByIndex: Invalid Argument"
    assert nvml.query("nvmlDeviceGetName", object()) is None  # a junk handle: AttributeError inside
    assert nvml.query("nvmlDeviceGetCount") == 3


def test_pci_bus_ids_normalise() -> None:
    assert normalize_pci_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_pci_bus_id("00000000:3B:00.0") == "00000000:3B:00.0"
    assert normalize_pci_bus_id(b"0000:3B:00.0") == "00000000:3B:00.0"
    assert normalize_pci_bus_id("3b:00.0") == "00000000:3B:00.0"
    assert normalize_pci_bus_id("0001:c1:1f.1") == "00000001:C1:1F.1"
    assert normalize_pci_bus_id("not a bus") is None
    assert normalize_pci_bus_id(None) is None
    assert format_pci_bus_id(0, 0x3B, 0) == "00000000:3B:00.0"


# -- processes -------------------------------------------------------------------------------


def test_processes_merge_compute_and_graphics_one_per_pid(nvml: Nvml) -> None:
    assert nvml.processes(GPU0) == (
        NvmlProcess(1001, 20 * GiB),
        NvmlProcess(1002, None),
        NvmlProcess(1003, 512 * MiB),
    )
    assert nvml.processes_note is None


def test_processes_on_a_mig_instance(nvml: Nvml) -> None:
    assert nvml.processes(MIGA) == (NvmlProcess(2001, 10 * GiB),)
    assert nvml.processes(MIGB) == ()
    assert nvml.processes_note is None


def test_raw_value_not_available_reads_none() -> None:
    gpu = FakeGpu(uuid=UUID2, processes=[(4242, NVML_VALUE_NOT_AVAILABLE), (4243, 7 * MiB)])
    nvml = Nvml(FakeNvml([gpu]).module)
    (device,) = nvml.devices()
    assert nvml.processes(device) == (NvmlProcess(4242, None), NvmlProcess(4243, 7 * MiB))


def test_processes_not_supported_gives_empty_tuple_and_a_reason() -> None:
    fake = FakeNvml(
        cluster_gpus(),
        unsupported={"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"},
    )
    nvml = Nvml(fake.module)
    assert nvml.processes(GPU0) == ()
    assert nvml.processes_note == (
        "NVML could not list processes (compute: Not Supported; graphics: Not Supported)"
    )


def test_graphics_unsupported_still_lists_compute_and_says_so() -> None:
    fake = FakeNvml(cluster_gpus(), unsupported={"nvmlDeviceGetGraphicsRunningProcesses"})
    nvml = Nvml(fake.module)
    assert nvml.processes(GPU0) == (NvmlProcess(1001, 20 * GiB), NvmlProcess(1002, None))
    assert nvml.processes_note == "NVML could not list processes (graphics: Not Supported)"


def test_old_driver_without_v3_falls_back_to_v2() -> None:
    fake = FakeNvml(
        cluster_gpus(),
        missing={
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        },
    )
    nvml = Nvml(fake.module)
    assert nvml.processes(GPU0) == (
        NvmlProcess(1001, 20 * GiB),
        NvmlProcess(1002, None),
        NvmlProcess(1003, 512 * MiB),
    )
    assert nvml.processes_note is None
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls


def test_processes_of_a_device_that_went_away() -> None:
    fake = FakeNvml(cluster_gpus())
    nvml = Nvml(fake.module)
    fake.devices.pop(0)  # GPU0 fell off the bus after we listed it
    assert nvml.processes(GPU0) == ()
    assert nvml.processes_note == f"device {UUID0} is no longer present"


def test_processes_follow_uuid_when_indices_shift() -> None:
    fake = FakeNvml(cluster_gpus())
    nvml = Nvml(fake.module)
    fake.devices.pop(1)  # GPU2 is now NVML index 1, but the record still says index 2
    assert nvml.processes(GPU0) == (
        NvmlProcess(1001, 20 * GiB),
        NvmlProcess(1002, None),
        NvmlProcess(1003, 512 * MiB),
    )
    assert nvml.processes(GPU2) == ()
    assert nvml.processes_note is None


# -- CUDA_VISIBLE_DEVICES --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, (GPU0, MIGA, GPU2)),  # unset: all GPUs, the MIG-mode one as its first instance
        ("1,0", (MIGA, GPU0)),
        ("2,0", (GPU2, GPU0)),
        (" 2 , 0 ", (GPU2, GPU0)),
        ("1gpu,2", (MIGA, GPU2)),  # CUDA reads indices like strtoul
        ("0,5,2", (GPU0,)),  # out of range ends the list
        ("0,-1,2", (GPU0,)),
        ("0,nonsense,2", (GPU0,)),
        ("", ()),
        ("-1", ()),
        ("0,0", ()),  # a repeated device: CUDA shows none
        (UUID2, (GPU2,)),
        ("GPU-c0ff", (GPU2,)),  # unique prefix
        ("GPU-8f3", ()),  # ambiguous prefix is invalid
        ("GPU-8f3a,GPU-c0ffee00", (GPU0, GPU2)),
        ("GPU-c0ff,GPU-8f3,0", (GPU2,)),
        ("GPU-8f3b", (MIGA,)),  # a MIG-mode GPU by UUID stands for its first instance
        (MIG_B, (MIGB,)),
        ("MIG-bbbb", (MIGB,)),
        (f"{MIG_A},{MIG_B}", (MIGA, MIGB)),
        (f"MIG-{UUID1}/2/0", (MIGB,)),  # legacy MIG-GPU-<uuid>/gi/ci
        (f"MIG-{UUID1}/1/0,2", (MIGA, GPU2)),
        (f"MIG-{UUID1}/5/0", ()),
        (f"MIG-{UUID1}/x/0", ()),
        ("MIG-ffff", ()),
        (f"0,{UUID2}", (GPU0, GPU2)),  # CUDA takes mixed forms
    ],
)
def test_visible_devices(nvml: Nvml, spec: str | None, expected: tuple[NvmlDevice, ...]) -> None:
    assert visible_nvml_devices(nvml, spec) == expected


def test_visible_devices_reads_the_environment(
    nvml: Nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert visible_nvml_devices(nvml) == (GPU2,)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_nvml_devices(nvml) == (GPU0, MIGA, GPU2)


def test_mig_gpu_without_instances_offers_no_cuda_device() -> None:
    empty = FakeGpu(uuid=UUID1, bus_id="00000000:0B:00.0", mig=[])
    plain = FakeGpu(uuid=UUID2, bus_id="00000000:48:00.0")
    nvml = Nvml(FakeNvml([empty, plain]).module)
    assert [d.uuid for d in visible_nvml_devices(nvml, None)] == [UUID2]
    assert [d.uuid for d in visible_nvml_devices(nvml, "0,1")] == [UUID2]


def mixed_models() -> Nvml:
    return Nvml(
        FakeNvml(
            [
                FakeGpu(name="NVIDIA GeForce RTX 3090", total=24 * GiB, uuid=UUID0,
                        bus_id="00000000:01:00.0"),
                FakeGpu(name="NVIDIA RTX A6000", total=48 * GiB, uuid=UUID2,
                        bus_id="00000000:02:00.0"),
            ]
        ).module
    )


def test_ordering_note_when_fastest_first_and_models_differ() -> None:
    nvml = mixed_models()
    expected = (
        "CUDA_DEVICE_ORDER is FASTEST_FIRST and the GPUs differ in model "
        "(NVIDIA GeForce RTX 3090, NVIDIA RTX A6000), so torch's cuda:N may not be NVML GPU N; "
        "set CUDA_DEVICE_ORDER=PCI_BUS_ID before CUDA starts to make them agree"
    )
    assert ordering_note(nvml, None, None) == expected
    assert ordering_note(nvml, "1,0", "FASTEST_FIRST") == expected
    assert ordering_note(nvml, None, "PCI_BUS_ID") is None
    assert ordering_note(nvml, "0", "pci_bus_id") is None
    assert ordering_note(nvml, f"{UUID2},{UUID0}", None) is None  # UUIDs do not depend on order


def test_ordering_note_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = mixed_models()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert ordering_note(nvml) is None
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    assert ordering_note(nvml) is not None


def test_ordering_note_for_same_models_and_for_mig(nvml: Nvml) -> None:
    assert ordering_note(nvml, "0,2", None) is None
    assert ordering_note(nvml, None, "PCI_BUS_ID") == (
        "GPU 1 is in MIG mode, so its cuda device is taken as its first MIG instance "
        "(CUDA may enumerate only one MIG instance per process)"
    )
    assert ordering_note(nvml, MIG_A, None) is None  # named explicitly: nothing assumed


def test_ordering_note_without_nvml_is_none() -> None:
    nvml = Nvml(FakeNvml(cluster_gpus(), init_error=NVML_ERROR_LIBRARY_NOT_FOUND).module)
    assert ordering_note(nvml, None, None) is None


# -- torch index -> NVML device --------------------------------------------------------------


def test_torch_index_maps_through_visible_devices(nvml: Nvml) -> None:
    assert nvml_device_for_torch(nvml, 0, cuda_visible_devices="2,0") == GPU2
    assert nvml_device_for_torch(nvml, 1, cuda_visible_devices="2,0") == GPU0
    assert nvml_device_for_torch(nvml, 2, cuda_visible_devices="2,0") is None
    assert nvml_device_for_torch(nvml, -1, cuda_visible_devices="2,0") is None


def test_torch_pci_bus_id_wins_over_the_visible_list(nvml: Nvml) -> None:
    # torch's bus id (CUDA initialised) names the GPU for certain, whatever the order.
    assert nvml_device_for_torch(nvml, 0, "0000:48:00.0", cuda_visible_devices="2,0") == GPU2
    assert nvml_device_for_torch(nvml, 0, "0000:07:00.0", cuda_visible_devices="2,0") == GPU0
    assert nvml_device_for_torch(
        nvml, 0, format_pci_bus_id(0, 0x0B, 0), cuda_visible_devices=None
    ) == MIGA
    assert nvml_device_for_torch(nvml, 1, "0000:0b:00.0", cuda_visible_devices=MIG_B) == MIGA
    assert nvml_device_for_torch(nvml, 0, "0000:0b:00.0", cuda_visible_devices=MIG_B) == MIGB
    assert nvml_device_for_torch(nvml, 0, "0000:99:00.0", cuda_visible_devices=None) is None
    assert nvml_device_for_torch(nvml, 1, "not-a-bus-id", cuda_visible_devices=None) == MIGA


def test_memory_is_read_with_the_v2_query_and_says_so() -> None:
    # issue 14 point 2 (FAKE NVML, real shapes): v2's used excludes the driver's reserved memory,
    # as nvidia-smi prints it; v1 (deprecated) folds reserved into used.
    gpu = FakeGpu(total=80 * GiB, used=30 * GiB, reserved=512 * MiB)
    [device] = Nvml(module=FakeNvml([gpu]).module).devices()
    assert device.memory_query == "v2"
    assert (device.used, device.reserved, device.free) == (30 * GiB, 512 * MiB, 80 * GiB - 30 * GiB - 512 * MiB)


def test_memory_falls_back_to_v1_on_an_old_driver_and_says_so() -> None:
    gpu = FakeGpu(total=80 * GiB, used=30 * GiB, reserved=512 * MiB)
    nvml = Nvml(module=FakeNvml([gpu], missing={"nvmlDeviceGetMemoryInfo_v2"}).module)
    [device] = nvml.devices()
    assert device.memory_query == "v1" and device.reserved is None
    assert device.used == 30 * GiB + 512 * MiB  # v1: reserved counts as used
    assert nvml.errors == {}  # an old driver is an answer, not a failure


def test_use_puts_a_reader_in_place_for_the_block_and_the_previous_one_back() -> None:
    from oom_magic.device import nvml as nvml_module

    machine = nvml_module.default_nvml()  # this machine's (NVML not started until asked)
    one, two = Nvml(FakeNvml([FakeGpu()]).module), Nvml(FakeNvml([FakeGpu(), FakeGpu()]).module)
    with nvml_module.use(one) as used:
        assert used is one and nvml_module.default_nvml() is one
        with pytest.raises(RuntimeError), nvml_module.use(two):
            assert len(nvml_module.default_nvml().devices()) == 2
            raise RuntimeError("a failing block still puts the previous reader back")
        assert nvml_module.default_nvml() is one
    assert nvml_module.default_nvml() is machine
