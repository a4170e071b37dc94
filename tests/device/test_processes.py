"""Tests for oom_magic.device.processes: real processes described by real psutil, privacy, failures.

NVML is the labelled fake in tests/fakes/fake_pynvml.py (no GPU here) fed with the real pids of
real subprocesses; a small FakePsutil below (also a fake) stands in only for what this machine
cannot produce: another user's process and permission errors.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from oom_magic.device.nvml import Nvml, NvmlProcess
from oom_magic.device.processes import ProcessInfo, describe_processes, looks_like_jupyter_kernel
from tests.conftest import ready_process
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, GiB, MiB

ME = pwd.getpwuid(os.getuid()).pw_name
PYTHON_NAME = os.path.basename(sys.executable)


@pytest.fixture
def sleepers() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A plain python sleeper and one whose argv looks like an ipykernel launch."""
    # 'ready' is printed after exec: between fork and exec a child still shows pytest's command line
    sleep = "import time; print('ready', flush=True); time.sleep(30)"
    with ready_process([sys.executable, "-c", sleep]) as plain, \
            ready_process([sys.executable, "-c", sleep, "-f", "/tmp/kernel-abc.json"]) as kernel:
        yield plain, kernel


def test_real_processes_on_a_gpu_are_named_and_kernels_flagged(
    sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    plain, kernel = sleepers
    me = os.getpid()
    gpu = FakeGpu(processes=[(plain.pid, 3 * GiB), (kernel.pid, 5 * GiB), (me, 1 * GiB)])
    nvml = Nvml(FakeNvml([gpu]).module)
    (device,) = nvml.devices()

    described = describe_processes(nvml.processes(device))

    assert described == (
        ProcessInfo(kernel.pid, 5 * GiB, PYTHON_NAME, ME, True, False, None),
        ProcessInfo(plain.pid, 3 * GiB, PYTHON_NAME, ME, False, False, None),
        ProcessInfo(me, 1 * GiB, psutil_name(me), ME, False, True, None),
    )


def psutil_name(pid: int) -> str:
    import psutil

    return psutil.Process(pid).name()


def test_a_process_that_exited_reads_exited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (info,) = describe_processes([NvmlProcess(proc.pid, 2 * GiB)])
    assert info == ProcessInfo(proc.pid, 2 * GiB, None, None, None, False, "process has exited")


def test_self_pid_can_be_given(
    sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    plain, _ = sleepers
    (info,) = describe_processes([NvmlProcess(plain.pid, None)], self_pid=plain.pid)
    assert info == ProcessInfo(plain.pid, None, PYTHON_NAME, ME, False, True, None)


# -- a fake psutil for what this machine cannot produce ---------------------------------------


class FakePsutil:
    """FAKE psutil module: stands in for other users' processes and permission errors.

    ``table`` maps pid -> {"user", "name", "cmdline"} or an exception class to raise;
    ``reads`` records every (pid, field) read, to prove what was never looked at.
    """

    class Error(Exception):
        pass

    class NoSuchProcess(Error):
        pass

    class ZombieProcess(NoSuchProcess):
        pass

    class AccessDenied(Error):
        pass

    def __init__(self, table: dict[int, Any]) -> None:
        self.table = table
        self.reads: list[tuple[int, str]] = []
        outer = self

        class Process:
            def __init__(self, pid: int) -> None:
                entry = outer.table.get(pid)
                if entry is None:
                    raise outer.NoSuchProcess(pid)
                self.pid = pid
                self.entry = entry

            def _read(self, field: str) -> Any:
                outer.reads.append((self.pid, field))
                entry = self.entry
                if isinstance(entry, type) and issubclass(entry, BaseException):
                    raise entry(self.pid)
                return entry[field]

            def username(self) -> str:
                return self._read("user")

            def name(self) -> str:
                return self._read("name")

            def cmdline(self) -> list[str]:
                return self._read("cmdline")

        self.Process = Process


KERNEL_ARGV = ["/opt/conda/bin/python", "-m", "ipykernel_launcher", "-f",
               "/root/.local/share/jupyter/runtime/kernel-5f2c.json"]


def fake_psutil() -> FakePsutil:
    return FakePsutil(
        {
            os.getpid(): {"user": "alice", "name": "python", "cmdline": ["python", "-m", "pytest"]},
            10: FakePsutil.AccessDenied,
            11: FakePsutil.NoSuchProcess,
            12: {"user": "bob", "name": "secret-job", "cmdline": ["python", "secret.py", "--key=x"]},
            13: {"user": "alice", "name": "python", "cmdline": KERNEL_ARGV},
            14: FakePsutil.ZombieProcess,
            15: RuntimeError,
        }
    )


def test_other_users_process_shows_pid_user_bytes_only() -> None:
    ps = fake_psutil()
    (info,) = describe_processes([NvmlProcess(12, 9 * GiB)], psutil_module=ps)
    assert info == ProcessInfo(12, 9 * GiB, None, "bob", None, False, "another user's process")
    assert (12, "name") not in ps.reads
    assert (12, "cmdline") not in ps.reads


def test_access_denied_and_gone_processes_show_pid_and_bytes() -> None:
    ps = fake_psutil()
    procs = [
        NvmlProcess(10, 1 * GiB),
        NvmlProcess(11, 2 * GiB),
        NvmlProcess(14, None),
        NvmlProcess(15, 3 * MiB),
        NvmlProcess(13, 4 * GiB),
        NvmlProcess(12, 4 * GiB),
    ]
    assert describe_processes(procs, psutil_module=ps) == (
        ProcessInfo(12, 4 * GiB, None, "bob", None, False, "another user's process"),
        ProcessInfo(13, 4 * GiB, "python", "alice", True, False, None),
        ProcessInfo(11, 2 * GiB, None, None, None, False, "process has exited"),
        ProcessInfo(10, 1 * GiB, None, None, None, False, "access denied"),
        ProcessInfo(15, 3 * MiB, None, None, None, False, "could not read process: RuntimeError"),
        ProcessInfo(14, None, None, None, None, False, "process has exited"),
    )


def test_unknown_own_user_hides_every_name_but_ours() -> None:
    ps = fake_psutil()
    del ps.table[os.getpid()]  # cannot tell who we are: privacy first
    procs = [NvmlProcess(13, 4 * GiB), NvmlProcess(12, 1 * GiB)]
    assert describe_processes(procs, self_pid=13, psutil_module=ps) == (
        ProcessInfo(13, 4 * GiB, "python", "alice", True, True, None),
        ProcessInfo(12, 1 * GiB, None, "bob", None, False, "another user's process"),
    )


def test_without_psutil_every_process_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert describe_processes([NvmlProcess(7, 1 * GiB)], self_pid=7) == (
        ProcessInfo(7, 1 * GiB, None, None, None, True, "psutil not installed"),
    )


def test_empty_input_gives_empty_tuple() -> None:
    assert describe_processes([]) == ()


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        (KERNEL_ARGV, True),
        (["python", "-m", "ipykernel", "-f", "/tmp/k.json"], True),
        (["/usr/bin/python3", "/home/u/.vscode/extensions/ms-toolsai.jupyter/ipykernel_launcher.py",
          "--f=/run/user/1000/jupyter/runtime/kernel-v2-3377.json"], True),
        (["python", "-c", "import time; time.sleep(30)", "-f", "/tmp/kernel-abc.json"], True),
        (["xeus-cling", "-f", "C:\\Users\\u\\kernel-9.json"], True),
        (["python", "train.py", "--config", "kernel.json"], False),
        (["python", "-m", "torch.distributed.run", "train.py"], False),
        (["jupyter-lab"], False),
        ([], False),
    ],
)
def test_jupyter_kernel_detection(cmdline: list[str], expected: bool) -> None:
    assert looks_like_jupyter_kernel(cmdline) is expected
