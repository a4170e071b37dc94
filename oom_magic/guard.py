"""Guard a model load: free stale memory first, measure what it cost, and recover when it runs out.

``%%guardload`` and ``with guard_load(): ...`` both drive ``GuardedLoad``:

1. before: free stale memory (as ``%freeall``), set ``expandable_segments`` while CUDA is not yet
   initialized, check the fit (the magic's cell preflight), start allocator history (``snapshot``);
2. run the load; on success measure the device delta, the per-cell peak, the wall time and the
   new or changed variables with their device bytes;
3. on out-of-memory: print the traceback text, give back what the failed load left (clear the
   frames of the exception's traceback, drop ``sys.last_*``, free stale memory, ``gc.collect()``,
   empty the cache) and say how much came back; parse the message, diagnose it, retry when the
   diagnosis says the same load fits now, then raise a short exception of the original type.

Peak figures. CUDA: ``max_memory_allocated()`` is read before and after the cell and never reset
(the peak counter is the user's): when it rose during the cell the new mark is the cell's peak;
when CUDA initializes inside the cell the peak since initialization is the cell's; otherwise the
cell stayed under an earlier peak and its own is unknown unless it equals the level before/after. CPU (Linux): the process's resident high-water mark is reset by
writing 5 to ``/proc/self/clear_refs`` (this resets VmHWM and ``ru_maxrss`` for the process) and
read from ``/proc/self/status`` after; elsewhere the peak is given only when the process's
lifetime peak rose during the cell, else None with the reason.
"""
from __future__ import annotations

import builtins
import gc
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from collections.abc import Callable, Iterator, MutableMapping

from ._torch import cuda_initialized, loaded_torch
from .cleanup import FreeReport, free_stale
from .devices import DeviceReading, default_device, read_device, resolve_device
from .diagnose import Diagnosis, diagnose
from .errors import OomMagicError
from .oom import OOMMessage, is_out_of_memory, parse_oom_message
from .preflight import Preflight, cuda_process_cap, parse_headroom, usable_ram
from .roots import Roots, collect_roots, current_shell, is_user_name
from .targets import Cap, Target, cap_released, capped, hold_cap, memory_fraction_for, parse_target

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["AllocatorSetting", "Attempt", "GiveBack", "GuardRefused", "GuardReport", "GuardUsedUp", "GuardedLoad", "PeakReading",
           "Rehearsal", "VariableUse", "allocator_setting", "apply_allocator_setting", "compile_cell", "guard_load", "largest_free_block"]

_ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*(\w+)")
_HISTORY_ENTRIES = 100_000
_CO_OPTIMIZED = 0x1  # inspect.CO_OPTIMIZED: a function frame (its locals are its own)
_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE: code compiled with a top-level await
# Python 3.10 has no exception groups: nothing there is one.
_EXCEPTION_GROUP: type | None = getattr(builtins, "BaseExceptionGroup", None)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class AllocatorSetting:
    """What the guard did about ``expandable_segments`` before the load.

    ``action``: 'set' (the variable was set for this process) | 'already-on' | 'user-off' (you
    set it False) | 'needs-restart' (CUDA is initialized: the setting applies only from a fresh
    kernel) | 'off' (turned off by flag or config) | 'not-cuda'.
    """

    action: str
    variable: str | None = None
    value: str | None = None

    @property
    def enabled(self) -> bool | None:
        """Whether expandable segments are on for this process's allocator (None: not CUDA)."""
        if self.action in ("set", "already-on"):
            return True
        if self.action == "not-cuda":
            return None
        return False


@dataclass(frozen=True)
class PeakReading:
    """The cell's peak on the device, what it measures, and what it means (or why it is unknown)."""

    bytes: int | None  # the highest the measure reached during the cell
    above_start: int | None  # peak minus the same measure before the cell
    measure: str  # 'allocated' (CUDA allocator) | 'resident' (process RSS) | 'none'
    note: str


@dataclass(frozen=True)
class VariableUse:
    """A variable the load created or changed, with the device memory it holds."""

    name: str
    change: str  # 'new' | 'rebound' | 'grew' | 'shrank'
    bytes: int  # tensor bytes reachable from it, every device
    delta: int  # change in those bytes during the cell
    by_device: tuple[tuple[str, int], ...]
    dtype: str | None  # the dtype that holds most of its bytes


@dataclass(frozen=True)
class GiveBack:
    """What came back after a failed load: its own tensors, stale memory, and what is still held."""

    failed_load_bytes: int  # tensors the failed load created, now freed
    stale_bytes: int  # tensors from before the load (stale tracebacks, output cache, garbage), now freed
    still_held_bytes: int  # tensors the failed load created that something still holds
    still_held_by: tuple[str, ...]
    frames_cleared: int
    dropped_last_exception: bool
    at_failure: DeviceReading
    after: DeviceReading
    cleanup: FreeReport | None = None

    @property
    def total(self) -> int:
        """Tensor bytes freed in all."""
        return self.failed_load_bytes + self.stale_bytes

    @property
    def process_freed(self) -> int | None:
        """How much this process's own usage fell (CPU: resident memory; CUDA: NVML's figure)."""
        a, b = self.at_failure.process_used, self.after.process_used
        return None if a is None or b is None else a - b

    @property
    def reserved_freed(self) -> int | None:
        """How much PyTorch's reserved memory fell (CUDA/MPS; cache emptied)."""
        a, b = self.at_failure.reserved, self.after.reserved
        return None if a is None or b is None else a - b


@dataclass(frozen=True)
class Attempt:
    """One run of the load: how it ended, and on out-of-memory what came back and why it failed."""

    number: int
    outcome: str  # 'ok' | 'oom' | 'error'
    seconds: float
    error: str | None = None  # "RuntimeError: <first line>"
    oom: OOMMessage | None = None
    give_back: GiveBack | None = None
    diagnosis: Diagnosis | None = None
    snapshot_file: str | None = None


