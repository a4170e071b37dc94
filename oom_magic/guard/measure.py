"""Measure what a guarded cell did to memory: readings under a cap, heap scans, the peak, changed variables.

Every function takes the user's ``torch`` (or None) and the device; none keeps a tensor: the
figures are plain ints keyed by storage, so measuring never holds what the cell made alive.

Peak figures. CUDA: see ``allocator.cuda_peak_read``. CPU (Linux): the process's resident
high-water mark is reset by writing 5 to ``/proc/self/clear_refs`` (this resets VmHWM and
``ru_maxrss`` for the process) and read from ``/proc/self/status`` after; elsewhere the peak is
given only when the process's lifetime peak rose during the cell, else None with the reason.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..common._torch import cuda_initialized
from ..device.allocator import cuda_peak_read, cuda_peak_start
from ..device.reading import DeviceReading, cuda_index, read_device
from ..fit.preflight import cuda_process_cap, usable_ram
from ..records.guard import ChangeKind, PeakReading, VariableUse
from ..heap.roots import Roots, collect_roots, is_user_name

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["AttemptStart", "GuardedReading", "VarBytes", "cell_peak", "changed_variables", "delta", "holders_of",
           "read_guarded", "start_attempt", "storage_bytes", "user_ids"]


@dataclass(frozen=True)
class GuardedReading:
    """A device reading with ``free`` as this process may still use it, and the limits that said so."""

    reading: DeviceReading
    process_cap: int | None  # CUDA: bytes this process may reserve (set_per_process_memory_fraction)
    free_limit: str | None  # CPU: what limits usable RAM (a cgroup, an rlimit), if anything


def read_guarded(device: str, torch: ModuleType | None, cap_limit: int | None = None) -> GuardedReading:
    """Read the device; on CUDA ``free`` is what the process cap leaves, on CPU what this process may use.

    ``cap_limit``: the cap --target set, for a torch (< 2.9) that cannot read its fraction back.
    """
    reading = read_device(device)
    cap = cuda_process_cap(device, torch) if device.startswith("cuda") else None
    if cap is None:
        cap = cap_limit
    if cap is not None and reading.free is not None:
        # set_per_process_memory_fraction: what this process may still reserve, not the device's free
        free = min(reading.free, max(cap - (reading.reserved or 0), 0))
        reading = replace(reading, free=free, notes=reading.notes + (
            f"this process may reserve at most {cap} bytes (torch.cuda.set_per_process_memory_fraction)",))
    limit = None
    if device == "cpu":
        usable, limit = usable_ram()
        if usable is not None and (reading.free is None or usable < reading.free):
            notes = reading.notes + ((f"free is limited by {limit}",) if limit else ())
            reading = replace(reading, free=usable, notes=notes)
    return GuardedReading(reading, cap, limit)


# --------------------------------------------------------------------------- before an attempt


@dataclass(frozen=True)
class VarBytes:
    """The tensor bytes one user variable reaches: in all, per device, per dtype."""

    total: int
    by_device: dict[str, int]
    by_dtype: dict[str, int]


@dataclass(frozen=True)
class AttemptStart:
    """Figures taken just before an attempt (plain ints and readings: no tensor is kept)."""

    reading: DeviceReading
    storages: dict[int, int]
    cuda_was_initialized: bool
    rss: int | None
    rss_peak_reset: bool
    max_rss: int | None
    started: float
    cuda_peak_before: int | None = None  # max_memory_allocated() before the attempt (read, not reset)
    variables: dict[str, VarBytes] | None = None  # first attempt: what each user variable reached

    def seconds(self) -> float:
        """Wall time since the attempt started."""
        return time.perf_counter() - self.started


def start_attempt(torch: ModuleType | None, device: str, reading: DeviceReading, shell: Any, namespace: dict,
                  with_variables: bool) -> AttemptStart:
    """Take the figures an attempt is measured against; the clock starts last."""
    was_initialized = cuda_initialized()
    peak_mark = None
    if device.startswith("cuda") and torch is not None:
        peak_mark = cuda_peak_start(torch, cuda_index(device) or 0)
    storages, variables = _scan(torch, device, shell, namespace, variables=with_variables)
    reset = device == "cpu" and _reset_rss_peak()
    return AttemptStart(reading, storages, was_initialized, reading.process_used, reset, _max_rss(),
                        time.perf_counter(), peak_mark, variables if with_variables else None)


def user_ids(namespace: dict) -> dict[str, int]:
    """The id of every user variable's value (to tell new and rebound names after the cell)."""
    return {k: id(v) for k, v in list(dict.items(namespace)) if is_user_name(k)}


# --------------------------------------------------------------------------- CPU pieces


def _reset_rss_peak() -> bool:
    """Reset this process's resident high-water mark (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int | None:
    """VmHWM from /proc/self/status, in bytes."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _max_rss() -> int | None:
    try:
        import resource

        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(value) * (1 if sys.platform == "darwin" else 1024)
    except Exception:
        return None


# --------------------------------------------------------------------------- heap scans


def storage_bytes(torch: ModuleType | None, device: str) -> dict[int, int]:
    """Storage key -> bytes for every live tensor storage on the device (no tensor kept)."""
    if torch is None:
        return {}
    from ..heap.tracker import find_tensors

    live = find_tensors(torch, device)
    try:
        return dict(live.sizes)
    finally:
        live.release()


def scan_variables(torch: ModuleType | None, device: str, shell: Any,
                   namespace: dict) -> tuple[dict[int, int], dict[str, VarBytes]]:
    """One heap pass: storage key -> bytes on ``device``, and the tensor bytes each user variable
    reaches on every device (a storage counts under its first holder)."""
    return _scan(torch, device, shell, namespace, variables=True)


