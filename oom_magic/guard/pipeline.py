"""Guard a model load: free stale memory first, measure what it cost, and recover when it runs out.

``%%guardload`` and ``with guard_load(): ...`` both drive ``GuardedLoad``, a pipeline of steps:

1. plan (``begin``): resolve the device, free stale memory (as ``%freeall``), set
   ``expandable_segments`` while CUDA is not yet initialized, check the fit (the magic's cell
   preflight; ``strict`` refuses here), start allocator history (``snapshot``), plan the
   ``--target`` rehearsal (``guard_rehearsal``);
2. attempt: take the figures before (``guard_measure``), run the load;
3. settle the attempt's outcome, in one place for ``run``, ``with`` and the retry loop: ok, out of
   memory, or another error (a report is kept and the error goes on as usual); on out of memory
   recover (``guard_recover``): print the traceback, give back what the failed load left, parse
   and diagnose the message, retry when the diagnosis says the same load fits now;
4. report: one ``GuardReport`` (and after an OOM a short exception of the original type).

Every line printed goes through the ``GuardPrinter`` (``guard_report``); the steps only build
records. The state of one run lives in a ``_Run`` made by the plan step.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TextIO
from collections.abc import Callable, Iterator, MutableMapping

from ..common._torch import cuda_initialized, loaded_torch
from ..device.allocator import allocator_setting, apply_allocator_setting, dump_history, start_history, stop_history
from ..heap.cleanup import FreeReport, free_stale
from ..heap.release import trim_c_heap
from ..device.reading import DeviceReading, default_device, resolve_device
from ..common.errors import OomMagicError
from .cell import compile_cell
from .measure import (AttemptStart, GuardedReading, cell_peak, changed_variables, delta, read_guarded,
                            scan_variables, start_attempt, user_ids)
from .recover import at_failure, diagnose_failure, give_back
from .rehearsal import apply_cap, force_restore, plan_rehearsal, restore_failed
from .printer import GuardPrinter, refusal_message, short_exception
from .oom import is_out_of_memory, parse_oom_message
from ..fit.context_room import RoomProbe
from ..fit.preflight import Preflight, parse_headroom
from ..records.guard import (AllocatorSetting, Attempt, ContextRoom, GiveBack, GuardReport, MadeIn, Outcome, PeakReading, Rehearsal,
                            VariableUse)
from ..heap.roots import current_shell
from ..fit.targets import Target, cap_released, hold_cap, parse_target
from .tracebacks import format_user_traceback

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["AllocatorSetting", "Attempt", "GiveBack", "GuardRefused", "GuardReport", "GuardUsedUp", "GuardedLoad",
           "PeakReading", "Rehearsal", "VariableUse", "allocator_setting", "apply_allocator_setting", "compile_cell",
           "guard_load"]


class GuardUsedUp(OomMagicError):
    """A finished guard asked to run again (it would run the load unguarded): one line in IPython."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class GuardRefused(OomMagicError):
    """--strict: the preflight says the load will not fit, so the cell was not run."""


def _error_line(exc: BaseException) -> str:
    """"Type: first line of the message", as an attempt records it (no message when its ``__str__`` raises)."""
    try:
        first = (str(exc).strip().splitlines() or [""])[0]
    except Exception:
        first = ""
    return f"{type(exc).__name__}: {first}"


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


@dataclass
class _Run:
    """What one guarded run knows as it goes: made by the plan step, filled in by each attempt."""

    device: str
    torch: ModuleType | None
    cleanup: FreeReport | None
    allocator: AllocatorSetting
    preflight: Preflight | None
    notes: list[str]
    ids_before: dict[str, int] = field(default_factory=dict)  # user variables before the load (new / rebound)
    history: str | None = None  # --snapshot: the file written, or why nothing was recorded
    recording: bool = False  # allocator history is being recorded
    rehearsal: Rehearsal | None = None  # --target
    cap_exit: Callable[[], Any] | None = None  # puts the previous memory fraction back
    first: AttemptStart | None = None  # the figures before the first attempt
    attempts: list[Attempt] = field(default_factory=list)
    succeeded: tuple[AttemptStart, float] | None = None  # the successful attempt's start and wall time
    error_type: type[BaseException] = RuntimeError  # the out-of-memory error's type, for the short exception
    room: RoomProbe | None = None  # the loaded model's KV growth per token, for the room after the load

    @property
    def capped_as(self) -> Target | None:
        """The target the cell ran capped as (None: not capped)."""
        return self.rehearsal.target if self.rehearsal is not None and self.rehearsal.cap is not None else None