@dataclass(frozen=True)
class Rehearsal:
    """How ``--target`` was rehearsed: the cell ran capped as that GPU, or only the fit check ran, and why.

    ``reason`` when there is no cap: 'not-cuda' | 'not-larger' (this device is not larger than the
    target plus what this process holds) | 'torch-not-imported' | 'cuda-not-initialized' (the load
    was not seen going to CUDA, so no context was created for the cap) | 'cap-failed'.
    """

    target: Target
    device: str
    checked: bool  # the preflight sized a load against the target
    cap: Cap | None = None  # the fraction set for the cell and the one put back
    reason: str | None = None
    device_total: int | None = None  # CUDA's total for this device (what the fraction multiplies)
    held_before: int | None = None  # memory_allocated() before the cell: counted on top of the target
    restored: bool | None = None  # the previous fraction was put back (None: not yet, or no cap)
    error: str | None = None

    @property
    def limit(self) -> int | None:
        """Bytes this process may reserve on the device under the cap."""
        if self.cap is None or self.device_total is None:
            return None
        return int(self.cap.fraction * self.device_total)


@dataclass(frozen=True)
class GuardReport:
    """The story of one guarded load: before, each attempt, after. Int bytes, None where unknown."""

    device: str
    outcome: str  # 'ok' | 'oom' | 'error'
    attempts: tuple[Attempt, ...]
    cleanup: FreeReport | None
    allocator: AllocatorSetting
    preflight: Preflight | None
    before: DeviceReading
    after: DeviceReading
    seconds: float  # wall time of the last attempt
    delta: int | None  # device usage after − before (CUDA: allocated; CPU: resident memory)
    tensor_delta: int | None  # live tensor bytes on the device after − before
    peak: PeakReading
    variables: tuple[VariableUse, ...] = ()
    snapshot: str | None = None  # where --snapshot wrote the allocator history, or why it did not
    notes: tuple[str, ...] = ()
    label: str = "guard_load"  # '%%guardload' in the magic
    rehearsal: Rehearsal | None = None  # --target: how the load was rehearsed for that GPU

    @property
    def last(self) -> Attempt:
        """The last attempt."""
        return self.attempts[-1]

    @property
    def oom(self) -> OOMMessage | None:
        """The parsed out-of-memory message of the last attempt (None if it did not run out)."""
        return self.last.oom

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The diagnosis of the last out-of-memory error."""
        return self.last.diagnosis

    @property
    def give_back(self) -> GiveBack | None:
        """What came back after the last failed attempt."""
        return self.last.give_back

    @property
    def retries(self) -> int:
        """How many times the load was run again."""
        return len(self.attempts) - 1

    def variable(self, name: str) -> VariableUse | None:
        """The new or changed variable of that name, or None."""
        return next((v for v in self.variables if v.name == name), None)

    def __repr__(self) -> str:
        return (f"<GuardReport {self.device}: {self.outcome} after {len(self.attempts)} attempt(s), "
                f"delta={self.delta}, peak={self.peak.bytes}>")

    def __str__(self) -> str:
        from .render.guard import guard_report_text

        return guard_report_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        from .render.guard import run_summary_text

        printer.text(run_summary_text(self))

    def _repr_html_(self) -> str:
        from .render.guard import guard_report_html

        return guard_report_html(self)


class GuardUsedUp(OomMagicError):
    """A finished guard asked to run again (it would run the load unguarded): one line in IPython."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class GuardRefused(OomMagicError):
    """--strict: the preflight says the load will not fit, so the cell was not run."""


# --------------------------------------------------------------------------- CUDA allocator pieces


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
    """Write the recorded history to ``path`` (a folder gets a timestamped file); return the file."""
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


def _expandable_now(env: MutableMapping[str, str]) -> bool | None:
    for name in _ALLOC_CONF_NAMES:
        match = _EXPANDABLE.search(env.get(name) or "")
        if match:
            return match.group(1) == "True"
    return None


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


# --------------------------------------------------------------------------- measuring tensors


def _storage_bytes(torch: ModuleType | None, device: str) -> dict[int, int]:
    """Storage key -> bytes for every live tensor storage on the device (no tensor kept)."""
    if torch is None:
        return {}
    from .tracker import find_tensors

    live = find_tensors(torch, device)
    try:
        return {key: record.bytes for key, record in live.storages.items()}
    finally:
        live.release()


@dataclass(frozen=True)
class _VarBytes:
    total: int
    by_device: dict[str, int]
    by_dtype: dict[str, int]


def _scan(torch: ModuleType | None, device: str, shell: Any, namespace: dict,
          variables: bool) -> tuple[dict[int, int], dict[str, _VarBytes]]:
    """One heap pass: storage key -> bytes on ``device``, and (optionally) the tensor bytes each
    user variable reaches on every device (a storage counts under its first holder)."""
    if torch is None:
        return {}, {}
    if not variables:
        return _storage_bytes(torch, device), {}
    from .holders import attribute
    from .tracker import find_tensors, tensor_types

    roots = collect_roots(shell, namespace)
    live = find_tensors(torch, None)
    try:
        on_device = {key: r.bytes for key, r in live.storages.items() if r.device == device}
        holders = attribute(live, Roots(user=roots.user, containers=roots.containers), torch, tensor_types(torch),
                            find_garbage=False, trace_other=False).holders
        result: dict[str, _VarBytes] = {}
        for key, holder in holders.items():
            record = live.storages[key]
            entry = result.get(holder.root) or _VarBytes(0, {}, {})
            entry.by_device[record.device] = entry.by_device.get(record.device, 0) + record.bytes
            entry.by_dtype[record.dtype] = entry.by_dtype.get(record.dtype, 0) + record.bytes
            result[holder.root] = _VarBytes(entry.total + record.bytes, entry.by_device, entry.by_dtype)
        return on_device, result
    finally:
        live.release()


