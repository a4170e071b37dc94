"""The CUDA caching allocator's facts and switches: expandable segments, its peak mark, its history.

What the guard asks of PyTorch's allocator, each through ``torch`` handed in (never imported):
turn on ``expandable_segments`` while that can still take effect, read the cell's peak without
resetting the user's ``max_memory_allocated()``, find the largest cached free block, and record
the allocator's history for https://pytorch.org/memory_viz (``--snapshot``; called "history"
here so it is not confused with the ``Snapshot`` record of ``%memsnap``).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, MutableMapping

from ..records.guard import AllocatorSetting, PeakReading

if TYPE_CHECKING:
    import os
    from types import ModuleType

__all__ = ["allocator_setting", "apply_allocator_setting", "cuda_peak_read", "cuda_peak_start", "dump_history",
           "expandable_now", "largest_free_block", "start_history", "stop_history"]

_ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*(\w+)")
_HISTORY_ENTRIES = 100_000



def allocator_setting(env: MutableMapping[str, str], device: str, initialized: bool,
                      enabled: bool = True) -> AllocatorSetting:
    """Turn on ``expandable_segments`` for this process when that can still take effect.

    Respects a user's own ``expandable_segments`` in PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_HIP_ALLOC_CONF; appends to an existing variable rather than replacing it.
    """
    if not device.startswith("cuda"):
        return AllocatorSetting("not-cuda")
    for name in _ALLOC_CONF_NAMES:
        value = env.get(name) or ""
        match = _EXPANDABLE.search(value)
        if match:
            return AllocatorSetting("already-on" if match.group(1) == "True" else "user-off", name, value)
    if not enabled:
        return AllocatorSetting("off")
    preferred = _alloc_conf_name()
    if initialized:
        return AllocatorSetting("needs-restart", preferred, "expandable_segments:True")
    # Append to a variable the user already set (the allocator reads only the first one it finds).
    name = next((n for n in _ALLOC_CONF_NAMES if env.get(n)), preferred)
    value = (env[name].rstrip(", ") + "," if env.get(name) else "") + "expandable_segments:True"
    env[name] = value
    return AllocatorSetting("set", name, value)


def _alloc_conf_name() -> str:
    """The variable to create: PYTORCH_CUDA_ALLOC_CONF, which every torch since 2.1 reads.

    torch 2.8+ prefers PYTORCH_ALLOC_CONF, but 2.9.x ignores expandable_segments given there for
    CUDA (pytorch/pytorch#183387); the old name works everywhere and only logs a deprecation
    note on 2.8-2.11.
    """
    return "PYTORCH_CUDA_ALLOC_CONF"


def apply_allocator_setting(torch: ModuleType | None, setting: AllocatorSetting) -> str | None:
    """Hand a just-set allocator variable to an already imported torch; the error text if it cannot.

    torch parses the variable once, the first time its allocator config is read; when torch was
    imported before the guard ran that may already have happened, so the value is also passed
    through ``torch._C._accelerator_setAllocatorSettings`` (``torch.cuda.memory._set_allocator_settings``
    before torch 2.9), which parses the setting without creating a CUDA context.
    """
    if torch is None or setting.action != "set" or setting.value is None:
        return None
    setter = getattr(getattr(torch, "_C", None), "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = getattr(getattr(getattr(torch, "cuda", None), "memory", None), "_set_allocator_settings", None)
    if setter is None:
        return None
    try:
        setter(setting.value)
        return None
    except Exception as exc:
        return f"could not pass {setting.value} to the allocator now: {exc}"


def largest_free_block(segments: list[dict[str, Any]], device: int | None = None) -> int | None:
    """The largest cached-but-unused block in ``torch.cuda.memory_snapshot()`` segments (None: none).

    A segment is ``{'device': int, 'total_size': int, 'blocks': [{'size': int, 'state': str}, ...]}``;
    a block whose state is 'inactive' is reserved by PyTorch and free for reuse.
    """
    best: int | None = None
    for segment in segments:
        if device is not None and segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                size = int(block.get("size", 0))
                best = size if best is None else max(best, size)
    return best


def cuda_peak_start(torch: ModuleType, index: int) -> int | None:
    """The allocator's peak mark before the cell (CUDA initialized only); never reset: it is the user's."""
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.max_memory_allocated(index))
    except Exception:
        return None


def cuda_peak_read(torch: ModuleType, index: int, was_initialized: bool, allocated_before: int | None,
                   mark_before: int | None = None, allocated_after: int | None = None) -> PeakReading:
    """The cell's allocator peak, read without resetting the user's ``max_memory_allocated()``.

    If the mark rose during the cell, the new mark is the cell's peak; if CUDA initialized inside
    the cell, the peak since is the cell's; otherwise the cell stayed under an earlier peak, and
    its own is known only when it equals the higher of the levels before and after.
    """
    try:
        if not torch.cuda.is_initialized():
            return PeakReading(None, None, "none", "CUDA was not used in this cell: no allocator peak")
        peak = int(torch.cuda.max_memory_allocated(index))
    except Exception as exc:
        return PeakReading(None, None, "none", f"torch.cuda.max_memory_allocated failed: {exc}")
    if not was_initialized:
        return PeakReading(peak, peak, "allocated",
                           "highest allocated by PyTorch since CUDA initialized in this cell")
    above = None if allocated_before is None else peak - allocated_before
    if mark_before is not None and peak > mark_before:
        return PeakReading(peak, above, "allocated",
                           "highest allocated by PyTorch during the cell (max_memory_allocated() rose in it; "
                           "read, never reset)")
    levels = [b for b in (allocated_before, allocated_after) if b is not None]
    if levels and mark_before is not None and max(levels) == peak:
        return PeakReading(peak, above, "allocated", "highest allocated by PyTorch during the cell")
    return PeakReading(None, None, "none",
                       "the cell stayed below an earlier allocator peak"
                       + (f" ({mark_before} bytes)" if mark_before is not None else "")
                       + ": its own peak is unknown (max_memory_allocated() is yours, so it is not reset)")


def start_history(torch: ModuleType) -> str | None:
    """Start recording allocator history (for PyTorch's memory viewer); the error text if it cannot.

    Recording applies to the devices the allocator has set up, so CUDA is initialized first
    (only ever for an explicit --snapshot on a CUDA device).
    """
    try:
        if not torch.cuda.is_initialized():
            torch.cuda.init()
        torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)
        return None
    except Exception as exc:
        return f"cannot record allocator history: {exc}"


def dump_history(torch: ModuleType, path: str | os.PathLike[str]) -> str:
    """Write the recorded history to ``path`` (a folder gets a timestamped file); return the file.

    The file is what PyTorch calls a memory snapshot (``_dump_snapshot``); its name keeps that word
    because https://pytorch.org/memory_viz and ``--snapshot`` call it so.
    """
    target = Path(path).expanduser()
    if target.is_dir():
        target = target / time.strftime("oom-snapshot-%Y%m%d-%H%M%S.pickle")
    torch.cuda.memory._dump_snapshot(str(target))
    return str(target)


def stop_history(torch: ModuleType) -> None:
    """Stop recording allocator history."""
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:
        pass


def expandable_now(env: Mapping[str, str]) -> bool | None:
    """Whether the allocator variables turn ``expandable_segments`` on (None: none of them says)."""
    for name in _ALLOC_CONF_NAMES:
        match = _EXPANDABLE.search(env.get(name) or "")
        if match:
            return match.group(1) == "True"
    return None