def _scan(torch: ModuleType | None, device: str, shell: Any, namespace: dict,
          variables: bool) -> tuple[dict[int, int], dict[str, VarBytes]]:
    if torch is None:
        return {}, {}
    if not variables:
        return storage_bytes(torch, device), {}
    from ..heap.holders import attribute
    from ..heap.tracker import find_tensors, tensor_types

    roots = collect_roots(shell, namespace)
    live = find_tensors(torch, None)
    try:
        on_device = {key: r.bytes for key, r in live.storages.items() if r.device == device}
        holders = attribute(live, Roots(user=roots.user, containers=roots.containers), torch, tensor_types(torch),
                            find_garbage=False, trace_other=False).holders
        result: dict[str, VarBytes] = {}
        for key, holder in holders.items():
            record = live.storages[key]
            entry = result.get(holder.root) or VarBytes(0, {}, {})
            entry.by_device[record.device] = entry.by_device.get(record.device, 0) + record.bytes
            entry.by_dtype[record.dtype] = entry.by_dtype.get(record.dtype, 0) + record.bytes
            result[holder.root] = VarBytes(entry.total + record.bytes, entry.by_device, entry.by_dtype)
        return on_device, result
    finally:
        live.release()


def holders_of(torch: ModuleType, device: str, keys: set[int], shell: Any, namespace: dict) -> tuple[
        tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(paths holding these storages, user variables holding device memory as (name, bytes))."""
    from ..heap.holders import USER, attribute
    from ..heap.tracker import find_tensors, tensor_types

    live = find_tensors(torch, device)
    try:
        holders = attribute(live, collect_roots(shell, namespace), torch, tensor_types(torch),
                            find_garbage=False, trace_other=True).holders
        held: dict[str, int] = {}
        for k in keys:
            if k in holders:
                # A user variable by its name (`model`), anything else by its path.
                name = holders[k].root if holders[k].kind == USER else holders[k].path
                held[name] = held.get(name, 0) + live.sizes[k]
        paths = tuple(name for name, _ in sorted(held.items(), key=lambda kv: -kv[1]))
        per_root: dict[str, int] = {}
        for key, holder in holders.items():
            if holder.kind == USER:
                per_root[holder.root] = per_root.get(holder.root, 0) + live.sizes[key]
        return paths, tuple(sorted(per_root.items(), key=lambda kv: -kv[1]))
    finally:
        live.release()


# --------------------------------------------------------------------------- after a successful attempt


def delta(before: DeviceReading, after: DeviceReading, device: str) -> int | None:
    """Device usage after − before: allocated bytes on CUDA/MPS, else this process's usage."""
    if device.startswith("cuda") or device == "mps":
        if before.allocated is not None and after.allocated is not None:
            return after.allocated - before.allocated
    if before.process_used is not None and after.process_used is not None:
        return after.process_used - before.process_used
    return None


def cell_peak(torch: ModuleType | None, device: str, start: AttemptStart, after: DeviceReading) -> PeakReading:
    """The cell's peak on the device, or why it is unknown."""
    if device.startswith("cuda"):
        if torch is None:
            return PeakReading(None, None, "none", "torch is not imported: no allocator peak")
        return cuda_peak_read(torch, cuda_index(device) or 0, start.cuda_was_initialized,
                              start.reading.allocated, start.cuda_peak_before, after.allocated)
    if device == "cpu":
        if start.rss_peak_reset:
            peak = _rss_peak()
            if peak is not None:
                return PeakReading(peak, None if start.rss is None else peak - start.rss, "resident",
                                   "peak resident memory of this process during the cell (VmHWM; its "
                                   "high-water mark was reset before the cell)")
        now = _max_rss()
        if now is not None and start.max_rss is not None and now > start.max_rss:
            return PeakReading(now, None if start.rss is None else now - start.rss, "resident",
                               "peak resident memory of this process, reached during the cell")
        return PeakReading(None, None, "none",
                           "this process's resident peak was set before the cell; the cell's own peak is "
                           "lower and cannot be read without /proc/self/clear_refs")
    return PeakReading(None, None, "none", f"{device} gives no peak figure")


def changed_variables(namespace: dict, ids_before: dict[str, int], before: dict[str, VarBytes],
                      after: dict[str, VarBytes]) -> tuple[VariableUse, ...]:
    """The user variables the cell made or changed that hold tensor bytes, largest first."""
    result: list[VariableUse] = []
    for name, ident in user_ids(namespace).items():
        path = name if isinstance(name, str) and name.isidentifier() else f"globals()[{name!r}]"
        now = after.get(path)
        was = before.get(path)
        now_bytes = now.total if now else 0
        before_bytes = was.total if was else 0
        change: ChangeKind
        if name not in ids_before:
            change = "new"
        elif ids_before[name] != ident:
            change = "rebound"
        elif now_bytes != before_bytes:
            change = "grew" if now_bytes > before_bytes else "shrank"
        else:
            continue
        if now_bytes == 0 and before_bytes == 0:
            continue
        dtype = max(now.by_dtype.items(), key=lambda kv: kv[1])[0] if now and now.by_dtype else None
        by_device = tuple(sorted((now.by_device if now else {}).items(), key=lambda kv: -kv[1]))
        result.append(VariableUse(path, change, now_bytes, now_bytes - before_bytes, by_device, dtype))
    return tuple(sorted(result, key=lambda v: -v.bytes))
