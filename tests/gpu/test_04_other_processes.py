"""Check 4 — other processes: a process holding 1 GiB is listed with its pid and bytes; a second
Jupyter kernel holding memory is flagged as one.

Ground truth: the child's own pid and NVML's usedGpuMemory for it (pynvml). The plain child is
also the control for the kernel flag: it must not be called a Jupyter kernel.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from oom_magic import read_device
from tests.gpu.support import GiB, MiB, REPO, nvml_processes, wait_until

ITEM = 4
pytestmark = pytest.mark.gpu

HOLDER = r"""
import os, sys, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("READY", os.getpid(), flush=True)
sys.stdin.readline()
"""


def _read_line(stream, timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def _find(reading, pid: int):
    return next((p for p in reading.processes if p.pid == pid), None)


def test_process_holding_1gib_is_listed(cuda, checks):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_")}
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(REPO))
    try:
        line = _read_line(child.stdout, 180)
        assert line.startswith("READY"), f"the holder did not start (exit {child.poll()}): {line!r}"
        pid = int(line.split()[1])
        listed = wait_until(lambda: pid in nvml_processes(), timeout=30)
        truth = nvml_processes().get(pid)
        reading = read_device("cuda:0")
        info = _find(reading, pid)
        checks.true("ground truth: NVML lists the holder's pid", listed)
        checks.true("the holder is listed among other processes, by pid", info is not None,
                    note=None if info is not None else f"listed pids: {[p.pid for p in reading.processes]}")
        checks.equal("its bytes == NVML usedGpuMemory for that pid", truth, info.used_bytes if info else None)
        checks.at_least("its bytes cover the 1 GiB tensor", GiB, info.used_bytes if info else None)
        checks.true("a plain python process is not called a Jupyter kernel (control)",
                    info.is_jupyter_kernel if info else None, expected=False)
        checks.true("it is not taken for this process", info.is_self if info else None, expected=False)
        others = reading.other_processes_used
        checks.at_least("other processes' bytes include the holder's", truth or GiB, others)
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    checks.verify()


KERNEL_CODE = """
import os, torch
held = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')
torch.cuda.synchronize()
print('PID', os.getpid())
"""


def test_second_jupyter_kernel_is_flagged(cuda, checks, tmp_path):
    manager = pytest.importorskip("jupyter_client.manager", reason="jupyter_client is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    km = manager.KernelManager(kernel_name="python3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_")}
    km.start_kernel(env=env, cwd=str(tmp_path))
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        printed: list[str] = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        reply = kc.execute_interactive(KERNEL_CODE, timeout=180, output_hook=hook)
        assert reply["content"]["status"] == "ok", reply["content"]
        pid = int("".join(printed).split("PID", 1)[1].split()[0])
        wait_until(lambda: pid in nvml_processes(), timeout=30)
        truth = nvml_processes().get(pid)
        reading = read_device("cuda:0")
        info = _find(reading, pid)
        checks.true("the kernel's pid is listed", info is not None,
                    note=None if info is not None else f"listed pids: {[p.pid for p in reading.processes]}")
        checks.true("it is flagged as a Jupyter kernel", info.is_jupyter_kernel if info else None)
        checks.equal("its bytes == NVML usedGpuMemory for that pid", truth, info.used_bytes if info else None)
        checks.at_least("its bytes cover the 512 MiB tensor", 512 * MiB, info.used_bytes if info else None)
        from oom_magic.render.text import snapshot_text
        from oom_magic.heap.snapshot import snapshot

        text = snapshot_text(snapshot("cuda:0"))
        checks.true("%gpumem's text names it a Jupyter kernel", str(pid) in text and "Jupyter kernel" in text)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    checks.verify()
