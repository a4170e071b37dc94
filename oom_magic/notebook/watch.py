"""Notice cheaply whether a cell changed the watched device's memory, and keep one record per cell.

No IPython, no ipywidgets, and torch only when the user already imported it
(``_torch.loaded_torch``). When torch is not imported, ``Watcher`` does nothing at all.

How "nothing changed" is told without a heap scan (each reading costs microseconds):

- CUDA, once ``torch.cuda.is_initialized()``: the caching allocator's own counters (allocated,
  reserved, and the allocated high-water mark) from one ``memory_stats_as_nested_dict`` call.
  Before CUDA is initialized PyTorch holds nothing on a GPU, so the watched device is then cpu.
- MPS: ``torch.mps.current_allocated_memory`` / ``driver_allocated_memory``.
- cpu: PyTorch's CPU allocator keeps no statistics, so two signals stand in for one: the
  process's resident set (``/proc/self/statm``, psutil elsewhere) and the storage bytes of the
  tensors and ``nn.Module``s bound directly to variables in the user namespace. It sees
  ``x = torch.empty(...)`` (no page touched, so RSS does not move) and ``del model``; RSS sees what
  sits inside containers or changes in place. The namespace is not walked each cell (IPython adds
  an ``_iN`` entry per cell, so it grows with the session): the names checked are those already
  holding tensors, the keys added since the last cell (a dict keeps insertion order, so they sit
  at its end) and the names the cell's source mentions (the only ones a cell can rebind, barring
  a function that assigns a global it does not name; RSS still sees those when pages are touched).
  Storage sizes are read for tensors each time, for modules only when the variable is (re)bound.

Thresholds: a cell "changed" memory when a figure moved by at least ``Thresholds.gpu`` (1 MiB)
on a GPU, or ``Thresholds.cpu`` (16 MiB) on cpu, in either direction.

Per-cell peak, when known: the allocator's high-water mark (cpu: the peak resident set,
``ru_maxrss``) is read before and after each cell and never reset (resetting it would change
what ``torch.cuda.max_memory_allocated()`` tells the user). If the mark rose during the cell, the
new mark is the cell's peak; if it did not rise and equals the higher of the levels before and
after, that is the peak; otherwise the cell's peak is unknown (None).

Our own scans: ``%gpumem`` run inside a cell reads the resident set around its scan
(``Watcher.own_scan``), and what the scan left resident (the walk's freed lists the C heap keeps,
the storage objects PyTorch keeps once read) is taken off that cell's cpu change: the cell's
figure is what the user's code did, not the report they asked for.

``%%guardload`` cells: the guard engine calls ``mark_cell(label, oom=...)`` while its cell runs;
the record of that cell carries the label (the timeline writes it) and, with ``oom=True``, counts
as an out-of-memory cell even when the guard recovered (the widget is shown for it).

The records (``Probe``, ``CellRecord``, ``CellChange``, ``CellReport``, ``WatchStatus``) live in
``records.cell`` and are re-exported here.

History: one ``CellRecord`` per executed non-silent cell while torch is imported, in a deque capped
at ``history_limit`` records (oldest dropped first).
"""
from __future__ import annotations

import os
import re
import sys
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from itertools import islice
from types import ModuleType
from typing import Any

from ..common._torch import cuda_initialized, loaded_torch
from ..guard.oom import is_out_of_memory
from ..records.cell import (CPU_THRESHOLD, GPU_THRESHOLD, CellChange, CellRecord, CellReport, ChangeReason, Probe,
                           Thresholds, WatchStatus)
from ..records.snapshot import Snapshot
from ..heap.roots import is_user_name
from ..heap.snapshot import QUICK_WALK_FLOOR_SECONDS

__all__ = ["CPU_THRESHOLD", "GPU_THRESHOLD", "CellChange", "CellRecord", "CellReport", "Probe", "Thresholds",
           "WatchStatus", "Watcher", "cell_peak", "mark_cell"]
_NAME = re.compile(r"[^\W\d]\w*")  # identifiers a cell's source mentions
_TAIL_KEYS = 16