class GuardedLoad:
    """Run a model load guarded: cleanup before, measurements after, forensics and recovery on OOM.

    Use ``with guard_load(): ...`` for one attempt, ``for attempt in guard_load(retry=2): with
    attempt: ...`` or ``guard_load(retry=2).run(fn)`` to retry. After it ends, ``.report`` is the
    GuardReport. Nothing here imports IPython: the magic passes its shell, traceback formatter and
    a preflight callable in; ``printer`` says what the guard prints (default: a ``GuardPrinter``
    on ``out``, hushed by ``quiet``).
    """

    def __init__(self, device: str | None = None, retry: int = 0, *, cleanup: bool = True,
                 expandable_segments: bool = True, snapshot: str | os.PathLike[str] | None = None,
                 headroom: str | int | None = None, quiet: bool = False, raise_on_oom: bool = True,
                 strict: bool = False, preflight: Preflight | Callable[[], Preflight] | None = None,
                 shell: Any = None, namespace: dict | None = None, out: TextIO | None = None,
                 format_traceback: Callable[[BaseException], str] | None = None,
                 label: str = "guard_load", env: MutableMapping[str, str] | None = None,
                 device_hint: str | None = None, target: str | Target | None = None,
                 printer: GuardPrinter | None = None) -> None:
        if type(retry) is not int or retry < 0:
            raise OomMagicError(f"retry must be a whole number, 0 or more, not {retry!r}")
        parse_headroom(headroom, 0)  # a bad spelling fails here, before anything runs
        self.target = parse_target(target) if target is not None else None  # a bad target fails here too
        self.requested_device = device
        self.device_hint = device_hint  # where the cell's load goes; falls back when this machine lacks it
        self.retry = retry
        self.cleanup = cleanup
        self.expandable_segments = expandable_segments
        self.history_path = snapshot  # --snapshot: where the allocator history goes on out-of-memory
        self.headroom_spec = headroom
        self.raise_on_oom = raise_on_oom
        self.strict = strict
        self.preflight_source = preflight
        self.shell = shell if shell is not None or namespace is not None else current_shell()
        self.namespace = namespace if namespace is not None else (
            getattr(self.shell, "user_ns", None) or sys.modules["__main__"].__dict__)
        self.made_in: MadeIn = "script" if current_shell() is None else "ipython"
        self.printer = printer if printer is not None else GuardPrinter(out, quiet, script=self.made_in == "script")
        self.format_traceback = format_traceback or format_user_traceback
        self.label = label
        self.env = os.environ if env is None else env
        self.report: GuardReport | None = None
        self.value: Any = None
        self._run: _Run | None = None
        self._with: _AttemptContext | None = None
        self._begun = False
        self._ended = False
        self._used = False

    @property
    def rehearsal(self) -> Rehearsal | None:
        """--target: how the load is (or was) rehearsed; None before ``begin`` or without a target."""
        return self._run.rehearsal if self._run is not None else None

    # ----------------------------------------------------------------- the three ways in
    def begin(self) -> None:
        """The plan step: cleanup, allocator setting, preflight (``strict`` refuses here).

        Called by ``run``, ``with`` and iteration; call it yourself to separate bad-input errors
        (OomMagicError: an unknown device, a --strict refusal) from errors of the load itself.
        """
        if self._used:
            raise GuardUsedUp("this guard has already run a load: a guard runs once, so call "
                              "guard_load(...) again for another load")
        if not self._begun:
            self._plan()

    def _claim(self) -> None:
        """Refuse a second use: a finished guard would otherwise run the load unguarded."""
        self.begin()
        self._used = True

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` guarded, retrying as allowed; return its result."""
        __tracebackhide__ = True
        self._claim()
        try:
            for number in range(1, self.retry + 2):
                start = self._start_attempt(number)
                try:
                    value = fn(*args, **kwargs)
                except BaseException as exc:
                    if self._settle(start, number, exc) is None:
                        raise
                else:
                    self._settle(start, number, None)
                    self.value = value
                if not self._again(number):
                    break
            self._end()
        finally:
            self._release_cap()  # an interrupt inside the guard's own steps still puts the fraction back
        return self.value

    def __enter__(self) -> GuardedLoad:
        if self.retry:
            raise OomMagicError("a with-block runs once, so it cannot retry: use `for attempt in "
                                "guard_load(retry=N): with attempt: ...` or guard_load(retry=N).run(fn)")
        self._claim()
        try:
            self._with = _AttemptContext(self, 1).__enter__()
        except BaseException:
            self._release_cap()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        __tracebackhide__ = True
        context = self._with
        assert context is not None, "__exit__ without __enter__"
        try:
            handled = context.__exit__(exc_type, exc, tb)
            del exc, tb
            if context.attempt is not None:
                self._end()  # after an OOM: raises the short exception unless raise_on_oom is False
            return handled  # an OOM printed and given back is not raised again at length
        finally:
            self._release_cap()  # also when Ctrl-C lands in the forensics

    def __iter__(self) -> Iterator[_AttemptContext]:
        self._claim()
        try:
            for number in range(1, self.retry + 2):
                context = _AttemptContext(self, number)
                yield context
                if context.attempt is None:
                    raise OomMagicError("each attempt must be used as a context manager: `with attempt: ...`")
                if not self._again(number):
                    break
            self._end()
        finally:
            self._release_cap()  # also when the loop is left early (break, an error, the generator closed)

    # ----------------------------------------------------------------- 1. plan
    def _plan(self) -> None:
        if self._ended:
            raise OomMagicError("a guard runs once: call guard_load(...) again for another load")
        self._begun = True
        notes: list[str] = []
        torch = loaded_torch()
        device = self._resolve_device(notes)
        cleaned: FreeReport | None = None
        if self.cleanup:
            try:
                cleaned = free_stale(device, shell=self.shell, namespace=self.namespace)
                self.printer.cleaned(cleaned)
            except Exception as error:  # the load still runs; the report says what did not
                notes.append(f"the cleanup before the load did not finish: {error}")
        allocator = allocator_setting(self.env, device, cuda_initialized(), self.expandable_segments)
        if self.env is os.environ:
            problem = apply_allocator_setting(torch, allocator)
            if problem:
                notes.append(problem)
        self.printer.allocator(allocator)
        preflight = self._preflight(notes)
        self.printer.preflight(preflight)
        if self.strict and preflight is not None and preflight.will_not_fit:
            raise GuardRefused(refusal_message(preflight))
        run = self._run = _Run(device, torch, cleaned, allocator, preflight, notes)
        try:
            run.room = RoomProbe(preflight)
            if device.startswith("cuda"):  # sized while a GPU load runs; on cpu or mps its child would compete for RAM
                run.room.start()
        except Exception as error:  # the room after the load is a figure, never a reason for the cell to fail
            notes.append(f"could not start sizing the KV cache's room: {error}")
        run.history = self._start_history(run)
        if run.history:  # --snapshot that records nothing says so before the cell, not only in the report
            self.printer.history(run.history)
        if self.target is not None:
            run.rehearsal = plan_rehearsal(self.target, device, preflight, torch, self._loads_to_cuda())
            if run.rehearsal.reason is not None:
                self.printer.rehearsal(run.rehearsal, before=True)
        run.ids_before = user_ids(self.namespace)

    def _resolve_device(self, notes: list[str]) -> str:
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
            notes.append(f"the load targets {hint}, which this machine does not have: measuring {fallback}")
            return fallback

    def _preflight(self, notes: list[str]) -> Preflight | None:
        source = self.preflight_source
        try:
            return source() if callable(source) else source
        except Exception as error:
            notes.append(f"the preflight could not check this cell: {error}")
            return None

    def _loads_to_cuda(self) -> bool:
        """Whether the load is known to go to CUDA: the user named a cuda device, or the cell's load targets one."""
        named = [d for d in (self.requested_device, self.device_hint) if d is not None]
        if isinstance(self.preflight_source, Preflight) and self.preflight_source.device is not None:
            named.append(self.preflight_source.device)
        return any(d.startswith("cuda") for d in named)

    def _start_history(self, run: _Run) -> str | None:
        """--snapshot: start recording the allocator's history; the reason when nothing is recorded."""
        if self.history_path is None:
            return None
        if not run.device.startswith("cuda"):
            return f"--snapshot records the CUDA allocator's history; {run.device} has none, so nothing was recorded"
        if run.torch is None:
            return "--snapshot needs torch imported before the cell (import it in an earlier cell); nothing was recorded"
        initialized = cuda_initialized()
        error = start_history(run.torch)
        if error:
            return error
        run.recording = True
        self.printer.recording(not initialized)
        return None

    def _state(self) -> _Run:
        if self._run is None:
            raise OomMagicError("this guard did not start (its plan step failed or refused): call guard_load(...) "
                                "again for another load")
        return self._run

    # ----------------------------------------------------------------- 2. attempt
    def _start_attempt(self, number: int) -> AttemptStart:
        run = self._state()
        run.torch = run.torch or loaded_torch()
        if number == 1:
            self._apply_cap()  # before the readings, so "free" is what the cell may still take under the cap
        start = start_attempt(run.torch, run.device, self._read().reading, self.shell, self.namespace,
                              with_variables=number == 1)
        if number == 1:
            run.first = start
        return start

    def _read(self) -> GuardedReading:
        run = self._state()
        # torch < 2.9 cannot read the fraction back: the cap --target set, while it is on
        cap = run.rehearsal.limit if run.cap_exit is not None and run.rehearsal is not None else None
        return read_guarded(run.device, run.torch, cap)

    def _apply_cap(self) -> None:
        run = self._state()
        rehearsal = run.rehearsal
        if rehearsal is None or rehearsal.reason is not None or rehearsal.cap is not None or run.torch is None:
            return
        run.rehearsal, run.cap_exit = apply_cap(rehearsal, run.torch, run.device)
        if run.cap_exit is None:
            self.printer.rehearsal(run.rehearsal)
            return
        hold_cap(self, self._release_cap)  # put back after the cell even if a Ctrl-C skips our finally

    def _release_cap(self) -> None:
        """Put the previous memory fraction back (once); a failed restore becomes a note, not an error."""
        run = self._run
        if run is None or run.cap_exit is None or run.rehearsal is None:
            return
        release, rehearsal = run.cap_exit, run.rehearsal
        try:
            release()
            run.rehearsal = replace(rehearsal, restored=True)
        except KeyboardInterrupt:  # a Ctrl-C landed in the restore itself: finish it, then go on
            run.cap_exit = None
            cap_released(self)
            run.rehearsal = force_restore(rehearsal, run.torch)
            raise
        except Exception as exc:
            run.rehearsal = restore_failed(rehearsal, exc)
        run.cap_exit = None
        cap_released(self)

    # ----------------------------------------------------------------- 3. settle: the one dispatch of an outcome
    def _settle(self, start: AttemptStart, number: int, exc: BaseException | None) -> Attempt | None:
        """How an attempt ended, for ``run``, ``with`` and the retry loop alike: ok, out of memory (recovered
        and diagnosed), or another error (the report is kept and None returned: the error goes on as usual)."""
        __tracebackhide__ = True
        run = self._state()
        if exc is None:
            seconds = start.seconds()
            run.succeeded = (start, seconds)
            attempt = Attempt(number, "ok", seconds)
        elif not _needs_forensics(exc):
            self._abort(start, exc)
            return None
        else:
            attempt = self._recover(start, exc, number)
        run.attempts.append(attempt)
        return attempt

    def _abort(self, start: AttemptStart, exc: BaseException) -> None:
        """A non-OOM error: stop recording, keep a report, and let the error go on as usual."""
        run = self._state()
        seconds = start.seconds()
        self._stop_history()
        run.attempts.append(Attempt(len(run.attempts) + 1, "error", seconds, _error_line(exc)))
        after = self._read().reading
        self._release_cap()
        self.report = self._report("error", start.reading, after, seconds,
                                   PeakReading(None, None, "none", "the cell raised an error"))

    def _recover(self, start: AttemptStart, exc: BaseException, number: int) -> Attempt:
        """Out of memory: print the traceback, give back, parse and diagnose; keep no reference to exc."""
        run = self._state()
        seconds = start.seconds()
        run.torch = run.torch or loaded_torch()
        text = self.format_traceback(exc)
        self.printer.traceback(text)
        error = _error_line(exc)
        run.error_type = type(exc)
        message = parse_oom_message(_message(exc)) or parse_oom_message(text)
        if run.device == "cpu":
            trim_c_heap()  # pages earlier cells freed go back first: what the give-back returns is its own
        failed = at_failure(run.torch, run.device, self._read().reading)
        history_file = self._dump_history()
        given = give_back(exc, start, failed, torch=run.torch, device=run.device, shell=self.shell,
                          namespace=self.namespace, read=self._read, notes=run.notes)
        del exc
        self.printer.gave_back(given.record, run.device)
        diagnosis = diagnose_failure(message, start, failed, given, device=run.device, preflight=run.preflight,
                                     cleanup=run.cleanup, env=self.env, headroom=self.headroom_spec,
                                     rehearsal=run.rehearsal)
        self.printer.diagnosed(diagnosis, run.capped_as)
        return Attempt(number, "oom", seconds, error, message, given.record, diagnosis, history_file)

    def _dump_history(self) -> str | None:
        run = self._state()
        if not run.recording or run.torch is None or self.history_path is None:
            return None
        try:
            written = dump_history(run.torch, self.history_path)
        except Exception as exc:
            run.history = f"could not write the allocator history: {exc}"
            return None
        run.history = written
        self.printer.history_written(written)
        return written

    def _stop_history(self) -> None:
        run = self._state()
        if run.recording and run.torch is not None:
            stop_history(run.torch)
            run.recording = False

    def _again(self, number: int) -> bool:
        """Whether to run the load again: after an OOM, while retries are left and the diagnosis says it fits."""
        attempt = self._state().attempts[-1]
        if attempt.outcome != "oom" or number > self.retry:
            return False
        verdict = attempt.diagnosis.retry if attempt.diagnosis else None
        self.printer.retry(verdict, number, self.retry + 1)
        return bool(verdict and verdict.can_fit)

    # ----------------------------------------------------------------- 4. report
    def _end(self) -> None:
        """Build the report; after an OOM raise the short exception (or only print, if so configured)."""
        __tracebackhide__ = True
        run = self._state()
        self._ended = True
        self._stop_history()
        last = run.attempts[-1]
        if last.outcome == "ok" and run.succeeded is not None:
            start, seconds = run.succeeded
            after = self._read().reading
            self._release_cap()
            self.report = self._ok_report(start, seconds, after)
            return
        after = last.give_back.after if last.give_back is not None else self._read().reading
        self._release_cap()
        first = run.first.reading if run.first is not None else after
        self.report = self._report("oom", first, after, last.seconds,
                                   PeakReading(None, None, "none", "the load ran out of memory"))
        if self.raise_on_oom:
            raise short_exception(run.error_type, self.report)

    def _ok_report(self, start: AttemptStart, seconds: float, after: DeviceReading) -> GuardReport:
        run = self._state()
        run.torch = run.torch or loaded_torch()
        peak = cell_peak(run.torch, run.device, start, after)  # first: the scan below allocates
        tensor_delta: int | None = None
        variables: tuple[VariableUse, ...] = ()
        try:
            storages, by_variable = scan_variables(run.torch, run.device, self.shell, self.namespace)
            if run.torch is not None:
                tensor_delta = sum(storages.values()) - sum(start.storages.values())
            before = run.first.variables if run.first is not None and run.first.variables is not None else {}
            variables = changed_variables(self.namespace, run.ids_before, before, by_variable)
        except Exception as error:  # the load succeeded: a failed measurement must not turn it into an error
            run.notes.append(f"could not measure the new variables: {error}")
        room: ContextRoom | None = None
        try:  # the loaded model's room for KV cache now (its sizing runs in a child, never torch here)
            room = run.room.room(after.free, run.device) if run.room is not None else None
        except Exception as error:
            run.notes.append(f"could not size the KV cache's room after the load: {error}")
        return self._report("ok", start.reading, after, seconds, peak, delta=delta(start.reading, after, run.device),
                            tensor_delta=tensor_delta, variables=variables, context_room=room)

    def _report(self, outcome: Outcome, before: DeviceReading, after: DeviceReading, seconds: float,
                peak: PeakReading, *, delta: int | None = None, tensor_delta: int | None = None,
                variables: tuple[VariableUse, ...] = (), context_room: ContextRoom | None = None) -> GuardReport:
        """The one place a GuardReport is made."""
        run = self._state()
        return GuardReport(device=run.device, outcome=outcome, attempts=tuple(run.attempts), cleanup=run.cleanup,
                           allocator=run.allocator, preflight=run.preflight, before=before, after=after,
                           seconds=seconds, delta=delta, tensor_delta=tensor_delta, peak=peak, variables=variables,
                           snapshot=run.history, notes=tuple(run.notes), label=self.label, rehearsal=run.rehearsal,
                           made_in=self.made_in, context_room=context_room)


class _AttemptContext:
    """One attempt of ``for attempt in guard_load(retry=N): with attempt: ...`` (and of a with-block)."""

    def __init__(self, guard: GuardedLoad, number: int) -> None:
        self.guard = guard
        self.number = number
        self.attempt: Attempt | None = None
        self._start: AttemptStart | None = None

    def __enter__(self) -> _AttemptContext:
        self._start = self.guard._start_attempt(self.number)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        __tracebackhide__ = True
        assert self._start is not None, "__exit__ without __enter__"
        self.attempt = self.guard._settle(self._start, self.number, exc)
        del exc, tb
        # An OOM is handled: the loop decides whether to retry or raise the short exception.
        return self.attempt is not None and self.attempt.outcome == "oom"


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

