"""issue 14 point 1: in a container NVML and PyTorch list this kernel under its *host* pid.

NVML is a FAKE (tests/fakes/fake_pynvml.py, real nvidia-ml-py shapes); the CUDA allocator figures
are FAKE too (no GPU here): the FAKE torch.cuda (tests/fakes/fake_torch_cuda.py) is put on torch,
holding a 20 GiB reserve.
The other process is real (a sleeping python), so it exists in our pid namespace.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from oom_magic.device.reading import read_device
from oom_magic.guard.diagnose import diagnose
from oom_magic.device.nvml import Nvml
from oom_magic.guard.oom import parse_oom_message
from oom_magic.device.processes import recognise_self
from oom_magic.render.guard import cause_text
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.fakes.fake_torch_cuda import FakeTorchCuda

GiB = 1 << 30
MiB = 1 << 20


def _absent_pid(pid: int = 4123456) -> int:
    """A pid that no process in this pid namespace has (as a host pid looks from a container)."""
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


HOST_PID = _absent_pid()
OTHER_HOST_PID = _absent_pid(HOST_PID + 7)


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def cuda_holding_20gib(monkeypatch):
    """FAKE allocator figures: CUDA initialised here, 19.5 GiB allocated, 20 GiB reserved."""
    cuda = FakeTorchCuda(80 * GiB).install(monkeypatch, torch)  # no pci ids: NVML is matched by index
    cuda.hold(19 * GiB + 512 * MiB, reserved=20 * GiB)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_reading_recognises_this_kernel_under_its_host_pid(cuda_holding_20gib, other_process):
    gpu = FakeGpu(total=80 * GiB, used=35 * GiB,
                  processes=[(HOST_PID, 20 * GiB + 500 * MiB), (other_process.pid, 12 * GiB),
                             (OTHER_HOST_PID, 2 * GiB)])
    reading = read_device("cuda:0", Nvml(module=FakeNvml([gpu]).module))
    assert reading.own_listed_pid == HOST_PID
    assert reading.process_used == 20 * GiB + 500 * MiB and reading.context == 500 * MiB
    # ours is not "another process"; the other host pid is said to be one, not an exited process
    assert [(p.pid, p.note) for p in reading.processes] == [
        (other_process.pid, None), (OTHER_HOST_PID, "a host pid, not visible from this container")]
    assert any(f"pid {HOST_PID}" in n and "this kernel" in n for n in reading.notes)


def test_an_unmatched_absent_pid_is_never_taken_for_this_kernel(cuda_holding_20gib):
    # 70 GiB is far above what we hold: someone else's, on the host.
    gpu = FakeGpu(total=80 * GiB, used=71 * GiB, processes=[(HOST_PID, 70 * GiB)])
    reading = read_device("cuda:0", Nvml(module=FakeNvml([gpu]).module))
    assert reading.own_listed_pid is None and [p.pid for p in reading.processes] == [HOST_PID]
    assert recognise_self([(HOST_PID, 20 * GiB), (HOST_PID + 1, 20 * GiB)], 19 * GiB, 21 * GiB,
                          pid_exists=lambda pid: False) is None  # two candidates: no guess


CONTAINER_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    f"of 79.19 GiB of which 1.06 GiB is free. Process {HOST_PID} has 78.12 GiB memory in use. "
    "Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "77.00 GiB is allocated by PyTorch, and 600.00 MiB is reserved by PyTorch but unallocated."
)


def test_diagnosis_does_not_rank_this_kernel_as_another_process_nor_advise_killing_it():
    d = diagnose(parse_oom_message(CONTAINER_OOM), device="cuda:0")
    assert "other-processes" not in [c.kind for c in d.causes]
    text = "\n".join(cause_text(c, "cuda:0") for c in d.causes)
    assert f"kill {HOST_PID}" not in text


def test_an_unverifiable_pid_gets_no_kill_advice():
    other = CONTAINER_OOM.replace("Including non-PyTorch memory, this process has 78.12 GiB",
                                  "Including non-PyTorch memory, this process has 1.00 GiB")
    d = diagnose(parse_oom_message(other), device="cuda:0")
    [cause] = [c for c in d.causes if c.kind == "other-processes"]
    text = cause_text(cause, "cuda:0")
    assert str(HOST_PID) in text and "kill" not in text and "on the host" in text


def test_mem_get_info_only_on_a_device_whose_context_exists(monkeypatch):
    # issue 14 point 6 (FAKE CUDA: no GPU here): CUDA initialized on cuda:0 only; without NVML the
    # reading of cuda:1 must not call mem_get_info(1), which would create a context there.
    cuda = FakeTorchCuda(80 * GiB, 80 * GiB, used_elsewhere=70 * GiB).install(monkeypatch, torch)  # context on cuda:0
    no_nvml = Nvml(module=FakeNvml([], init_error=12).module)
    assert read_device("cuda:0", no_nvml).free == 10 * GiB
    cold = read_device("cuda:1", no_nvml)
    assert cuda.calls_to("mem_get_info") == [(0,)] and cold.free is None and any("no CUDA context on cuda:1" in n for n in cold.notes)
