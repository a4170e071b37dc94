"""How much memory and disk this process may still take on this machine: the host's budgets.

Facts read from the machine, never from IPython: psutil's available RAM, the address-space limit
(``ulimit -v``), a container's cgroup memory limit, the free disk under a folder, and the cap
``torch.cuda.set_per_process_memory_fraction`` puts on a CUDA device (read only when CUDA is
already initialized and torch already imported). Every reader answers None when it cannot say.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .reading import cuda_index

__all__ = ["cuda_process_cap", "disk_free", "ram_available", "ram_total", "usable_ram"]


def usable_ram() -> tuple[int | None, str | None]:
    """Bytes of RAM this process can still get, and what limits it when not the machine's RAM.

    The least of: psutil's available memory, the address-space limit (``ulimit -v``, RLIMIT_AS)
    minus this process's virtual size, and the cgroup memory limit (containers) minus its usage
    (page cache that can be reclaimed counts as free).
    """
    candidates: list[tuple[int, str | None]] = []
    try:
        import psutil

        candidates.append((int(psutil.virtual_memory().available), None))
        vms = int(psutil.Process().memory_info().vms)
    except Exception:
        vms = None
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and vms is not None:
            candidates.append((max(soft - vms, 0), "the address-space limit (ulimit -v)"))
    except Exception:
        pass
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        candidates.append((cgroup, "the container's memory limit (cgroup)"))
    if not candidates:
        return None, None
    return min(candidates, key=lambda c: c[0])


def cuda_process_cap(device: str, torch: Any = None) -> int | None:
    """Bytes this process may reserve on a CUDA device when ``set_per_process_memory_fraction`` caps it.

    None when CUDA is not initialized (reading the fraction would initialize it), when there is
    no cap (fraction 1.0), or when this torch cannot say.
    """
    if not device.startswith("cuda"):
        return None
    if torch is None:
        from ..common._torch import loaded_torch

        torch = loaded_torch()
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get is None:
            return None
        index = cuda_index(device) or 0
        fraction = float(get(index))
        if fraction >= 1.0:
            return None
        return int(int(torch.cuda.get_device_properties(index).total_memory) * fraction)
    except Exception:
        return None


def _cgroup_headroom() -> int | None:
    """memory.max − memory.current + reclaimable page cache (cgroup v2), or v1's figures."""
    root = Path("/sys/fs/cgroup")
    try:
        if (root / "memory.max").is_file():
            limit_text = (root / "memory.max").read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int((root / "memory.current").read_text())
            stat = (root / "memory.stat").read_text() if (root / "memory.stat").is_file() else ""
        elif (root / "memory" / "memory.limit_in_bytes").is_file():
            limit = int((root / "memory" / "memory.limit_in_bytes").read_text())
            if limit >= 1 << 60:  # v1 spells "no limit" as a huge number
                return None
            usage = int((root / "memory" / "memory.usage_in_bytes").read_text())
            stat = (root / "memory" / "memory.stat").read_text()
        else:
            return None
    except (OSError, ValueError):
        return None
    inactive = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            inactive = int(value)
    return max(limit - usage + inactive, 0)


def ram_total() -> int | None:
    """The machine's RAM in bytes (psutil), or None when psutil cannot say."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def ram_available() -> int | None:
    """psutil's available RAM in bytes (page cache it can reclaim counts as free), or None."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def disk_free(folder: str | os.PathLike[str] | None = None) -> int | None:
    """Free bytes on the disk that holds ``folder`` (default: the working directory), or None."""
    try:
        return int(shutil.disk_usage(folder if folder is not None else os.getcwd()).free)
    except OSError:
        return None
