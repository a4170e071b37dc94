"""issue 14 point 7: the GPU suite's ground truth reads the device the package means by cuda:N.

FAKE NVML (tests/fakes/fake_pynvml.py, nvidia-ml-py shapes, MIG handles) installed as ``pynvml``
and a FAKE torch without a CUDA context: no GPU here. On a MIG instance or with
CUDA_VISIBLE_DEVICES remapped, NVML index 0 or the parent GPU's PCI handle is the wrong device.
"""
from __future__ import annotations

import sys
import pytest

from tests.fakes.fake_pynvml import FakeGpu, FakeMig, FakeNvml
from tests.fakes.fake_torch_cuda import FakeTorch, FakeTorchCuda
from tests.gpu import support

GiB, MiB = 1 << 30, 1 << 20
MIG_UUID = "MIG-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeNvml([
        FakeGpu(uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000", bus_id="00000000:07:00.0", used=5 * GiB,
                processes=[(1001, 5 * GiB)]),
        FakeGpu(uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000", bus_id="00000000:0B:00.0", used=9 * GiB,
                processes=[(2001, None)],  # a MIG parent lists processes without their bytes
                mig=[FakeMig(uuid=MIG_UUID, total=40 * GiB, used=9 * GiB, reserved=256 * MiB,
                             processes=[(2001, 9 * GiB)])]),
    ])
    fake.nvmlInit()  # as pynvml.nvmlInit() would; the support code calls it again, harmlessly
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    return fake


NO_CONTEXT = FakeTorch(FakeTorchCuda(initialized=False))  # FAKE torch.cuda before any context


def test_a_mig_instance_is_read_by_its_own_handle(cluster, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)
    handle = support.nvml_handle(NO_CONTEXT, 0)
    assert handle.mig is not None and handle.mig.uuid == MIG_UUID
    memory = support.nvml_memory(NO_CONTEXT, 0)
    assert memory == {"total": 40 * GiB, "used": 9 * GiB, "free": 40 * GiB - 9 * GiB - 256 * MiB}  # v2 figures
    assert support.nvml_processes() == {1001: 5 * GiB, 2001: 9 * GiB}  # the MIG process with its bytes


def test_a_remapped_index_is_the_gpu_cuda_means(cluster, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert support.nvml_handle(NO_CONTEXT, 0).gpu.uuid.startswith("GPU-aaaaaaaa")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # a GPU in MIG mode: CUDA runs on its instance
    assert support.nvml_handle(NO_CONTEXT, 0).mig.uuid == MIG_UUID
