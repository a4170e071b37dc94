"""Device readings and %gpumem on CUDA paths, through a FAKE NVML (no GPU on this machine).

The fake (tests/fakes/fake_pynvml.py) stands in for absent hardware; its value shapes are
nvidia-ml-py 13's. Readings are asserted exactly.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch  # noqa: F401  (imported, as a user would: the default device follows torch)

from oom_magic.device.reading import available_devices, read_device, resolve_device
from oom_magic.common.errors import OomMagicError
from oom_magic.device.nvml import Nvml
from oom_magic.heap.snapshot import snapshot
from tests.conftest import ready_process
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def kernel_process():
    """A real process whose command line looks like an ipykernel launch."""
    with ready_process([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)", "-f",
                        "/tmp/kernel-1234abcd.json"]) as proc:  # 'ready' comes after exec: its own argv
        yield proc


def two_gpus(*processes) -> Nvml:
    fake = FakeNvml([
        FakeGpu(name="NVIDIA A100-SXM4-80GB", total=80 * GiB, used=30 * GiB,
                uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000", bus_id="00000000:07:00.0",
                processes=list(processes)),
        FakeGpu(name="NVIDIA A100-SXM4-80GB", total=80 * GiB, used=1 * GiB,
                uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000", bus_id="00000000:0B:00.0"),
    ])
    return Nvml(module=fake.module)


def test_cuda_reading_from_nvml_without_context(monkeypatch, kernel_process):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus((kernel_process.pid, 12 * GiB), (os.getpid(), 600 * MiB))
    reading = read_device("cuda:0", nvml)
    assert (reading.total, reading.used, reading.free) == (80 * GiB, 30 * GiB, 50 * GiB)
    assert reading.name == "NVIDIA A100-SXM4-80GB"
    # CUDA is not initialized here: torch holds nothing, and says so.
    assert (reading.allocated, reading.reserved) == (0, 0)
    assert reading.process_used == 600 * MiB
    assert reading.context == 600 * MiB  # everything this process holds is outside PyTorch
    [other] = reading.processes
    assert other.pid == kernel_process.pid and other.used_bytes == 12 * GiB
    assert other.is_jupyter_kernel is True and other.name and other.name.startswith("python")
    assert any("not initialized" in n for n in reading.notes)


def test_visible_devices_pick_the_right_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    reading = read_device("cuda:0", two_gpus())
    assert reading.used == 1 * GiB


def test_nvml_missing_reads_na_with_reason():
    nvml = Nvml(module=FakeNvml([], init_error=12).module)
    reading = read_device("cuda:0", nvml)
    assert reading.total is None and reading.free is None
    assert any(n.startswith("NVML unavailable: NVML library not found") for n in reading.notes)


def test_devices_present_and_unknown_device_message(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus()
    assert available_devices(nvml)[:2] == ("cuda:0", "cuda:1") and available_devices(nvml)[-1] == "cpu"
    assert resolve_device("cuda:1", nvml) == "cuda:1"
    assert resolve_device("1", nvml) == "cuda:1"
    with pytest.raises(OomMagicError, match=r"unknown device 'cuda:9': this machine has cuda:0, cuda:1, cpu"):
        resolve_device("cuda:9", nvml)
    # torch here is a CPU build: the user's tensors default to cpu even though NVML sees GPUs.
    assert resolve_device(None, nvml) == "cpu"


def test_snapshot_of_a_gpu_seen_only_by_nvml(monkeypatch, kernel_process):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    snap = snapshot("cuda:0", nvml=two_gpus((kernel_process.pid, 2 * GiB)))
    assert snap.storages == () and snap.untracked_bytes == 0
    text = str(snap)
    assert "cuda:0 NVIDIA A100-SXM4-80GB · 30.00 GiB used of 80.00 GiB · 50.00 GiB free" in text
    assert f"pid {kernel_process.pid}" in text and "Jupyter kernel" in text
    data = snap.to_dict()
    assert data["reading"]["processes"][0]["used_bytes"] == 2 * GiB
    assert data["segments"]["others"] == 2 * GiB and data["segments"]["free"] == 50 * GiB


def test_cpu_reading_is_psutil():
    import psutil

    reading = read_device("cpu")
    assert reading.total == psutil.virtual_memory().total
    assert reading.process_used and reading.process_used > 10 * MiB
    assert reading.allocated is None and reading.context is None


def test_cuda_reading_states_which_nvml_memory_query_it_used(monkeypatch):
    # issue 14 point 2 (FAKE NVML): the reading names its query; v1 gets a note on why it differs.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = FakeGpu(total=80 * GiB, used=30 * GiB, reserved=512 * MiB)
    reading = read_device("cuda:0", Nvml(module=FakeNvml([gpu]).module))
    assert reading.memory_query == "v2" and reading.used == 30 * GiB
    old = read_device("cuda:0", Nvml(module=FakeNvml([gpu], missing={"nvmlDeviceGetMemoryInfo_v2"}).module))
    assert old.memory_query == "v1" and old.used == 30 * GiB + 512 * MiB
    assert any("v1 query" in n for n in old.notes)
