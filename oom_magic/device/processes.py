"""Say who the processes on a GPU are (name, user, Jupyter kernel or not) without prying into others'.

NVML gives pids and bytes; psutil gives the rest. Another user's process shows its pid, user and
bytes only: never its name, command line or files. Nothing here raises.
"""
from __future__ import annotations

import os
import re
from types import ModuleType
from typing import Any
from collections.abc import Iterable, Sequence

from ..records.device import ProcessInfo
from .nvml import NvmlProcess

__all__ = ["ProcessInfo", "describe_processes", "looks_like_jupyter_kernel", "recognise_self"]

_NOTE_ACCESS_DENIED = "access denied"
_NOTE_EXITED = "process has exited"
_NOTE_OTHER_USER = "another user's process"
NOTE_HOST_PID = "a host pid, not visible from this container"
NOTE_SELF_HOST_PID = "this kernel, listed by its host pid (this container has its own pid namespace)"

# A kernel's connection file: "kernel-<id>.json", passed as "-f <path>", "--f=<path>" or bare.
_CONNECTION_FILE = re.compile(r"(?:^|[/\\=])kernel-[^/\\]*\.json$")
_KERNEL_MODULES = {"ipykernel", "ipykernel_launcher"}


def looks_like_jupyter_kernel(cmdline: Sequence[str]) -> bool:
    """Whether a command line runs ipykernel or names a kernel-*.json connection file."""
    for position, arg in enumerate(cmdline):
        base = re.split(r"[/\\]", arg)[-1]
        if base in ("ipykernel_launcher.py", "ipykernel_launcher"):
            return True
        if position > 0 and cmdline[position - 1] == "-m" and arg.split(".")[0] in _KERNEL_MODULES:
            return True
        if _CONNECTION_FILE.search(arg):
            return True
    return False


def _load_psutil(psutil_module: ModuleType | Any | None) -> Any:
    if psutil_module is not None:
        return psutil_module
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def _own_user(psutil: Any) -> str | None:
    try:
        return psutil.Process(os.getpid()).username()
    except Exception:
        return None


def _describe_one(
    proc: NvmlProcess, psutil: Any, own_user: str | None, self_pid: int
) -> ProcessInfo:
    pid, used = proc.pid, proc.used_bytes
    is_self = pid == self_pid

    def bare(note: str | None, user: str | None = None) -> ProcessInfo:
        return ProcessInfo(pid, used, None, user, None, is_self, note)

    if psutil is None:
        return bare("psutil not installed")
    no_such = getattr(psutil, "NoSuchProcess", ())
    denied = getattr(psutil, "AccessDenied", ())
    try:
        process = psutil.Process(pid)
        user = process.username()
        # Privacy first: if we cannot tell whose it is, treat it as someone else's.
        if not is_self and (own_user is None or user != own_user):
            return bare(_NOTE_OTHER_USER, user)
        name = process.name()
        cmdline = process.cmdline()
    except no_such:  # ZombieProcess is a NoSuchProcess too
        return bare(_NOTE_EXITED)
    except denied:
        return bare(_NOTE_ACCESS_DENIED)
    except Exception as exc:
        return bare(f"could not read process: {type(exc).__name__}")
    return ProcessInfo(
        pid=pid,
        used_bytes=used,
        name=name or None,
        user=user,
        is_jupyter_kernel=looks_like_jupyter_kernel(list(cmdline or ())),
        is_self=is_self,
        note=None,
    )


def describe_processes(
    procs: Iterable[NvmlProcess],
    *,
    self_pid: int | None = None,
    psutil_module: ModuleType | Any | None = None,
) -> tuple[ProcessInfo, ...]:
    """Describe NVML's processes, largest memory first; other users' processes show no name.

    ``self_pid`` defaults to this process; ``psutil_module`` is for tests. In a container NVML
    reports host pids, which psutil may not see: those read "process has exited".
    """
    psutil = _load_psutil(psutil_module)
    me = os.getpid() if self_pid is None else self_pid
    own_user = _own_user(psutil) if psutil is not None else None
    described = []
    for proc in procs:
        try:
            described.append(_describe_one(proc, psutil, own_user, me))
        except Exception as exc:  # never into the user's cell
            described.append(
                ProcessInfo(proc.pid, proc.used_bytes, None, None, None, proc.pid == me,
                            f"could not read process: {type(exc).__name__}")
            )
    described.sort(key=lambda p: (p.used_bytes is None, -(p.used_bytes or 0), p.pid))
    return tuple(described)


def _pid_exists_here(pid: int) -> bool:
    """Whether ``pid`` names a process in this pid namespace (False also when it exited)."""
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists, it is just not ours to signal
    return True


def recognise_self(
    listed: Iterable[tuple[int, int | None]],
    low: int | None,
    high: int | None,
    *,
    self_pid: int | None = None,
    pid_exists: Any = None,
) -> int | None:
    """The pid under which NVML (or an OOM message) lists this very process, or None.

    In Docker/Kubernetes without the host pid namespace, NVML reports *host* pids, so this process
    is listed under a pid that is not ``os.getpid()``. It is recognised when exactly one listed pid
    does not exist in our pid namespace and holds between ``low`` and ``high`` bytes (what our
    allocator and CUDA context hold). Two such candidates, or none, give None: never a guess.
    """
    me = os.getpid() if self_pid is None else self_pid
    pairs = list(listed)
    if any(pid == me for pid, _ in pairs):
        return me
    if low is None or high is None or high <= 0:
        return None
    exists = pid_exists or _pid_exists_here
    hits = [pid for pid, used in pairs
            if used is not None and low <= used <= high and not exists(pid)]
    return hits[0] if len(hits) == 1 else None