def _holders_of(torch: ModuleType, device: str, keys: set[int], shell: Any, namespace: dict) -> tuple[
        tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(paths holding these storages, user variables holding device memory as (name, bytes))."""
    from .holders import USER, attribute
    from .tracker import find_tensors, tensor_types

    live = find_tensors(torch, device)
    try:
        holders = attribute(live, collect_roots(shell, namespace), torch, tensor_types(torch),
                            find_garbage=False, trace_other=True).holders
        held: dict[str, int] = {}
        for k in keys:
            if k in holders:
                # A user variable by its name (`model`), anything else by its path.
                name = holders[k].root if holders[k].kind == USER else holders[k].path
                held[name] = held.get(name, 0) + live.storages[k].bytes
        paths = tuple(name for name, _ in sorted(held.items(), key=lambda kv: -kv[1]))
        per_root: dict[str, int] = {}
        for key, holder in holders.items():
            if holder.kind == USER:
                per_root[holder.root] = per_root.get(holder.root, 0) + live.storages[key].bytes
        return paths, tuple(sorted(per_root.items(), key=lambda kv: -kv[1]))
    finally:
        live.release()


# --------------------------------------------------------------------------- give back


def _clear_frames(exc: BaseException) -> int:
    """Clear the locals of every finished frame in the exception's chain; return how many."""
    cleared = 0
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, BaseException):
            stack += [item.__traceback__, item.__cause__, item.__context__]
            if _EXCEPTION_GROUP is not None and isinstance(item, _EXCEPTION_GROUP):
                stack += list(item.exceptions)
            continue
        tb = item
        while tb is not None:
            frame = tb.tb_frame
            try:
                frame.clear()
                cleared += 1
            except RuntimeError:  # a frame still running: the guard's own, or the with-block's owner
                tb = tb.tb_next
                continue
            if frame.f_code.co_flags & _CO_OPTIMIZED:
                # Python 3.11/3.12: clear() leaves the f_locals snapshot a traceback printer made
                # (IPython reads it for __tracebackhide__); reading it again syncs it to the now
                # empty locals. Function frames only: a module frame's f_locals is a namespace.
                try:
                    frame.f_locals
                except Exception:
                    pass
            tb = tb.tb_next
    return cleared


def _drop_last_exception(namespace: dict) -> bool:
    """Delete sys.last_* (the stored exception and its frames) unless a user variable holds it."""
    stored = [getattr(sys, name, None) for name in ("last_value", "last_exc", "last_traceback")]
    stored = [s for s in stored if s is not None]
    if not stored:
        return False
    held = {id(v) for k, v in list(dict.items(namespace)) if is_user_name(k)}
    if any(id(s) in held for s in stored):
        return False
    for value in stored:
        if isinstance(value, BaseException):
            _clear_frames(value)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    return True


def _empty_cache(torch: ModuleType | None, device: str) -> None:
    if torch is None:
        return
    try:
        if device.startswith("cuda") and cuda_initialized():
            torch.cuda.empty_cache()
        elif device == "mps":
            torch.mps.empty_cache()
    except Exception:
        pass


# --------------------------------------------------------------------------- the engine


@dataclass
class _Start:
    """Figures taken just before an attempt (plain ints and readings: no tensor is kept)."""

    reading: DeviceReading
    storages: dict[int, int]
    cuda_was_initialized: bool
    rss: int | None
    rss_peak_reset: bool
    max_rss: int | None
    started: float
    cuda_peak_before: int | None = None  # max_memory_allocated() before the attempt (read, not reset)


def _first_line(exc: BaseException) -> str:
    """The first line of an error's message; '' when its ``__str__`` itself raises."""
    try:
        return (str(exc).strip().splitlines() or [""])[0]
    except Exception:
        return ""


def _message(exc: BaseException) -> str:
    """An error's message; '' when its ``__str__`` itself raises."""
    try:
        return str(exc)
    except Exception:
        return ""


def _handled_by_guard(exc: BaseException) -> bool:
    """Whether this is a guard's own short exception (an inner guard already diagnosed the OOM)."""
    try:
        return "oom_report" in object.__getattribute__(exc, "__dict__")
    except Exception:
        return False


def _needs_forensics(exc: BaseException) -> bool:
    """An out-of-memory error no guard has handled yet."""
    return is_out_of_memory(exc) and not _handled_by_guard(exc)


