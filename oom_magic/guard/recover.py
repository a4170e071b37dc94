"""The guard's recovery after an out-of-memory error: give back what the failed load left, then explain it.

``give_back`` clears the frames of the exception's traceback, drops ``sys.last_*``, frees stale
memory (as ``%freeall``), collects garbage and empties the cache, and counts what came back;
``diagnose_failure`` gathers the figures ``diagnose`` ranks causes with (the fit check, the
budgets, other Jupyter kernels on the GPU).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, MutableMapping

from ..common._torch import cuda_initialized
from ..device.allocator import expandable_now, largest_free_block
from ..heap.cleanup import FreeReport, free_stale
from ..device.reading import DeviceReading, cuda_index, read_device
from .diagnose import diagnose
from .measure import AttemptStart, GuardedReading, holders_of, storage_bytes
from ..fit.preflight import parse_headroom, usable_ram
from ..records.guard import GiveBack
from ..heap.release import clear_frames, drop_last_exception, empty_cache

if TYPE_CHECKING:
    from types import ModuleType

    from .oom import OOMMessage
    from ..fit.preflight import FitCheck, Preflight
    from ..records.diagnosis import Diagnosis
    from ..records.guard import Rehearsal

__all__ = ["AtFailure", "GivenBack", "at_failure", "diagnose_failure", "give_back"]


@dataclass(frozen=True)
class AtFailure:
    """The device as the load failed: its reading, the live storages, and the largest cached free block."""

    reading: DeviceReading
    storages: dict[int, int]
    largest_free_block: int | None


def at_failure(torch: ModuleType | None, device: str, reading: DeviceReading) -> AtFailure:
    """Take the figures at the failure, before anything is given back."""
    return AtFailure(reading, storage_bytes(torch, device), _largest_free_block(torch, device))


def _largest_free_block(torch: ModuleType | None, device: str) -> int | None:
    if not device.startswith("cuda") or torch is None or not cuda_initialized():
        return None
    try:
        return largest_free_block(torch.cuda.memory_snapshot(), cuda_index(device) or 0)
    except Exception:
        return None


@dataclass(frozen=True)
class GivenBack:
    """What the give-back did, the reading after it, and the user variables that still hold device memory."""

    record: GiveBack
    after: GuardedReading
    holders: tuple[tuple[str, int], ...]


def give_back(exc: BaseException, start: AttemptStart, failed: AtFailure, *, torch: ModuleType | None, device: str,
              shell: Any, namespace: dict, read: Callable[[], GuardedReading], notes: list[str]) -> GivenBack:
    """Let go of everything the failed load left, and measure what came back (a failed step becomes a note)."""
    frames = clear_frames(exc)
    del exc
    dropped = drop_last_exception(namespace)
    try:
        stale: FreeReport | None = free_stale(device, shell=shell, namespace=namespace)
    except Exception as error:  # the recovery must not hide the out-of-memory error
        stale = None
        notes.append(f"freeing stale memory after the failure did not finish: {error}")
    gc.collect()
    empty_cache(torch, device)
    after = read()
    after_storages = storage_bytes(torch, device)
    new = set(failed.storages) - set(start.storages)
    failed_freed = sum(failed.storages[k] for k in new if k not in after_storages)
    still = {k for k in new if k in after_storages}
    stale_freed = sum(b for k, b in start.storages.items() if k not in after_storages)
    still_by: tuple[str, ...] = ()
    holders: tuple[tuple[str, int], ...] = ()
    if torch is not None:
        try:
            still_by, holders = holders_of(torch, device, still, shell, namespace)
        except Exception as error:
            notes.append(f"could not name what holds the device memory: {error}")
    record = GiveBack(failed_freed, stale_freed, sum(after_storages[k] for k in still), still_by,
                      frames, dropped, failed.reading, after.reading, stale)
    return GivenBack(record, after, holders)


def diagnose_failure(message: OOMMessage | None, start: AttemptStart, failed: AtFailure, given: GivenBack, *,
                     device: str, preflight: Preflight | None, cleanup: FreeReport | None,
                     env: MutableMapping[str, str], headroom: str | int | None,
                     rehearsal: Rehearsal | None) -> Diagnosis:
    """Rank the likely causes of the failure with every figure the guard has."""
    check = _fit_check(preflight, device)
    after = given.after.reading
    capped = rehearsal is not None and rehearsal.cap is not None
    room = parse_headroom(headroom, rehearsal.target.total if capped and rehearsal is not None else after.total)
    return diagnose(
        message, device=device, before=start.reading, at_failure=failed.reading, now=after,
        stale_freed_before=cleanup.freed_bytes if cleanup else None,
        stale_given_back=given.record.stale_bytes, given_back=given.record.failed_load_bytes,
        still_held=given.record.still_held_bytes, holders=given.holders,
        estimate=check.estimate if check else None, need=check.need if check else None,
        dtype=check.dtype if check else None, loader=check.call.kind if check else "from_pretrained",
        largest_free_block=failed.largest_free_block,
        expandable_segments=expandable_now(env) if device.startswith("cuda") else None,
        cuda_initialized_before=start.cuda_was_initialized, headroom=room,  # --target: a percentage of the target
        ram_budget=_ram_budget(headroom), disk_budget=_disk_budget(),
        free_limit=given.after.free_limit if device == "cpu" else None,
        process_limit=given.after.process_cap, kernels=_other_kernels(device, message, failed.reading),
        fit_budget=check.budget if check is not None and check.device == device and not check.split else None)


def _fit_check(preflight: Preflight | None, device: str) -> FitCheck | None:
    """The preflight check for the load on this device (its estimate and need), if any."""
    if preflight is None:
        return None
    sized = [c for c in preflight.checks if c.estimate is not None]
    same = [c for c in sized if c.device == device or (c.device == "auto" and any(d == device for d, _ in c.split))]
    found = same or sized
    return found[0] if found else None


def _ram_budget(headroom: str | int | None) -> int | None:
    usable, _ = usable_ram()
    if usable is None:
        return None
    cpu_total = read_device("cpu").total
    return max(usable - parse_headroom(headroom, cpu_total), 0)


def _disk_budget() -> int | None:
    import shutil

    try:
        return int(shutil.disk_usage(os.getcwd()).free)
    except OSError:
        return None


def _other_kernels(device: str, message: OOMMessage | None, reading: DeviceReading) -> dict[int, Any]:
    """Which other processes on the GPU are this user's Jupyter kernels, with their notebooks."""
    if not device.startswith("cuda"):
        return {}
    me = os.getpid()
    pids = {pid for pid, _ in (message.processes if message else ()) if pid != me}
    pids |= {p.pid for p in reading.processes if not p.is_self}
    if not pids:
        return {}
    try:
        from ..device.jupyter_kernels import find_jupyter_kernels

        return find_jupyter_kernels(pids)
    except Exception:  # naming kernels is a nicety: never a reason to fail the recovery
        return {}