def cell_peak(level_before: int | None, high_before: int | None, level_after: int | None,
              high_after: int | None) -> int | None:
    """The highest level during a cell, from the high-water mark before and after it; None if unknown."""
    if high_after is None or high_before is None or level_after is None:
        return None
    if high_after > high_before:
        # The mark rose in this cell: the new mark is this cell's (never below where it ended).
        return max(high_after, level_after)
    if high_after == high_before and level_before is not None and high_before == max(level_before, level_after):
        return high_before  # the mark sits at a level the cell had: nothing went higher
    return None


_DEFAULT_THRESHOLDS = Thresholds()

# The watcher of the loaded extension, for mark_cell; set by activate(), cleared by deactivate().
_active: Watcher | None = None


def mark_cell(label: str | None = None, *, oom: bool = False, peak: tuple[int, str] | None = None) -> bool:
    """Label the running cell on the timeline (and flag an out-of-memory error the guard caught).

    Called by ``%%guardload`` while its cell runs; the label shows on ``%gpumem --plot`` and
    ``oom=True`` makes the cell count as an out-of-memory cell (the widget is shown for it);
    ``peak`` is the guard's own (bytes, measure) for the cell, used where the watcher's is lost
    because the guard reset the high-water mark.
    Returns False, doing nothing, when the extension is not loaded.
    """
    watcher = _active
    if watcher is None:
        return False
    watcher.mark(label, oom=oom, peak=peak)
    return True


def activate(watcher: Watcher) -> None:
    """Make ``watcher`` the one ``mark_cell`` reports to (the extension calls this on load)."""
    global _active
    _active = watcher


def deactivate(watcher: Watcher) -> None:
    """Stop ``mark_cell`` reporting to ``watcher`` (the extension calls this on unload)."""
    global _active
    if _active is watcher:
        _active = None


