"""Take a snapshot of a device: its reading, its live storages and who holds each one."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ._torch import loaded_torch
from .devices import DeviceReading, read_device, resolve_device
from .holders import GARBAGE, OTHER, OUTPUT_CACHE, STALE_KINDS, TRACEBACK, USER, attribute, attribute_reachable
from .jupyter_kernels import KernelInfo
from .mapped import mapped_bytes
from .nvml import Nvml
from .roots import Roots, collect_roots
from .tracker import StorageRecord, find_tensors, pins_nothing, tensor_types

HOLDER_KINDS = (USER, OUTPUT_CACHE, TRACEBACK, GARBAGE, OTHER)


@dataclass(frozen=True)
class HolderGroup:
    """Storages grouped under one holder path, for the top-N table."""

    kind: str
    path: str
    bytes: int
    storages: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    """What uses a device right now and who holds it; int bytes, None where unknown."""

    device: str
    reading: DeviceReading
    storages: tuple[StorageRecord, ...]
    bytes_by_kind: tuple[tuple[str, int], ...]
    scan_seconds: float
    objects_scanned: int
    attribution_complete: bool
    notes: tuple[str, ...] = ()
    top_n: int = 10
    view: str = "table"  # "table" or "json": how the notebook/terminal shows it
    heap_scan: bool = True  # False: the quick view (no heap pass; garbage and library-held not found)
    # Other processes that are kernels of this user's Jupyter servers: (pid, notebook and how to stop it).
    kernels: tuple[tuple[int, KernelInfo], ...] = ()
    # cpu: bytes of your variables' storages that are views of a memory-mapped file (safetensors
    # weights in their stored dtype): not resident until read; None where not read (not Linux, CUDA).
    user_mapped_bytes: int | None = None

    # Figures the user asks for by name.
    def kind_bytes(self, kind: str) -> int:
        """Bytes of storages held by one holder kind (user, output-cache, traceback, garbage, other)."""
        return dict(self.bytes_by_kind).get(kind, 0)

    @property
    def tracked_bytes(self) -> int:
        """Bytes in every live storage the heap scan found on this device."""
        return sum(b for _, b in self.bytes_by_kind)

    @property
    def user_bytes(self) -> int:
        """Bytes reachable from the user's variables."""
        return self.kind_bytes(USER)

    @property
    def stale_bytes(self) -> int:
        """Bytes only the output cache, a stored traceback or garbage holds: safe to free."""
        return sum(self.kind_bytes(k) for k in STALE_KINDS)

    @property
    def other_bytes(self) -> int:
        """Bytes held by something else (a library global, an object the walk could not name)."""
        return self.kind_bytes(OTHER)

    @property
    def untracked_bytes(self) -> int | None:
        """Allocator total minus tracked storages (autograd graph, workspaces); None without an allocator."""
        if self.reading.allocated is None or self.device == "cpu":
            return None
        return self.reading.allocated - self.tracked_bytes

    def holders(self, kind: str | None = None) -> tuple[HolderGroup, ...]:
        """Storages grouped by holder path, largest first (optionally one kind only)."""
        groups = self._holder_groups
        return groups if kind is None else tuple(g for g in groups if g.kind == kind)

    @cached_property
    def _holder_groups(self) -> tuple[HolderGroup, ...]:
        # Grouped once per snapshot: every view of it (table, caption, details, exports) asks again.
        groups: dict[tuple[str, str], list[StorageRecord]] = {}
        for record in self.storages:
            groups.setdefault((record.holder_kind, record.holder_path or "?"), []).append(record)
        result = []
        for (k, path), rs in groups.items():
            largest = max(rs, key=lambda r: r.bytes)
            result.append(HolderGroup(k, path, sum(r.bytes for r in rs), len(rs), largest.dtype, largest.shape))
        return tuple(sorted(result, key=lambda g: (-g.bytes, g.path)))

    def held_by(self, path_prefix: str) -> int:
        """Bytes of storages whose holder path starts with ``path_prefix`` (e.g. ``"model"``)."""
        return sum(r.bytes for r in self.storages
                   if r.holder_path is not None and _path_under(r.holder_path, path_prefix))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every figure (int bytes, None where unknown)."""
        from .render.json import snapshot_dict

        return snapshot_dict(self)

    def __repr__(self) -> str:
        return (f"<Snapshot {self.device}: {len(self.storages)} storages, user={self.user_bytes} B, "
                f"stale={self.stale_bytes} B, untracked={self.untracked_bytes}>")

    def __str__(self) -> str:
        from .render.text import snapshot_text

        return snapshot_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.to_json_text() if self.view == "json" else str(self))

    def _repr_html_(self) -> str | None:
        if self.view == "json":
            return None
        from .render.html import snapshot_html

        return snapshot_html(self)

    def to_json_text(self) -> str:
        """The snapshot as indented JSON text."""
        import json

        return json.dumps(self.to_dict(), indent=2)


def _path_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "[", prefix + " "))


@pins_nothing
def snapshot(device: str | None = None, *, roots: Roots | None = None, nvml: Nvml | None = None,
             top: int = 10, find_garbage: bool = True, heap_scan: bool = True,
             budget_seconds: float = 5.0, name_kernels: bool = False) -> Snapshot:
    """Read ``device`` and attribute every live tensor storage on it to its holder.

    ``heap_scan=False`` is the quick view the after-cell hook uses on big heaps: only what the
    user's variables, the output cache and stored tracebacks reach is found (no ``gc`` pass), so
    garbage and library-held tensors are left out, and a note says so. ``name_kernels`` asks this
    user's Jupyter servers which notebooks the other processes on the device belong to (%gpumem).
    """
    started = time.perf_counter()
    where = resolve_device(device, nvml)
    reading = read_device(where, nvml)
    kernels = _kernels_on(reading) if name_kernels else ()
    torch = loaded_torch()
    if torch is None:
        return Snapshot(where, reading, (), (), time.perf_counter() - started, 0, True,
                        ("torch is not imported in this process: no tensors to attribute",), top, kernels=kernels)
    roots = roots if roots is not None else collect_roots()
    types = tensor_types(torch)
    if heap_scan:
        live = find_tensors(torch, where)
        try:
            attribution = attribute(live, roots, torch, types, find_garbage=find_garbage,
                                    budget_seconds=budget_seconds)
        except BaseException:
            live.release()
            raise
    else:
        live, attribution = attribute_reachable(roots, torch, types, where, budget_seconds=budget_seconds)
    try:
        holders = attribution.holders
        storages = tuple(
            StorageRecord(r.key, r.device, r.bytes, r.dtype, r.shape, r.tensor_count, h.kind, h.path, r.address)
            if (h := holders.get(key)) else r
            for key, r in live.storages.items()
        )
    finally:
        live.release()
    totals = {kind: 0 for kind in HOLDER_KINDS}
    for record in storages:
        totals[record.holder_kind] += record.bytes
    notes: list[str] = []
    if not heap_scan:
        notes.append(f"quick view: heap scan skipped, only what your variables, the output cache and stored "
                     f"tracebacks reach is counted ({attribution.nodes_walked:,} objects walked); garbage and "
                     f"library-held tensors are not — %gpumem scans the whole heap")
    if not attribution.complete:
        notes.append(f"holder walk stopped after {attribution.nodes_walked:,} objects: "
                     + ("some holders are shown as 'other'" if heap_scan else "tensors beyond it are not counted"))
    if live.byteless:
        notes.append(f"{live.byteless} meta/fake tensors hold no device bytes and are not counted")
    if live.unreadable:
        notes.append(f"{live.unreadable} tensors' storage could not be read and is not counted "
                     "(a wrapper subclass holds none of its own; its inner tensors are counted)")
    # How to free what a path alone does not say how to (an lru cache: `cached.cache_clear()`), once each.
    hints = dict.fromkeys(h.hint for h in holders.values() if h.hint)
    notes += [f"to free what {hint.removesuffix('.cache_clear()')}'s cache holds: {hint}" for hint in hints]
    user_mapped = None
    if where == "cpu":
        from .render.units import format_bytes  # a note's figure (records format nothing else)

        user_mapped = mapped_bytes((r.address, r.bytes) for r in storages if r.holder_kind == USER and r.address)
        if user_mapped:
            notes.append(f"{format_bytes(user_mapped)} of user is mapped from files (weights loaded in their "
                         "stored dtype): resident only once read, and deleting them gives no resident memory back")
    storages = tuple(sorted(storages, key=lambda r: -r.bytes))
    return Snapshot(where, reading, storages, tuple(totals.items()), time.perf_counter() - started,
                    live.objects_scanned, attribution.complete, tuple(notes), top, heap_scan=heap_scan,
                    kernels=kernels, user_mapped_bytes=user_mapped)


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
        from .jupyter_kernels import find_jupyter_kernels

        found = find_jupyter_kernels(pids, timeout=KERNEL_LOOKUP_TIMEOUT)
    except Exception:  # naming a notebook is a nicety: the table shows the pid without it
        return ()
    return tuple(sorted(found.items()))