def _default_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("oom_magic."):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class GuardedLoad:
    """Run a model load guarded: cleanup before, measurements after, forensics and recovery on OOM.

    Use ``with guard_load(): ...`` for one attempt, ``for attempt in guard_load(retry=2): with
    attempt: ...`` or ``guard_load(retry=2).run(fn)`` to retry. After it ends, ``.report`` is the
    GuardReport. Nothing here imports IPython: the magic passes its shell, traceback formatter and
    a preflight callable in.
    """

    def __init__(self, device: str | None = None, retry: int = 0, *, cleanup: bool = True,
                 expandable_segments: bool = True, snapshot: str | os.PathLike[str] | None = None,
                 headroom: str | int | None = None, quiet: bool = False, raise_on_oom: bool = True,
                 strict: bool = False, preflight: Preflight | Callable[[], Preflight] | None = None,
                 shell: Any = None, namespace: dict | None = None, out: TextIO | None = None,
                 format_traceback: Callable[[BaseException], str] | None = None,
                 label: str = "guard_load", env: MutableMapping[str, str] | None = None,
                 device_hint: str | None = None, target: str | Target | None = None) -> None:
        if type(retry) is not int or retry < 0:
            raise OomMagicError(f"retry must be a whole number, 0 or more, not {retry!r}")
        parse_headroom(headroom, 0)  # a bad spelling fails here, before anything runs
        self.target = parse_target(target) if target is not None else None  # a bad target fails here too
        self.rehearsal: Rehearsal | None = None
        self._cap_exit: Callable[[], Any] | None = None
        self.requested_device = device
        self.device_hint = device_hint  # where the cell's load goes; falls back when this machine lacks it
        self.retry = retry
        self.cleanup = cleanup
        self.expandable_segments = expandable_segments
        self.snapshot_path = snapshot
        self.headroom_spec = headroom
        self.quiet = quiet
        self.raise_on_oom = raise_on_oom
        self.strict = strict
        self.preflight_source = preflight
        self.shell = shell if shell is not None or namespace is not None else current_shell()
        self.namespace = namespace if namespace is not None else (
            getattr(self.shell, "user_ns", None) or sys.modules["__main__"].__dict__)
        self.out = out
        self.format_traceback = format_traceback or _default_traceback
        self.label = label
        self.env = os.environ if env is None else env
        self.report: GuardReport | None = None
        self.value: Any = None
        self._begun = False
        self._ended = False
        self._used = False

    # ----------------------------------------------------------------- the three ways in
    def begin(self) -> None:
        """The before-steps: cleanup, allocator setting, preflight (``strict`` refuses here).

        Called by ``run``, ``with`` and iteration; call it yourself to separate bad-input errors
        (OomMagicError: an unknown device, a --strict refusal) from errors of the load itself.
        """
        if self._used:
            raise GuardUsedUp("this guard has already run a load: a guard runs once, so call "
                              "guard_load(...) again for another load")
        if not self._begun:
            self._begin()

    def _claim(self) -> None:
        """Refuse a second use: a finished guard would otherwise run the load unguarded."""
        self.begin()
        self._used = True

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` guarded, retrying as allowed; return its result."""
        __tracebackhide__ = True
        self._claim()
        attempts: list[Attempt] = []
        try:
            for number in range(1, self.retry + 2):
                start = self._start_attempt(number)
                try:
                    value = fn(*args, **kwargs)
                except BaseException as exc:
                    if not _needs_forensics(exc):
                        self._abort(start, exc, attempts)
                        raise
                    attempts.append(self._failed(start, exc, number))
                    del exc
                else:
                    attempts.append(self._succeeded(start, number))
                    self.value = value
                    break
                if not self._retry_after(attempts[-1], number):
                    break
            self._end(attempts)
        finally:
            self._release_cap()  # an interrupt inside the guard's own steps still puts the fraction back
        return self.value

    def __enter__(self) -> GuardedLoad:
        if self.retry:
            raise OomMagicError("a with-block runs once, so it cannot retry: use `for attempt in "
                                "guard_load(retry=N): with attempt: ...` or guard_load(retry=N).run(fn)")
        self._claim()
        try:
            self._with_start = self._start_attempt(1)
        except BaseException:
            self._release_cap()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        __tracebackhide__ = True
        start = self._with_start
        try:
            if exc is None:
                self._end([self._succeeded(start, 1)])
                return False
            if not _needs_forensics(exc):
                self._abort(start, exc, [])
                return False
            attempt = self._failed(start, exc, 1)
            del exc, tb
            self._end([attempt])  # raises the short exception unless raise_on_oom is False
            return True  # printed and given back: the long error is not raised again
        finally:
            self._release_cap()  # also when Ctrl-C lands in the forensics

    def __iter__(self) -> Iterator[_AttemptContext]:
        self._claim()
        attempts: list[Attempt] = []
        try:
            for number in range(1, self.retry + 2):
                context = _AttemptContext(self, number)
                yield context
                if context.attempt is None:
                    raise OomMagicError("each attempt must be used as a context manager: `with attempt: ...`")
                attempts.append(context.attempt)
                if context.attempt.outcome == "ok" or not self._retry_after(context.attempt, number):
                    break
            self._end(attempts)
        finally:
            self._release_cap()  # also when the loop is left early (break, an error, the generator closed)

    # ----------------------------------------------------------------- steps
    def _say(self, text: str, *, always: bool = False) -> None:
        if text and current_shell() is None:  # a script: no magics or cells to point at
            from .render.guard import script_wording

            text = script_wording(text)
        if text and (always or not self.quiet):
            print(text, file=self.out if self.out is not None else sys.stdout, flush=True)

    def _begin(self) -> None:
        from .render.guard import allocator_line, cleanup_line, preflight_text

        if self._ended:
            raise OomMagicError("a guard runs once: call guard_load(...) again for another load")
        self._begun = True
        self.torch = loaded_torch()
        self.notes: list[str] = []
        self.device = self._resolve_device()
        self.cleanup_report: FreeReport | None = None
        if self.cleanup:
            try:
                self.cleanup_report = free_stale(self.device, shell=self.shell, namespace=self.namespace)
                self._say(cleanup_line(self.cleanup_report))
            except Exception as error:  # the load still runs; the report says what did not
                self.notes.append(f"the cleanup before the load did not finish: {error}")
        self.allocator = allocator_setting(self.env, self.device, cuda_initialized(), self.expandable_segments)
        if self.env is os.environ:
            problem = apply_allocator_setting(self.torch, self.allocator)
            if problem:
                self.notes.append(problem)
        self._say(allocator_line(self.allocator))
        source = self.preflight_source
        try:
            self.preflight = source() if callable(source) else source
        except Exception as error:
            self.preflight = None
            self.notes.append(f"the preflight could not check this cell: {error}")
        if self.preflight is not None and (self.preflight.calls or self.preflight.notes):
            text = preflight_text(self.preflight)
            worrying = bool(self.preflight.will_not_fit) or any(x.severity == "warning" for x in self.preflight.lints)
            self._say(text, always=worrying)
        if self.strict and self.preflight is not None and self.preflight.will_not_fit:
            from .render.guard import refusal_line

            raise GuardRefused(refusal_line(self.preflight))
        self.snapshot_note = self._start_snapshot()
        if self.snapshot_note:  # --snapshot that records nothing says so before the cell, not only in the report
            self._say(self.snapshot_note, always=True)
        if self.target is not None:
            self._plan_rehearsal()
        self.variables_before: dict[str, _VarBytes] = {}
        self.ids_before = {k: id(v) for k, v in list(dict.items(self.namespace)) if is_user_name(k)}

    # ----------------------------------------------------------------- --target
    def _plan_rehearsal(self) -> None:
        """Decide whether the cell can run capped as the target here; if not, say why (one line).

        The cap is a ``set_per_process_memory_fraction``, which needs CUDA initialized. When CUDA is
        not initialized yet it is initialized for the cap only when the load is known to go to CUDA
        (the user named a cuda device, or the cell's load targets one), as ``--snapshot`` does: the
        cell would create that context a moment later anyway. Otherwise no context is created for
        the cap, and the report says that only the fit check ran.
        """
        from .render.guard import rehearsal_line

        target = self.target
        assert target is not None
        checked = self.preflight is not None and any(c.target is not None and c.need is not None
                                                     for c in self.preflight.checks)
        rehearsal = Rehearsal(target, self.device, checked)
        if not self.device.startswith("cuda"):
            rehearsal = replace(rehearsal, reason="not-cuda")
        elif self.torch is None:
            rehearsal = replace(rehearsal, reason="torch-not-imported")
        elif not self._cuda_ready() and not self._loads_to_cuda():
            rehearsal = replace(rehearsal, reason="cuda-not-initialized")
        self.rehearsal = rehearsal
        if rehearsal.reason is not None:  # on cpu that is expected; on a GPU it is a warning
            self._say(rehearsal_line(rehearsal, before=True), always=rehearsal.reason != "not-cuda")

    def _cuda_ready(self) -> bool:
        """Whether the user's torch has CUDA initialized (asking creates no context)."""
        try:
            return bool(self.torch is not None and self.torch.cuda.is_initialized())
        except Exception:
            return False

    def _loads_to_cuda(self) -> bool:
        named = [d for d in (self.requested_device, self.device_hint) if d is not None]
        if isinstance(self.preflight_source, Preflight) and self.preflight_source.device is not None:
            named.append(self.preflight_source.device)
        return any(d.startswith("cuda") for d in named)

    def _apply_cap(self) -> None:
        """Cap this process on the device at the target's usable memory plus what it holds now."""
        from .render.guard import rehearsal_line

        rehearsal = self.rehearsal
        if rehearsal is None or rehearsal.reason is not None or rehearsal.cap is not None or self.torch is None:
            return
        cuda = self.torch.cuda
        index = int(self.device.partition(":")[2] or 0)
        try:
            if not cuda.is_initialized():
                cuda.init()  # only for a load known to go to CUDA (see _plan_rehearsal)
            total = int(cuda.get_device_properties(index).total_memory)
            held = int(cuda.memory_allocated(index))
            fraction = memory_fraction_for(rehearsal.target.usable, total, held)
            rehearsal = replace(rehearsal, device_total=total, held_before=held)
            if fraction >= 1.0:
                self.rehearsal = replace(rehearsal, reason="not-larger")
                self._say(rehearsal_line(self.rehearsal), always=True)
                return
            manager = capped(cuda, index, fraction)
            cap = manager.__enter__()
        except Exception as exc:
            self.rehearsal = replace(rehearsal, reason="cap-failed", error=f"{type(exc).__name__}: {exc}")
            self._say(rehearsal_line(self.rehearsal), always=True)
            return
        self._cap_exit = lambda: manager.__exit__(None, None, None)
        hold_cap(self, self._release_cap)  # put back after the cell even if a Ctrl-C skips our finally
        self.rehearsal = replace(rehearsal, cap=cap)

    def _release_cap(self) -> None:
        """Put the previous memory fraction back (once); a failed restore becomes a note, not an error."""
        release = self._cap_exit
        if release is None or self.rehearsal is None:
            return
        try:
            release()
        except KeyboardInterrupt:  # a Ctrl-C landed in the restore itself: finish it, then go on
            self._cap_exit = None
            cap_released(self)
            cap = self.rehearsal.cap
            if cap is not None and self.torch is not None:
                self.torch.cuda.set_per_process_memory_fraction(cap.restore_to, cap.device_index)
                self.rehearsal = replace(self.rehearsal, restored=True)
            raise
        except Exception as exc:
            self._cap_exit = None
            cap_released(self)
            cap = self.rehearsal.cap
            where = f"torch.cuda.set_per_process_memory_fraction({cap.restore_to if cap else 1.0}, {cap.device_index if cap else 0})"
            self.rehearsal = replace(self.rehearsal, restored=False,
                                     error=f"could not put the previous fraction back ({exc}): run {where}")
            return
        self._cap_exit = None
        cap_released(self)
        self.rehearsal = replace(self.rehearsal, restored=True)

    def _resolve_device(self) -> str:
        if self.requested_device is not None:
            return resolve_device(self.requested_device)  # the user's own choice: a bad one is an error
        hint = self.device_hint
        if hint is None and isinstance(self.preflight_source, Preflight):
            hint = self.preflight_source.device
        if hint is None:
            return default_device()
        try:
            return resolve_device(hint)
        except OomMagicError:
            fallback = default_device()
            self.notes.append(f"the load targets {hint}, which this machine does not have: measuring {fallback}")
            return fallback

    def _start_snapshot(self) -> str | None:
        if self.snapshot_path is None:
            return None
        if not self.device.startswith("cuda"):
            return f"--snapshot records the CUDA allocator's history; {self.device} has none, so nothing was recorded"
        if self.torch is None:
            return "--snapshot needs torch imported before the cell (import it in an earlier cell); nothing was recorded"
        initialized = cuda_initialized()
        error = start_history(self.torch)
        if error:
            return error
        self._recording = True
        self._say("recording CUDA allocator history for --snapshot" + ("" if initialized else " (CUDA initialized for it)"))
        return None

    def _read(self) -> DeviceReading:
        reading = read_device(self.device)
        cap = cuda_process_cap(self.device, self.torch) if self.device.startswith("cuda") else None
        if cap is None and self._cap_exit is not None and self.rehearsal is not None:
            cap = self.rehearsal.limit  # torch < 2.9 cannot read the fraction back: the one --target set
        self._process_cap = cap
        if cap is not None and reading.free is not None:
            # set_per_process_memory_fraction: what this process may still reserve, not the device's free
            free = min(reading.free, max(cap - (reading.reserved or 0), 0))
            reading = replace(reading, free=free, notes=reading.notes + (
                f"this process may reserve at most {cap} bytes (torch.cuda.set_per_process_memory_fraction)",))
        if self.device == "cpu":
            usable, limit = usable_ram()
            self._free_limit = limit
            if usable is not None and (reading.free is None or usable < reading.free):
                notes = reading.notes + ((f"free is limited by {limit}",) if limit else ())
                reading = replace(reading, free=usable, notes=notes)
        return reading

    def _start_attempt(self, number: int) -> _Start:
        self.torch = self.torch or loaded_torch()
        if number == 1:
            self._apply_cap()  # before the readings, so "free" is what the cell may still take under the cap
        reading = self._read()
        index = int(self.device.partition(":")[2] or 0)
        was_initialized = cuda_initialized()
        peak_mark = None
        if self.device.startswith("cuda") and self.torch is not None:
            peak_mark = cuda_peak_start(self.torch, index)
        storages, variables = _scan(self.torch, self.device, self.shell, self.namespace, variables=number == 1)
        if number == 1:
            self.variables_before = variables
        reset = self.device == "cpu" and _reset_rss_peak()
        if number == 1:
            self._first_reading = reading
        return _Start(reading, storages, was_initialized, reading.process_used, reset, _max_rss(), time.perf_counter(),
                      peak_mark)

    def _succeeded(self, start: _Start, number: int) -> Attempt:
        seconds = time.perf_counter() - start.started
        self._finish = (start, seconds)
        return Attempt(number, "ok", seconds)

    def _abort(self, start: _Start, exc: BaseException, attempts: list[Attempt]) -> None:
        """A non-OOM error: stop recording, keep a report, and let the error go on as usual."""
        seconds = time.perf_counter() - start.started
        self._stop_snapshot()
        first = _first_line(exc)
        attempts = attempts + [Attempt(len(attempts) + 1, "error", seconds, f"{type(exc).__name__}: {first}")]
        after = self._read()
        self._release_cap()
        self.report = GuardReport(self.device, "error", tuple(attempts), self.cleanup_report, self.allocator,
                                  self.preflight, start.reading, after, seconds, None, None,
                                  PeakReading(None, None, "none", "the cell raised an error"),
                                  (), self.snapshot_note, tuple(self.notes), self.label, self.rehearsal)

    def _failed(self, start: _Start, exc: BaseException, number: int) -> Attempt:
        """Out of memory: print the traceback, give back, parse and diagnose; keep no reference to exc."""
        from .render.guard import diagnosis_text, give_back_line

        seconds = time.perf_counter() - start.started
        self.torch = self.torch or loaded_torch()
        text = self.format_traceback(exc)
        self._say(text.rstrip("\n"), always=True)
        first = _first_line(exc)
        self._error_type = type(exc)
        message = parse_oom_message(_message(exc)) or parse_oom_message(text)
        at_failure = self._read()
        at_failure_storages = _storage_bytes(self.torch, self.device)
        snapshot_file = self._dump_snapshot()
        block = self._largest_free_block()
        frames = _clear_frames(exc)
        del exc
        dropped = _drop_last_exception(self.namespace)
        try:
            stale: FreeReport | None = free_stale(self.device, shell=self.shell, namespace=self.namespace)
        except Exception as error:  # the recovery must not hide the out-of-memory error
            stale = None
            self.notes.append(f"freeing stale memory after the failure did not finish: {error}")
        gc.collect()
        _empty_cache(self.torch, self.device)
        after = self._read()
        after_storages = _storage_bytes(self.torch, self.device)
        new = set(at_failure_storages) - set(start.storages)
        failed_freed = sum(at_failure_storages[k] for k in new if k not in after_storages)
        still = {k for k in new if k in after_storages}
        stale_freed = sum(b for k, b in start.storages.items() if k not in after_storages)
        still_by: tuple[str, ...] = ()
        holders: tuple[tuple[str, int], ...] = ()
        if self.torch is not None:
            try:
                still_by, holders = _holders_of(self.torch, self.device, still, self.shell, self.namespace)
            except Exception as error:
                self.notes.append(f"could not name what holds the device memory: {error}")
        give_back = GiveBack(failed_freed, stale_freed, sum(after_storages[k] for k in still), still_by,
                             frames, dropped, at_failure, after, stale)
        self._say(give_back_line(give_back, self.device), always=True)
        check = self._fit_check()
        kernels = self._other_kernels(message, at_failure)
        diagnosis = diagnose(
            message, device=self.device, before=start.reading, at_failure=at_failure, now=after,
            stale_freed_before=self.cleanup_report.freed_bytes if self.cleanup_report else None,
            stale_given_back=stale_freed, given_back=failed_freed, still_held=give_back.still_held_bytes,
            holders=holders, estimate=check.estimate if check else None, need=check.need if check else None,
            dtype=check.dtype if check else None, loader=check.call.kind if check else "from_pretrained",
            largest_free_block=block, expandable_segments=_expandable_now(self.env) if self.device.startswith("cuda") else None,
            cuda_initialized_before=start.cuda_was_initialized, headroom=self._headroom(after),
            ram_budget=self._ram_budget(), disk_budget=self._disk_budget(),
            free_limit=getattr(self, "_free_limit", None) if self.device == "cpu" else None,
            process_limit=getattr(self, "_process_cap", None), kernels=kernels)
        capped_as = self.rehearsal.target if self.rehearsal is not None and self.rehearsal.cap is not None else None
        self._say(diagnosis_text(diagnosis, capped_as), always=True)
        return Attempt(number, "oom", seconds, f"{self._error_type.__name__}: {first}", message, give_back,
                       diagnosis, snapshot_file)

    def _other_kernels(self, message: OOMMessage | None, reading: DeviceReading) -> dict[int, Any]:
        """Which other processes on the GPU are this user's Jupyter kernels, with their notebooks."""
        if not self.device.startswith("cuda"):
            return {}
        me = os.getpid()
        pids = {pid for pid, _ in (message.processes if message else ()) if pid != me}
        pids |= {p.pid for p in reading.processes if not p.is_self}
        if not pids:
            return {}
        try:
            from .jupyter_kernels import find_jupyter_kernels

            return find_jupyter_kernels(pids)
        except Exception:  # naming kernels is a nicety: never a reason to fail the recovery
            return {}

    def _fit_check(self) -> Any:
        """The preflight check for the load on this device (its estimate and need), if any."""
        if self.preflight is None:
            return None
        sized = [c for c in self.preflight.checks if c.estimate is not None]
        same = [c for c in sized if c.device == self.device or (c.device == "auto" and any(d == self.device for d, _ in c.split))]
        return (same or sized or [None])[0]

    def _headroom(self, reading: DeviceReading) -> int:
        if self.rehearsal is not None and self.rehearsal.cap is not None:
            return parse_headroom(self.headroom_spec, self.rehearsal.target.total)  # a percentage of the target
        return parse_headroom(self.headroom_spec, reading.total)

    def _ram_budget(self) -> int | None:
        usable, _ = usable_ram()
        if usable is None:
            return None
        cpu_total = read_device("cpu").total
        return max(usable - parse_headroom(self.headroom_spec, cpu_total), 0)

    @staticmethod
    def _disk_budget() -> int | None:
        import shutil

        try:
            return int(shutil.disk_usage(os.getcwd()).free)
        except OSError:
            return None

    def _largest_free_block(self) -> int | None:
        if not self.device.startswith("cuda") or self.torch is None or not cuda_initialized():
            return None
        try:
            return largest_free_block(self.torch.cuda.memory_snapshot(), int(self.device.partition(":")[2] or 0))
        except Exception:
            return None

    def _dump_snapshot(self) -> str | None:
        if not getattr(self, "_recording", False) or self.torch is None:
            return None
        try:
            written = dump_history(self.torch, self.snapshot_path)  # type: ignore[arg-type]
        except Exception as exc:
            self.snapshot_note = f"could not write the allocator history: {exc}"
            return None
        self.snapshot_note = written
        self._say(f"allocator history written to {written}: open it at https://pytorch.org/memory_viz", always=True)
        return written

    def _stop_snapshot(self) -> None:
        if getattr(self, "_recording", False) and self.torch is not None:
            stop_history(self.torch)
            self._recording = False

    def _retry_after(self, attempt: Attempt, number: int) -> bool:
        from .render.guard import retry_line

        if attempt.outcome != "oom" or number > self.retry:
            return False
        verdict = attempt.diagnosis.retry if attempt.diagnosis else None
        self._say(retry_line(verdict, number, self.retry + 1), always=True)
        return bool(verdict and verdict.can_fit)

    def _end(self, attempts: list[Attempt]) -> None:
        """Build the report; after an OOM raise the short exception (or only print, if so configured)."""
        __tracebackhide__ = True
        self._ended = True
        self._stop_snapshot()
        last = attempts[-1]
        if last.outcome == "ok":
            start, seconds = self._finish
            after = self._read()
            self._release_cap()
            self.report = self._ok_report(attempts, start, seconds, after)
            return
        give_back = last.give_back
        after = give_back.after if give_back is not None else self._read()
        self._release_cap()
        self.report = GuardReport(self.device, "oom", tuple(attempts), self.cleanup_report, self.allocator,
                                  self.preflight, self._first_reading, after, last.seconds, None, None,
                                  PeakReading(None, None, "none", "the load ran out of memory"),
                                  (), self.snapshot_note, tuple(self.notes), self.label, self.rehearsal)
        if self.raise_on_oom:
            raise _short_exception(self._error_type, self.report)

    def _ok_report(self, attempts: list[Attempt], start: _Start, seconds: float, after: DeviceReading) -> GuardReport:
        self.torch = self.torch or loaded_torch()
        delta = _delta(start.reading, after, self.device)
        peak = self._peak(start, after)  # first: the scan below allocates
        tensor_delta: int | None = None
        variables: tuple[VariableUse, ...] = ()
        try:
            storages, by_variable = _scan(self.torch, self.device, self.shell, self.namespace, variables=True)
            if self.torch is not None:
                tensor_delta = sum(storages.values()) - sum(start.storages.values())
            variables = self._variables(by_variable)
        except Exception as error:  # the load succeeded: a failed measurement must not turn it into an error
            self.notes.append(f"could not measure the new variables: {error}")
        return GuardReport(self.device, "ok", tuple(attempts), self.cleanup_report, self.allocator, self.preflight,
                           start.reading, after, seconds, delta, tensor_delta, peak, variables,
                           self.snapshot_note, tuple(self.notes), self.label, self.rehearsal)

    def _peak(self, start: _Start, after: DeviceReading) -> PeakReading:
        if self.device.startswith("cuda"):
            if self.torch is None:
                return PeakReading(None, None, "none", "torch is not imported: no allocator peak")
            return cuda_peak_read(self.torch, int(self.device.partition(":")[2] or 0), start.cuda_was_initialized,
                                  start.reading.allocated, start.cuda_peak_before, after.allocated)
        if self.device == "cpu":
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
        return PeakReading(None, None, "none", f"{self.device} gives no peak figure")

    def _variables(self, after: dict[str, _VarBytes]) -> tuple[VariableUse, ...]:
        ids_after = {k: id(v) for k, v in list(dict.items(self.namespace)) if is_user_name(k)}
        result: list[VariableUse] = []
        for name, ident in ids_after.items():
            path = name if isinstance(name, str) and name.isidentifier() else f"globals()[{name!r}]"
            now = after.get(path)
            before = self.variables_before.get(path)
            now_bytes = now.total if now else 0
            before_bytes = before.total if before else 0
            if name not in self.ids_before:
                change = "new"
            elif self.ids_before[name] != ident:
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