class Watcher:
    """Read the watched device before and after each cell; decide whether it changed; keep history."""

    def __init__(self, *, history_limit: int = 10_000, probe: Any | None = None) -> None:
        # ``probe(torch) -> Probe`` reads the device; tests pass fakes for absent GPUs.
        self.history: deque[CellRecord] = deque(maxlen=max(int(history_limit), 1))
        self._probe = probe if probe is not None else self.read
        self._before: Probe | None = None
        self._last_variable_bytes: int | None = None
        self._pending_label: str | None = None
        self._pending_oom = False
        self._pending_peak: tuple[int, str] | None = None  # (bytes, 'resident' | 'allocated') the guard measured
        self._own_resident = 0  # resident bytes our own scans added during the running cell
        self._rss = _ResidentSet()
        self._bound = _BoundTensors()
        self._mps: bool | None = None

    # -- reading ---------------------------------------------------------------------------------
    def read(self, torch: ModuleType) -> Probe:
        """Read the watched device cheaply: allocator counters on a GPU, the resident set on cpu."""
        if cuda_initialized():
            index = int(torch.cuda.current_device())
            stats = torch.cuda.memory_stats_as_nested_dict(index)
            return Probe(f"cuda:{index}", _stat(stats, "allocated_bytes", "current"),
                         _stat(stats, "reserved_bytes", "current"), _stat(stats, "allocated_bytes", "peak"))
        if self._mps is None:
            self._mps = _mps_available(torch)
        if self._mps:
            return Probe("mps", int(torch.mps.current_allocated_memory()), int(torch.mps.driver_allocated_memory()))
        return Probe("cpu", rss=self._rss.current(), high_water=_peak_rss())

    # -- the two hooks ---------------------------------------------------------------------------
    def before_cell(self) -> None:
        """Take the reading a cell is compared with (nothing when torch is not imported)."""
        torch = loaded_torch()
        if torch is None:
            self._before = None
            return
        self._before = self._probe(torch)

    def after_cell(self, execution_count: int | None, error: BaseException | None = None,
                   namespace: dict | None = None, thresholds: Thresholds = _DEFAULT_THRESHOLDS,
                   source: str | None = None) -> CellChange | None:
        """Compare the device with the reading before the cell and record the cell; None without torch.

        ``source`` is the cell's text: only names it mentions (and new keys) are re-checked in
        ``namespace``; without it every key is.
        """
        torch = loaded_torch()
        before, self._before = self._before, None
        label, self._pending_label = self._pending_label, None
        forced_oom, self._pending_oom = self._pending_oom, False
        measured, self._pending_peak = self._pending_peak, None
        own, self._own_resident = self._own_resident, 0
        if torch is None:
            return None
        after = self._probe(torch)
        oom = forced_oom or (error is not None and is_out_of_memory(error))
        if before is not None and before.device != after.device:
            # CUDA came up during the cell: PyTorch held nothing on the GPU before it. Any other
            # switch (torch.cuda.set_device) leaves nothing to compare with.
            came_up = after.device.startswith("cuda") and not before.device.startswith("cuda")
            before = Probe(after.device, 0, 0, 0) if came_up else None
        threshold = thresholds.for_device(after.device)
        delta = _diff(after.level, before.level) if before is not None else None
        if delta is not None and after.device == "cpu":
            delta -= own  # what our own scans kept resident is not the cell's
        reasons: list[ChangeReason] = []
        if before is not None:
            if after.device == "cpu":
                if delta is not None and abs(delta) >= threshold:
                    reasons.append("rss")
            else:
                if delta is not None and abs(delta) >= threshold:
                    reasons.append("allocated")
                reserved = _diff(after.reserved, before.reserved)
                if reserved is not None and abs(reserved) >= threshold:
                    reasons.append("reserved")
        variable_bytes = variable_delta = None
        if after.device == "cpu" and namespace is not None:
            variable_bytes = self._bound.total(namespace, torch, source)
            if self._last_variable_bytes is not None:
                variable_delta = variable_bytes - self._last_variable_bytes
                if abs(variable_delta) >= threshold:
                    reasons.append("variables")
            self._last_variable_bytes = variable_bytes
        peak = None
        if before is not None:
            peak = cell_peak(before.level, before.high_water, after.level, after.high_water)
            # The guard resets the high-water mark for its own peak: take its figure where ours is lost.
            if peak is None and measured is not None and after.level is not None and \
                    measured[1] == ("resident" if after.device == "cpu" else "allocated"):
                peak = max(measured[0], after.level, before.level or 0)
        peak_delta = _diff(peak, before.level) if before is not None else None
        record = CellRecord(
            execution_count=execution_count, device=after.device, allocated=after.allocated,
            reserved=after.reserved, peak=peak, rss=after.rss, tensor_bytes=None, oom=oom,
            label=label, changed=bool(reasons),
        )
        self.history.append(record)
        return CellChange(record, before, after, delta, variable_delta, peak_delta, tuple(reasons), variable_bytes)

    # -- annotations -----------------------------------------------------------------------------
    def mark(self, label: str | None, *, oom: bool = False, peak: tuple[int, str] | None = None) -> None:
        """Label the running cell (see ``mark_cell``)."""
        if label is not None:
            self._pending_label = str(label)
        self._pending_oom = self._pending_oom or bool(oom)
        if peak is not None:
            self._pending_peak = peak

    @contextmanager
    def own_scan(self) -> Iterator[None]:
        """Run one of our own scans inside the running cell: the resident set it grows by is not the cell's."""
        before = self._rss.current()
        try:
            yield
        finally:
            after = self._rss.current()
            if before is not None and after is not None and after > before:
                self._own_resident += after - before

    def note_scan(self, snap: Snapshot, record: CellRecord | None = None) -> CellRecord | None:
        """Store the tensor bytes a scan after a cell found in that cell's record (default: the last)."""
        if not self.history:
            return None
        target = record if record is not None else self.history[-1]
        if self.history[-1] is not target or snap.device != target.device:
            return None
        updated = replace(target, tensor_bytes=snap.tracked_bytes)
        self.history[-1] = updated
        return updated

    def records(self, device: str | None = None) -> tuple[CellRecord, ...]:
        """The history, oldest first (only ``device``'s cells when given)."""
        return tuple(r for r in self.history if device is None or r.device == device)

    def close(self) -> None:
        """Release the open /proc file."""
        self._rss.close()


