"""Take a snapshot of a device: its reading, its live storages and who holds each one.

The record it returns (``Snapshot``) lives in ``records.snapshot``; it is re-exported here.
"""
from __future__ import annotations

import gc

import time
from dataclasses import replace
from itertools import compress, count
from operator import attrgetter
from typing import Any

from ..common._torch import loaded_torch
from ..device.reading import DeviceReading, read_device, resolve_device
from .holders import attribute, attribute_reachable, recheck_remembered
from ..device.mapped import file_pages_of, process_file_resident
from ..device.nvml import Nvml
from ..render.units import format_bytes  # a note's figure (a leaf module: no cycle)
from ..records.snapshot import (HOLDER_KINDS, USER, FilePages, HolderGroup, HolderKind, KernelInfo, Snapshot,
                                StorageRecord)
from .roots import Roots, collect_roots
from .tracker import find_tensors, pins_nothing, tensor_types

__all__ = ["HOLDER_KINDS", "HolderGroup", "KERNEL_LOOKUP_TIMEOUT", "Snapshot", "snapshot"]

@pins_nothing
def snapshot(device: str | None = None, *, roots: Roots | None = None, nvml: Nvml | None = None,
             top: int = 10, find_garbage: bool = True, heap_scan: bool = True,
             budget_seconds: float = 5.0, name_kernels: bool = False) -> Snapshot:
    """Read ``device`` and attribute every live tensor storage on it to its holder.

    ``heap_scan=False`` is the quick view the after-cell hook uses on big heaps: only what the
    user's variables, the output cache and stored tracebacks reach is found (no ``gc`` pass), so
    garbage and library-held tensors are left out, and a note says so. Its ``budget_seconds`` counts
    from the call (the device's reading comes out of it); the walk gets what is left, at least
    ``QUICK_WALK_FLOOR_SECONDS``. ``name_kernels`` asks this user's Jupyter servers which notebooks
    the other processes on the device belong to (%gpumem).
    """
    started = time.perf_counter()
    where = resolve_device(device, nvml)
    reading = read_device(where, nvml)
    kernels = _kernels_on(reading) if name_kernels else ()
    torch = loaded_torch()
    if torch is None:
        pages = _with_file_pages((), [], [])[1] if where == "cpu" else None  # this process's own file pages still count
        return Snapshot(where, reading, (), (), time.perf_counter() - started, 0, True,
                        ("torch is not imported in this process: no tensors to attribute",), top, kernels=kernels,
                        file_pages=pages)
    roots = roots if roots is not None else collect_roots()
    types = tensor_types(torch)
    counters = _allocation_counters(torch, where) if heap_scan else None
    unchanged = _unchanged_since_last(where, counters, roots, torch)
    if unchanged is not None:
        return _finish(where, reading, unchanged, [_UNCHANGED_NOTE], started, 0, True, top, heap_scan, kernels, None)
    if heap_scan:
        live = find_tensors(torch, where)
        try:
            attribution = attribute(live, roots, torch, types, find_garbage=find_garbage,
                                    budget_seconds=budget_seconds)
        except BaseException:
            live.release()
            raise
    else:
        left = budget_seconds - (time.perf_counter() - started)
        live, attribution = attribute_reachable(roots, torch, types, where,
                                                budget_seconds=max(left, QUICK_WALK_FLOOR_SECONDS))
    try:
        holders = attribution.holders
        storages = tuple(live.records(holders))
        sizes, addresses = live.sizes_and_addresses()  # in the records' order, read without a record each
    finally:
        live.release()
    notes: list[str] = []
    if not heap_scan:
        notes.append(f"quick view: heap scan skipped, only what your variables, the output cache and stored "
                     f"tracebacks reach is counted ({attribution.nodes_walked:,} objects walked); garbage and "
                     f"library-held tensors are not — %gpumem scans the whole heap")
    if not attribution.complete:
        notes.append(f"holder walk stopped after {attribution.nodes_walked:,} objects: "
                     + ("some holders are shown as 'other'" if heap_scan else "tensors beyond it are not counted"))
    frozen = gc.get_freeze_count() if heap_scan else 0
    if frozen:
        # gc.get_objects() skips the permanent generation: what gc.freeze() moved there is not seen
        notes.append(f"{frozen:,} objects were frozen by gc.freeze() (servers do it after start-up) and are "
                     "outside the heap scan: tensors among them are not counted; gc.unfreeze() before "
                     "%gpumem shows them")
    if live.byteless:
        notes.append(f"{live.byteless} meta/fake tensors hold no device bytes and are not counted")
    if live.unreadable:
        notes.append(f"{live.unreadable} tensors' storage could not be read and is not counted "
                     "(a wrapper subclass holds none of its own; its inner tensors are counted)")
    # How to free what a path alone does not say how to (an lru cache: `cached.cache_clear()`), once each.
    hints = dict.fromkeys(filter(None, map(_HINT, holders.values())))
    notes += [f"to free what {hint.removesuffix('.cache_clear()')}'s cache holds: {hint}" for hint in hints]
    pages = None
    if where == "cpu":
        storages, pages = _with_file_pages(storages, addresses, sizes)
        if pages is not None and pages.mapped_bytes:
            resident = (f", {format_bytes(pages.resident)} of it in memory now" if pages.resident is not None
                        else f", at most {format_bytes(pages.process_file_resident)} of it in memory now"
                        if pages.process_file_resident is not None else "")
            notes.append(f"{format_bytes(pages.mapped_bytes)} of tensors are views of "
                         f"{format_bytes(pages.file_bytes)} of {pages.files} memory-mapped "
                         f"file{'s' if pages.files != 1 else ''}{resident} (weights loaded in their stored dtype): "
                         "file pages, which the kernel can drop, so the bar counts them as available, not used; "
                         "deleting those tensors gives no memory back")
    if counters is not None:
        _ALLOCATOR_SEEN[where] = (counters, storages)
    return _finish(where, reading, storages, notes, started, attribution.nodes_walked, attribution.complete, top,
                   heap_scan, kernels, pages, sizes, heap_passed=heap_scan)