def _cell_number(shell: Any) -> int:
    """The In[N] of the running %%guardload cell, so tracebacks say "Cell In[N]" as the prompt did.

    IPython counts the cell before running it; the number it cached the cell under is the last
    one in its compiler's filename map when that cell is this magic's.
    """
    import linecache

    try:
        name, number = next(reversed(shell.compile._filename_map.items()))
        if "run_cell_magic('guardload'" in "".join(linecache.cache.get(name, (0, 0, [], ""))[2]):
            return int(number)
    except Exception:
        pass
    return int(shell.execution_count)


def compile_cell(shell: Any, cell: str) -> tuple[Callable[[], Any], str]:
    """Compile a cell as IPython runs it (transform_cell, AST transformers, cached source for tracebacks).

    Returns a function that runs it in the user namespace and returns the value of a final
    expression (None otherwise), and the transformed source (for the preflight). A SyntaxError
    propagates as it would without the magic.
    """
    import ast

    source = shell.transform_cell(cell)
    tree = shell.compile.ast_parse(source)
    tree = shell.transform_ast(tree)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        ast.fix_missing_locations(last)
    filename = shell.compile.cache(source, _cell_number(shell), raw_code=cell)
    # Top-level await is allowed as in a plain cell (unless %autoawait is off): such code
    # evaluates to a coroutine, run below.
    flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0) if getattr(shell, "autoawait", False) else 0
    with shell.compile.extra_flags(flags):
        code = shell.compile(tree, filename, "exec")
        last_code = shell.compile(last, filename, "eval") if last is not None else None
    glob, local = shell.user_global_ns, shell.user_ns

    def body() -> Any:
        __tracebackhide__ = True
        if code.co_flags & _CO_COROUTINE:
            _run_coroutine(shell, eval(code, glob, local))
        else:
            exec(code, glob, local)
        if last_code is None:
            return None
        value = eval(last_code, glob, local)
        return _run_coroutine(shell, value) if last_code.co_flags & _CO_COROUTINE else value

    return body, source