def _stat(stats: dict, name: str, which: str) -> int | None:
    try:
        return int(stats[name]["all"][which])
    except (KeyError, TypeError, ValueError):
        return None


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _mps_available(torch: ModuleType) -> bool:
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        return False


def _peak_rss() -> int | None:
    """The process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class _ResidentSet:
    """The process's resident set in ~2 µs from /proc/self/statm (psutil where there is no /proc)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid: int | None = None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._psutil: Any | None = None

    def current(self) -> int | None:
        pid = os.getpid()
        if self._pid != pid:  # first use, or a forked child: its own /proc/self
            self.close()
            self._pid = pid
            try:
                self._fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
            except OSError:
                self._fd = None
        if self._fd is not None:
            try:
                return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                pass
        try:
            if self._psutil is None:
                import psutil

                self._psutil = psutil.Process()
            return int(self._psutil.memory_info().rss)
        except Exception:
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None
        self._pid = None


class _BoundTensors:
    """Storage bytes of the cpu tensors and nn.Modules bound directly to namespace variables.

    Incremental (see the module docstring): it re-checks the names already holding tensors, the
    keys added at the dict's end since the last call and the names ``source`` mentions, so a
    trivial cell costs microseconds however long the session. Values are selected by ``type(v)``
    against a per-type cache (never ``isinstance`` on arbitrary objects), storages count once
    however many variables share them, and no strong reference outlives a call: modules' storages
    are cached behind a weak reference.
    """

    def __init__(self) -> None:
        # id(type) -> (type, 0 not tensor-ish / 1 tensor / 2 module): by id, since a metaclass may
        # define __eq__ without __hash__ (such a class cannot be a dict key).
        self._kinds: dict[int, tuple[type, int]] = {}
        self._tracked: dict[Any, int] = {}  # namespace key -> kind, for keys holding tensors/modules
        self._tail: frozenset = frozenset()  # the last keys of the namespace at the previous call
        self._namespace_id: int | None = None
        self._modules: dict[int, tuple[Any, dict[int, int]]] = {}

    def total(self, namespace: dict, torch: ModuleType, source: str | None = None) -> int:
        if id(namespace) != self._namespace_id:
            self._namespace_id, self._tracked, self._tail = id(namespace), {}, frozenset()
        tracked = self._tracked
        for key in self._candidates(namespace, source):
            # IPython's own names (``_``, ``_7``, ``Out``) are the output cache, not variables.
            kind = self._kind(type(dict.get(namespace, key)), torch) if is_user_name(key) else 0
            if kind:
                tracked[key] = kind
        storages: dict[int, int] = {}
        modules: dict[int, tuple[Any, dict[int, int]]] = {}
        for key in list(tracked):
            value = dict.get(namespace, key)
            kind = self._kind(type(value), torch)
            if not kind:  # deleted, or rebound to something else
                del tracked[key]
            elif kind == 1:
                _add_storage(value, storages)
            else:
                cached = self._modules.get(id(value))
                if cached is None or cached[0]() is not value:
                    cached = (_weak(value), _module_storages(value, torch))
                modules[id(value)] = cached
                storages.update(cached[1])
        self._modules = modules
        self._tail = frozenset(islice(reversed(namespace), _TAIL_KEYS))
        return sum(storages.values())

    def _candidates(self, namespace: dict, source: str | None) -> Any:
        """Keys that may have been bound since the last call."""
        if not self._tail or source is None:
            return list(namespace)
        added = []
        for key in reversed(namespace):  # new keys sit at the end; stop at one seen last time
            if key in self._tail:
                break
            added.append(key)
        mentioned = {name for name in set(_NAME.findall(source)) if name in namespace}
        return mentioned.union(added)

    def _kind(self, cls: type, torch: ModuleType) -> int:
        known = self._kinds.get(id(cls))
        if known is None or known[0] is not cls:
            known = self._kinds[id(cls)] = (cls, _kind(cls, torch))
        return known[1]


