"""Check that an offload plan can run here: room on disk at the offload folder and in CPU RAM.

``device_map="auto"`` with ``max_memory`` and ``offload_folder`` moves what does not fit on the
GPU to CPU RAM and then to disk. Before advising such a plan, ``check_offload`` says whether the
folder exists or could be created, whether its disk has room for the disk share, and whether
the CPU share fits in available RAM; each shortfall is one line with the amount missing. It never
creates the folder or writes anything.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..common.errors import OomMagicError
from ..device.host import disk_free, ram_available
from ..records.preflight import OffloadCheck

__all__ = ["OffloadCheck", "check_offload"]


def _nearest_existing(path: Path) -> Path:
    """The path itself if it exists, else its closest existing ancestor."""
    current = path
    while not current.exists():
        if current.parent == current:
            break
        current = current.parent
    return current


def _writable_dir(path: Path) -> bool:
    """Whether this process may create entries in ``path`` (as its effective user, where the OS can say)."""
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.W_OK | os.X_OK, effective_ids=effective)


def check_offload(plan_bytes_cpu: int, plan_bytes_disk: int, offload_folder: str | os.PathLike[str]) -> OffloadCheck:
    """Say whether ``plan_bytes_cpu`` fits in available RAM and ``plan_bytes_disk`` on disk at ``offload_folder``.

    The folder need not exist: it counts as creatable when its nearest existing parent is a
    directory this process may write into (``os.access``). Folder problems are shortfalls only
    when the plan puts something on disk. Free space is read where the folder is or would be.
    """
    from ..render.units import format_bytes

    for label, value in (("plan_bytes_cpu", plan_bytes_cpu), ("plan_bytes_disk", plan_bytes_disk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OomMagicError(f"{label} must be a whole number of bytes >= 0, not {value!r}")
    folder = Path(os.path.abspath(os.path.expanduser(os.fspath(offload_folder))))
    anchor = _nearest_existing(folder)
    folder_exists = folder.is_dir()
    if anchor == folder:
        creatable = folder_exists and _writable_dir(folder)
    else:
        creatable = anchor.is_dir() and _writable_dir(anchor)
    disk_free_bytes = disk_free(anchor)
    ram_free = ram_available()

    shortfalls: list[str] = []
    if plan_bytes_disk > 0:
        if anchor == folder and not folder_exists:
            shortfalls.append(f"offload folder {folder} is a file, not a folder: choose another offload_folder")
        elif anchor != folder and not anchor.is_dir():
            shortfalls.append(f"offload folder {folder} cannot be created: {anchor} is a file, not a folder")
        elif not creatable:
            where = folder if folder_exists else anchor
            verb = "is not writable" if folder_exists else "is not writable, so the folder cannot be created"
            shortfalls.append(f"offload folder {folder}: {where} {verb} by this process")
        if disk_free_bytes is not None and plan_bytes_disk > disk_free_bytes:
            shortfalls.append(
                f"disk at {anchor}: the plan offloads {format_bytes(plan_bytes_disk)} but only "
                f"{format_bytes(disk_free_bytes)} is free; short by {format_bytes(plan_bytes_disk - disk_free_bytes)}"
            )
    if ram_free is not None and plan_bytes_cpu > ram_free:
        shortfalls.append(
            f"CPU RAM: the plan keeps {format_bytes(plan_bytes_cpu)} in RAM but only "
            f"{format_bytes(ram_free)} is available; short by {format_bytes(plan_bytes_cpu - ram_free)}"
        )
    return OffloadCheck(
        folder=folder,
        folder_exists=folder_exists,
        folder_creatable=creatable,
        disk_free=disk_free_bytes,
        ram_available=ram_free,
        shortfalls=tuple(shortfalls),
    )