def _run_coroutine(shell: Any, coro: Any) -> Any:
    """Run a cell's top-level-await coroutine as IPython would run the plain cell.

    IPython's own runner (``shell.loop_runner``, which ``%autoawait`` sets) when no event loop runs
    in this thread; in a kernel, whose loop is running this very cell, the runner gets a thread of
    its own, since a second loop cannot run inside the first.
    """
    import asyncio
    import threading

    runner = getattr(shell, "loop_runner", None) or asyncio.run
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return runner(coro)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = runner(coro)
        except BaseException as exc:  # handed to the cell's thread, raised there
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="oom-magic top-level await", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        error = outcome.pop("error")
        try:
            raise error
        finally:
            del error
    return outcome.get("value")


def _delta(before: DeviceReading, after: DeviceReading, device: str) -> int | None:
    if device.startswith("cuda") or device == "mps":
        if before.allocated is not None and after.allocated is not None:
            return after.allocated - before.allocated
    if before.process_used is not None and after.process_used is not None:
        return after.process_used - before.process_used
    return None


class _AttemptContext:
    """One attempt of ``for attempt in guard_load(retry=N): with attempt: ...``."""

    def __init__(self, guard: GuardedLoad, number: int) -> None:
        self.guard = guard
        self.number = number
        self.attempt: Attempt | None = None

    def __enter__(self) -> _AttemptContext:
        self._start = self.guard._start_attempt(self.number)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.attempt = self.guard._succeeded(self._start, self.number)
            return False
        if not _needs_forensics(exc):
            self.guard._abort(self._start, exc, [])
            return False
        self.attempt = self.guard._failed(self._start, exc, self.number)
        del exc, tb
        return True  # handled: the loop decides whether to retry or raise the short exception