def _finish(where: str, reading: DeviceReading, storages: tuple[StorageRecord, ...], notes: list[str],
            started: float, walked: int, complete: bool, top: int, heap_scan: bool,
            kernels: tuple[tuple[int, KernelInfo], ...], pages: FilePages | None,
            sizes: list[int] | None = None, heap_passed: bool = False) -> Snapshot:
    """The snapshot, its storages largest first; ``sizes``: their bytes in order, where known without a read."""
    kinds, sizes = list(map(_KIND, storages)), sizes if sizes is not None else list(map(_BYTES, storages))
    totals = {kind: sum(compress(sizes, map(kind.__eq__, kinds))) for kind in HOLDER_KINDS}
    largest_first = sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True)  # stable: ties keep their order
    storages = tuple(map(storages.__getitem__, largest_first))
    return Snapshot(where, reading, storages, tuple(totals.items()), time.perf_counter() - started,
                    walked, complete, tuple(notes), top, heap_scan=heap_scan,
                    kernels=kernels, file_pages=pages, heap_passed=heap_passed)


def _with_file_pages(storages: tuple[StorageRecord, ...], addresses: list[int],
                     sizes: list[int]) -> tuple[tuple[StorageRecord, ...], FilePages | None]:
    """cpu: mark each storage's bytes that are views of a memory-mapped file, and sum them by holder kind
    (``addresses`` and ``sizes``: the storages', in order)."""
    views = file_pages_of(addresses, sizes)
    if views is None:
        return storages, None  # not Linux: no /proc/self/maps to tell file pages from anonymous memory
    by_kind: dict[HolderKind, int] = {}
    marked = list(storages)
    for at in compress(count(), views.mapped):
        record, mapped = marked[at], views.mapped[at]
        by_kind[record.holder_kind] = by_kind.get(record.holder_kind, 0) + mapped
        marked[at] = replace(record, mapped_bytes=mapped)
    return tuple(marked), FilePages(tuple(sorted(by_kind.items())), views.file_bytes, views.resident, views.files,
                                    process_file_resident())


# The quick view's walk always gets this long, however little of its budget the reading left.
QUICK_WALK_FLOOR_SECONDS = 0.01
_BYTES, _KIND, _HINT = (attrgetter(name) for name in ("bytes", "holder_kind", "hint"))
_UNCHANGED_NOTE = ("the allocator's allocation and free counts have not moved since the last scan: its storages' "
                   "remembered paths were re-checked, with no heap pass")
# device -> (the allocator's (allocated, freed) block counts, the storages found then). Records
# only: plain ints and strings, no tensor.
_ALLOCATOR_SEEN: dict[str, tuple[tuple[int, int], tuple[StorageRecord, ...]]] = {}


def _allocation_counters(torch: Any, where: str) -> tuple[int, int] | None:
    """How many blocks the CUDA allocator has ever allocated and freed on this device, or None.

    Asked only where a CUDA context already exists (``is_initialized``): never creates one.
    """
    if not where.startswith("cuda"):
        return None
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        index = int(where.split(":", 1)[1]) if ":" in where else int(cuda.current_device())
        stats = cuda.memory_stats(index)
        return int(stats["allocation.all.allocated"]), int(stats["allocation.all.freed"])
    except Exception:  # an older torch without the counters, or a device gone: scan the heap
        return None


def _unchanged_since_last(where: str, counters: tuple[int, int] | None, roots: Roots,
                          torch: Any) -> tuple[StorageRecord, ...] | None:
    """The last scan's storages with their holders re-checked, when no block was allocated or freed
    since (the same storages are alive) and every one was user-held and its path still reaches it;
    None where a heap pass is needed."""
    seen = _ALLOCATOR_SEEN.get(where)
    if counters is None or seen is None or seen[0] != counters:
        return None
    previous = seen[1]
    if any(r.holder_kind != USER for r in previous):
        return None  # a stale or library holder can change hands without an allocation: scan
    holders = recheck_remembered([r.key for r in previous], roots, torch)
    if holders is None:
        return None
    return tuple(replace(r, holder_path=holders[r.key].path) for r in previous)


# Seconds each Jupyter server may take to name its kernels (at most one second in all per server).
KERNEL_LOOKUP_TIMEOUT = 0.5


def _kernels_on(reading: DeviceReading) -> tuple[tuple[int, KernelInfo], ...]:
    """Which other processes on the device are kernels of this user's Jupyter servers, with their notebooks.

    Asked only for this user's processes that look like kernels (another user's process is never
    looked into), at most KERNEL_LOOKUP_TIMEOUT per server; an unreachable server names nothing.
    """
    pids = [p.pid for p in reading.processes if p.is_jupyter_kernel and not p.is_self and p.note is None]
    if not pids:
        return ()
    try:
        from ..device.jupyter_kernels import find_jupyter_kernels

        found = find_jupyter_kernels(pids, timeout=KERNEL_LOOKUP_TIMEOUT)
    except Exception:  # naming a notebook is a nicety: the table shows the pid without it
        return ()
    return tuple(sorted(found.items()))