def _kind(cls: type, torch: ModuleType) -> int:
    try:
        if issubclass(cls, torch.Tensor):
            return 1
        if issubclass(cls, torch.nn.Module):
            return 2
    except Exception:
        pass
    return 0


def _weak(obj: object) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: None  # cannot be weakly referenced: re-read next time


def _add_storage(tensor: Any, storages: dict[int, int]) -> None:
    """Count a cpu tensor's storage, read through TensorBase with subclass code off (none of it runs)."""
    try:
        torch = sys.modules["torch"]
        base = torch._C.TensorBase
        with torch._C.DisableTorchFunctionSubclass():
            if base.is_meta.__get__(tensor) or not base.is_cpu.__get__(tensor):
                return
            if base.layout.__get__(tensor) is not torch.strided:
                return  # sparse: RSS sees it
            storage = base.untyped_storage(tensor)
            nbytes, pointer = int(storage.nbytes()), int(storage.data_ptr())
        if nbytes and pointer:
            storages[pointer] = nbytes
    except Exception:
        return  # wrapper subclasses without a storage of their own


def _module_storages(module: Any, torch: ModuleType) -> dict[int, int]:
    storages: dict[int, int] = {}
    try:
        Module = torch.nn.Module
        for tensor in Module.parameters(module):
            _add_storage(tensor, storages)
        for tensor in Module.buffers(module):
            _add_storage(tensor, storages)
    except Exception:
        pass
    return storages


class ScanCost:
    """What the after-cell hook's work costs here, learnt as it runs, and the plan that keeps it in budget.

    The heap's size is read as ``sys.getallocatedblocks()`` (well under a millisecond even at
    10 M objects). Learnt from each one measured (recent ones weigh most): a full scan's cost per
    block (before the first, 150 ns, measured on this project's CI machine), showing a widget,
    and what a quick view costs past its walk's deadline (grouping and naming what it found); the
    last two are kept free for at once when they rise.
    """

    def __init__(self, seconds_per_block: float = 150e-9) -> None:
        self.seconds_per_block = seconds_per_block
        self.widget_seconds = 0.02
        self.after_walk_seconds = 0.005

    @staticmethod
    def heap_blocks() -> int:
        return sys.getallocatedblocks()

    def predict(self, blocks: int) -> float:
        """Seconds a full scan of a heap of ``blocks`` allocated blocks would take."""
        return blocks * self.seconds_per_block

    def quick_walk(self, blocks: int, left: float) -> float | None:
        """None when a full scan and the widget fit in the ``left`` seconds; else the quick view's walk time."""
        if self.predict(blocks) <= left - self.widget_seconds:
            return None
        return max(left - self.widget_seconds - self.after_walk_seconds, QUICK_WALK_FLOOR_SECONDS)

    def learn(self, seconds: float, blocks: int) -> None:
        """Fold one measured full scan into the rate."""
        if blocks > 0 and seconds > 0:
            self.seconds_per_block = _blend(self.seconds_per_block, seconds / blocks)

    def learn_widget(self, seconds: float) -> None:
        """Fold in what showing one widget cost (models, comm messages, freezing the oldest)."""
        self.widget_seconds = _reserve(self.widget_seconds, seconds)

    def learn_quick_view(self, seconds: float, walk: float) -> None:
        """Fold in what a quick view cost past the ``walk`` seconds it was given."""
        self.after_walk_seconds = _reserve(self.after_walk_seconds, max(seconds - walk, 0.0))


def _reserve(old: float, new: float) -> float:
    """What to keep free for a cost the walk must leave room for: a rise at once, a fall blended in
    (a blend alone left the hook a cell behind a rise, 1-2 ms over its budget)."""
    return max(new, _blend(old, new))


def _blend(old: float, new: float) -> float:
    return 0.5 * old + 0.5 * new