def _short_exception(error_type: type[BaseException], report: GuardReport) -> BaseException:
    """The original's type with a one-line message; IPython shows it as that one line."""
    from .render.guard import short_message

    message = short_message(report)
    try:
        short = error_type(message)
        if not isinstance(short, BaseException):
            raise TypeError
    except Exception:
        short = RuntimeError(message)
    name = type(short).__name__
    try:
        short.oom_report = report  # type: ignore[attr-defined]
        short._render_traceback_ = lambda: [f"{name}: {message}"]  # type: ignore[attr-defined]
    except Exception:
        pass
    return short


def guard_load(device: str | None = None, retry: int = 0, *, cleanup: bool = True,
               expandable_segments: bool = True, snapshot: str | os.PathLike[str] | None = None,
               headroom: str | int | None = None, quiet: bool = False, raise_on_oom: bool = True,
               namespace: dict | None = None, target: str | Target | None = None) -> GuardedLoad:
    """Guard a model load in a script: ``with oom_magic.guard_load(): model = ...``.

    Before: frees stale memory (unless ``cleanup=False``) and turns on ``expandable_segments``
    while CUDA is not initialized. After: ``.report`` holds the device delta, the peak, the time
    and the new variables. On out-of-memory: prints the traceback and a diagnosis, gives back
    what the failed load left, and raises a short exception of the original type (or, with
    ``raise_on_oom=False``, only prints). ``retry=N`` needs the loop or function form:
    ``for attempt in guard_load(retry=2): with attempt: ...`` or ``guard_load(retry=2).run(fn)``.
    ``target`` ("T4", "16GiB") rehearses the load for that GPU: on a larger CUDA device the block
    runs capped at the target's usable memory (``device="cuda"`` lets the cap initialize CUDA),
    and the previous cap is put back afterwards; elsewhere the report says nothing was capped.
    A bad target is an OomMagicError naming the known GPUs.
    """
    return GuardedLoad(device, retry, cleanup=cleanup, expandable_segments=expandable_segments,
                       snapshot=snapshot, headroom=headroom, quiet=quiet, raise_on_oom=raise_on_oom,
                       namespace=namespace, target=target)

