"""Explain an out-of-memory error: rank its likely causes, each with the numbers that show it.

Figures in (the parsed message, device readings, what the cleanup and the give-back recovered,
the checkpoint estimate), records (``records/diagnosis.py``) out. No torch, no IPython, no device
calls; the one look outside is whether a pid the message lists exists in this pid namespace (to
recognise this process under its host pid in a container). The
ways to make a load fit (``fit_options``) live here too, because a preflight that says "will not
fit" and a diagnosis that says "too big" give the same advice with the same sizes.

Causes, in the order used to break ties:

- ``other-processes``: other processes hold device memory (which, how much, Jupyter kernels);
- ``stale``: this process held stale memory (output cache, stored tracebacks, garbage);
- ``variables``: this process's own variables hold device memory (an earlier model);
- ``fragmentation``: enough memory is free or cached, but not in one block;
- ``too-big``: the load needs more than this device can give;
- ``partial-load``: the failed load's partial weights were given back, so a smaller retry fits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, Sequence

from .oom import OOMMessage, parse_oom_message
from ..fit.options import device_index, fit_options
from ..records.diagnosis import Cause, Diagnosis, FitOption, RetryVerdict

if TYPE_CHECKING:
    from ..device.reading import DeviceReading
    from ..checkpoints.estimate import CheckpointEstimate
    from ..device.processes import ProcessInfo

__all__ = ["Cause", "Diagnosis", "FitOption", "RetryVerdict", "diagnose", "fit_options", "device_index"]

CAUSE_ORDER = ("other-processes", "stale", "variables", "fragmentation", "too-big", "partial-load")
# A cause that explains less than this share of the shortfall is left out of the ranking.
_MIN_SCORE = 0.05
# A CUDA context (with cuBLAS/cuDNN handles and eager module loading) stays under this on current GPUs.
_CONTEXT_AT_MOST = 2 * 1024**3


def diagnose(oom: OOMMessage | str | None = None, *, device: str | None = None,
             before: DeviceReading | None = None, at_failure: DeviceReading | None = None,
             now: DeviceReading | None = None, stale_freed_before: int | None = None,
             stale_given_back: int | None = None, given_back: int | None = None,
             still_held: int | None = None, holders: Sequence[tuple[str, int]] = (),
             estimate: CheckpointEstimate | None = None, need: int | None = None,
             dtype: str | None = None, loader: str = "from_pretrained",
             largest_free_block: int | None = None, expandable_segments: bool | None = None,
             cuda_initialized_before: bool | None = None, headroom: int = 0,
             ram_budget: int | None = None, disk_budget: int | None = None,
             free_limit: str | None = None, process_limit: int | None = None,
             kernels: Mapping[int, Any] | None = None, self_pid: int | None = None,
             fit_budget: int | None = None) -> Diagnosis:
    """Rank the likely causes of an out-of-memory error, each with the numbers that show it.

    Every argument but the first is optional; the more figures, the sharper the answer.
    ``oom``: the parsed message (or its text). Readings of the device: ``before`` the load,
    ``at_failure`` right after it failed, ``now`` after the give-back. Bytes:
    ``stale_freed_before`` (the cleanup before the load), ``stale_given_back`` (stale memory from
    before the load freed after it failed), ``given_back`` (the failed load's own tensors freed),
    ``still_held`` (the failed load's tensors something still holds), ``holders`` (this process's
    variables holding device memory, largest first). The load: ``estimate`` (its checkpoint),
    ``need`` (bytes it puts on the device), ``dtype``, ``loader``. CUDA allocator facts:
    ``largest_free_block`` (from the allocator snapshot), ``expandable_segments``,
    ``cuda_initialized_before``. ``headroom`` is kept free in every fit comparison.
    ``free_limit`` says what limits free memory when it is not the device itself (CPU: "the
    address-space limit (ulimit -v)", "the container's memory limit (cgroup)");
    ``process_limit`` is the bytes this process may reserve on a CUDA device when
    ``torch.cuda.set_per_process_memory_fraction`` caps it (the message's "allowed" figure).
    ``kernels`` names the other processes that are Jupyter kernels of this user
    (``jupyter_kernels.find_jupyter_kernels``: pid -> notebook_path and stop_hint).
    ``fit_budget`` is the budget the fit check before the load compared with (its
    ``FitCheck.budget``): the ways to fit are sized against it, so the check before and the
    diagnosis after give one verdict per option. Without it: the capacity − headroom, or on a cpu
    whose free memory a limit bounds, the free memory before the load − headroom.
    """
    import os

    message = parse_oom_message(oom) if isinstance(oom, str) else oom
    where = device or (at_failure.device if at_failure else now.device if now else before.device if before else None)
    if where is None:
        where = _device_from_message(message)
    self_pid = os.getpid() if self_pid is None else self_pid
    requested = message.requested if message else None
    if process_limit is None and message is not None:
        process_limit = message.allowed  # the message names the per-process cap when one was set
    capped_free = at_failure.free if at_failure is not None and process_limit is not None else None
    if process_limit is not None and message is not None and message.reserved_total is not None:
        capped_free = max(process_limit - message.reserved_total, 0)  # what the cap still allowed
    # Under a per-process cap the device's free memory is not what this process could still get.
    free = _first(capped_free, message.free if message else None, at_failure.free if at_failure else None)
    total = _first(message.total if message else None, _total(at_failure, now, before))
    capacity = total if process_limit is None or total is None else min(total, process_limit)
    shortfall = requested - free if requested is not None and free is not None else None
    if shortfall is not None and shortfall <= 0:
        shortfall = None  # the figures disagree (another allocation raced); do not rank by it
    need = need if need is not None else (estimate.bytes if estimate is not None else None)
    free_now = now.free if now is not None else None

    # Under an address-space limit other processes' RAM is not what ran out.
    others_count = not (where == "cpu" and free_limit is not None and "address-space" in free_limit)
    causes = [c for c in (
        _other_processes(message, at_failure or now or before, self_pid, shortfall, where, kernels or {})
        if others_count else None,
        _stale(stale_given_back, stale_freed_before, shortfall),
        _variables(holders, shortfall),
        _fragmentation(message, requested, largest_free_block, free, expandable_segments,
                       cuda_initialized_before, where),
        _too_big(requested, need, capacity, free, before, estimate, where, dtype, loader, headroom,
                 ram_budget, disk_budget, capped=capacity != total,
                 budget=_fit_budget(fit_budget, capacity, before, headroom, where, free_limit)),
        _partial_load(given_back, still_held, estimate, where, free_now, headroom, dtype, loader,
                      ram_budget, disk_budget, need, requested),
    ) if c is not None]
    causes.sort(key=lambda c: (-c.score, CAUSE_ORDER.index(c.kind)))
    notes: list[str] = []
    if message is None:
        notes.append("the error text is not one of PyTorch's out-of-memory messages: figures come from readings only")
    if free_limit is not None:
        notes.append(f"free memory here is limited by {free_limit}, not by the machine's RAM")
    # from the message alone (an NVML reading already says who each pid is)
    seen = at_failure or now or before
    listed = seen.processes if seen is not None else ()
    own_note = _self_note(message, self_pid) if where != "cpu" and not listed else None
    if own_note is not None:
        notes.append(own_note)
    retry = _retry_verdict(requested, need, given_back, free_now, headroom)
    return Diagnosis(where, message, requested, free, total, shortfall, tuple(causes), retry, tuple(notes))


def _fit_budget(given: int | None, capacity: int | None, before: DeviceReading | None, headroom: int,
                device: str, free_limit: str | None) -> int | None:
    """What the options are sized against: the fit check's budget, else what the device could ever give."""
    if given is not None:
        return given
    if device == "cpu" and free_limit is not None and before is not None and before.free is not None:
        return before.free - headroom  # under ulimit -v or a cgroup the machine's RAM is not the bound
    return None if capacity is None else capacity - headroom


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _total(*readings: DeviceReading | None) -> int | None:
    return _first(*(r.total for r in readings if r is not None))


def _device_from_message(message: OOMMessage | None) -> str:
    if message is None:
        return "unknown"
    if message.backend in ("cuda", "hip", "xpu"):
        kind = "xpu" if message.backend == "xpu" else "cuda"  # ROCm builds name HIP devices cuda:N
        return f"{kind}:{message.device_index or 0}"
    return message.backend


def _share(part: int | None, shortfall: int | None, total: int | None = None) -> float:
    """How much of the shortfall ``part`` accounts for (1.0: all of it)."""
    if not part or part <= 0:
        return 0.0
    if shortfall:
        return min(part / shortfall, 1.0)
    if total:
        return min(part / total, 1.0)
    return 0.5


def _other_processes(message: OOMMessage | None, reading: DeviceReading | None, self_pid: int,
                     shortfall: int | None, device: str, kernels: Mapping[int, Any]) -> Cause | None:
    infos = {p.pid: p for p in (reading.processes if reading is not None else ())}
    if device == "cpu":
        # System RAM: everything not this process is "other processes".
        if reading is None or reading.used is None or reading.process_used is None:
            return None
        others = max(reading.used - reading.process_used, 0)
        score = _share(others, shortfall, reading.total) * 0.5  # RAM is shared by design: weaker evidence
        if score < _MIN_SCORE:
            return None
        return Cause("other-processes", score, (("others", others), ("total", reading.total)))
    pairs: list[tuple[int, int]] = []
    if message is not None and message.processes:
        own = {self_pid, reading.own_listed_pid if reading is not None else None, _own_pid_in_message(message, self_pid)}
        if not infos and message.this_process is None:  # the message alone, and it names no "this process"
            own.add(_self_by_reserved(message, self_pid))
        pairs = [(pid, used) for pid, used in message.processes if pid not in own]
    else:
        pairs = [(p.pid, p.used_bytes) for p in infos.values() if not p.is_self and p.used_bytes is not None]
    others = sum(used for _, used in pairs)
    score = _share(others, shortfall, message.total if message else None)
    if score < _MIN_SCORE:
        return None
    procs = tuple(sorted((infos.get(pid) or _bare_process(pid, used) for pid, used in pairs),
                         key=lambda p: -(p.used_bytes or 0)))
    named = tuple((pid, getattr(kernels[pid], "notebook_path", None), str(getattr(kernels[pid], "stop_hint", "")))
                  for pid, _ in pairs if pid in kernels)
    in_kernels = sum(used for pid, used in pairs if pid in kernels
                     or (infos.get(pid) is not None and infos[pid].is_jupyter_kernel))
    return Cause("other-processes", score, (("others", others), ("kernels", in_kernels)), processes=procs,
                 kernels=named)


def _own_pid_in_message(message: OOMMessage, self_pid: int) -> int | None:
    """The pid under which the message lists this process (a host pid in a container), or None.

    PyTorch prints "this process has M memory in use" beside NVML's list: the one listed pid that
    is not in our pid namespace and holds M (to its two-decimal rounding) is this process.
    """
    from ..device.processes import recognise_self

    held = message.this_process
    if held is None:
        return None
    slack = max(held // 100, 16 << 20)  # "20.50 GiB" is exact to ±5 MiB; allow rounding both sides
    return recognise_self(message.processes, held - slack, held + slack, self_pid=self_pid)


def _self_by_reserved(message: OOMMessage, self_pid: int) -> int | None:
    """With no "this process" line (a container: PyTorch did not see its own pid in NVML's list), the one
    listed pid outside our pid namespace that holds PyTorch's reserved memory plus a CUDA context is us."""
    reserved = message.reserved_total
    if reserved is None or not message.processes:
        return None
    from ..device.processes import recognise_self

    slack = 16 << 20  # each figure is printed to two decimals: ±5 MiB at GiB scale, three figures
    return recognise_self(message.processes, reserved - slack, reserved + _CONTEXT_AT_MOST + slack, self_pid=self_pid)


def _self_note(message: OOMMessage | None, self_pid: int) -> str | None:
    """Say when the message lists this kernel under its host pid (as the NVML path does)."""
    if message is None or message.this_process is not None:
        return None
    pid = _self_by_reserved(message, self_pid)
    if pid is None or pid == self_pid:
        return None
    from ..device.processes import NOTE_SELF_HOST_PID
    from ..render.units import format_bytes

    used = dict(message.processes)[pid]
    return (f"process {pid} in the message is {NOTE_SELF_HOST_PID}: its {format_bytes(used)} are PyTorch's "
            f"{format_bytes(message.reserved_total)} reserved plus the CUDA context, not another process")


def _bare_process(pid: int, used: int) -> ProcessInfo:
    from ..device.processes import ProcessInfo

    return ProcessInfo(pid, used, None, None, None, False, "not described (no NVML reading)")


def _stale(stale_given_back: int | None, stale_freed_before: int | None, shortfall: int | None) -> Cause | None:
    score = _share(stale_given_back, shortfall)
    if score < _MIN_SCORE:
        return None
    return Cause("stale", score, (("stale_given_back", stale_given_back), ("stale_freed_before", stale_freed_before)))


def _variables(holders: Sequence[tuple[str, int]], shortfall: int | None) -> Cause | None:
    held = tuple((name, int(b)) for name, b in holders if b > 0)
    total = sum(b for _, b in held)
    score = _share(total, shortfall) * 0.9  # the user may need them: rank just below stale memory
    if score < _MIN_SCORE:
        return None
    return Cause("variables", score, (("held", total),), holders=held[:5])


def _fragmentation(message: OOMMessage | None, requested: int | None, largest_free_block: int | None,
                   free: int | None, expandable: bool | None, initialized: bool | None,
                   device: str) -> Cause | None:
    if requested is None or not device.startswith(("cuda", "hip", "xpu")):
        return None
    cache = message.reserved_unallocated if message is not None else None
    flags = []
    if expandable:
        flags.append("expandable-on")
    if initialized:
        flags.append("cuda-initialized")
    figures = (("cache", cache), ("requested", requested), ("largest_free_block", largest_free_block), ("free", free))
    if cache is not None and cache >= requested:
        # PyTorch already released what it could before raising: what stays cached is split.
        return Cause("fragmentation", 1.0, figures, flags=tuple(flags))
    if largest_free_block is not None and largest_free_block < requested <= (cache or 0) + (free or 0):
        return Cause("fragmentation", 0.8, figures, flags=tuple(flags))
    if cache is not None and cache > 0 and free is not None and cache + free >= requested:
        return Cause("fragmentation", 0.6, figures, flags=tuple(flags))
    return None


def _too_big(requested: int | None, need: int | None, total: int | None, free: int | None,
             before: DeviceReading | None, estimate: CheckpointEstimate | None, device: str,
             dtype: str | None, loader: str, headroom: int, ram_budget: int | None,
             disk_budget: int | None, capped: bool = False, budget: int | None = None) -> Cause | None:
    figures = (("need", need), ("requested", requested), ("total", total),
               ("free_before", before.free if before else None), ("headroom", headroom))
    flags: list[str] = ["process-limit"] if capped else []
    if need is not None and total is not None and need + headroom > total:
        score = 1.0
        flags.append("over-capacity")
    elif requested is not None and total is not None and requested > total:
        score = 1.0
        flags.append("over-capacity")
        if need is not None and requested > need:
            flags.append("not-the-weights")  # one allocation larger than the whole checkpoint
    elif need is not None and before is not None and before.free is not None and need + headroom > before.free:
        score = 0.4  # it would fit an empty device: whoever holds the rest shares the blame
    else:
        return None
    options: tuple[FitOption, ...] = ()
    if estimate is not None and "not-the-weights" not in flags:
        options = fit_options(estimate, device=device, need=need, dtype=dtype, loader=loader,
                              device_budget=budget, ram_budget=budget if device == "cpu" else ram_budget,
                              disk_budget=disk_budget)
    return Cause("too-big", score, figures, options=options, flags=tuple(flags))


def _partial_load(given_back: int | None, still_held: int | None, estimate: CheckpointEstimate | None,
                  device: str, free_now: int | None, headroom: int, dtype: str | None, loader: str,
                  ram_budget: int | None, disk_budget: int | None, need: int | None,
                  requested: int | None) -> Cause | None:
    if not given_back and not still_held:
        return None
    options: tuple[FitOption, ...] = ()
    weights_failed = need is None or requested is None or requested <= need
    if estimate is not None and free_now is not None and weights_failed:
        options = tuple(o for o in fit_options(estimate, device=device, need=need, dtype=dtype, loader=loader,
                                               device_budget=free_now - headroom, ram_budget=ram_budget,
                                               disk_budget=disk_budget)
                        if o.fits)
    # A recovery, not a cause: ranked last unless the load's leftovers are still held.
    score = 0.5 if still_held else 0.01
    return Cause("partial-load", score, (("given_back", given_back), ("still_held", still_held),
                                         ("free_now", free_now)), options=options)


def _retry_verdict(requested: int | None, need: int | None, given_back: int | None,
                   free_now: int | None, headroom: int) -> RetryVerdict:
    """The same load fits now only if what it held plus what it asked (or its estimate) is free."""
    least = None
    if requested is not None:
        least = requested + (given_back or 0)
    if need is not None:
        least = max(least or 0, need)
    if least is None or free_now is None:
        return RetryVerdict(False, "unknown", free_now, least)
    if least + headroom <= free_now:
        return RetryVerdict(True, "fits-now", free_now, least)
    return RetryVerdict(False, "still-short", free_now, least)
