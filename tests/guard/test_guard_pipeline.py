"""The guard's seams: one dispatch of an attempt's outcome for run / with / the retry loop, one printer,
one frame clearing (release.py) and one traceback trimming (tracebacks.py). No torch needed."""
from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from oom_magic import guard_load
from oom_magic.guard.pipeline import GuardedLoad
from oom_magic.guard.printer import GuardPrinter
from oom_magic.records.guard import GuardReport
from oom_magic.heap.release import clear_frames
from oom_magic.guard.tracebacks import user_traceback


def _guard(**kwargs: Any):
    return guard_load(device="cpu", cleanup=False, expandable_segments=False, namespace={}, quiet=True, **kwargs)


def _settled(drive: Any) -> GuardReport:
    """The report after ``drive(guard)``; a ValueError from the load goes on, as it does without the guard."""
    guard = _guard(raise_on_oom=False)
    try:
        drive(guard)
    except ValueError:
        pass
    assert guard.report is not None
    return guard.report


def _with(error: BaseException | None) -> GuardReport:
    def drive(guard: Any) -> None:
        with guard:
            if error is not None:
                raise error

    return _settled(drive)


def _loop(error: BaseException | None) -> GuardReport:
    def drive(guard: Any) -> None:
        for attempt in guard:
            with attempt:
                if error is not None:
                    raise error

    return _settled(drive)


def _run(error: BaseException | None) -> GuardReport:
    def load() -> None:
        if error is not None:
            raise error

    return _settled(lambda guard: guard.run(load))


@pytest.mark.parametrize("way", [_with, _loop, _run], ids=["with", "loop", "run"])
@pytest.mark.parametrize("error, outcome", [(None, "ok"), (ValueError("bad input"), "error"),
                                            (MemoryError("could not allocate 2 GiB"), "oom")],
                         ids=["ok", "error", "oom"])
def test_every_way_in_settles_an_outcome_the_same_way(way: Any, error: BaseException | None, outcome: str) -> None:
    report = way(error)
    assert report.outcome == outcome and [a.outcome for a in report.attempts] == [outcome]
    assert report.attempts[0].number == 1 and report.device == "cpu"
    if outcome == "oom":
        assert report.give_back is not None and report.diagnosis is not None
        assert report.peak.note == "the load ran out of memory"
    elif outcome == "error":
        assert report.last.error == "ValueError: bad input" and report.peak.note == "the cell raised an error"


def test_the_printer_is_the_one_place_the_guard_prints(capsys) -> None:
    out = io.StringIO()
    printer = GuardPrinter(out)
    with GuardedLoad("cpu", cleanup=False, namespace={}, raise_on_oom=False, printer=printer):
        raise MemoryError("could not allocate 2 GiB")
    printed = out.getvalue()
    assert "MemoryError: could not allocate 2 GiB" in printed and "give-back:" in printed
    assert "diagnosis (" in printed and capsys.readouterr().out == ""


def test_a_quiet_printer_keeps_only_what_is_always_said() -> None:
    out = io.StringIO()
    GuardPrinter(out, quiet=True).say("progress")
    GuardPrinter(out, quiet=True).say("warning", always=True)
    assert out.getvalue() == "warning\n"


def _nested() -> None:
    big = bytearray(10)  # noqa: F841 (a local for the frame to hold)
    raise RuntimeError("inner")


def test_clear_frames_follows_chains_and_counts_the_frames() -> None:
    try:
        try:
            _nested()
        except RuntimeError as inner:
            raise ValueError("outer") from inner
    except ValueError as exc:
        error = exc
    cleared = clear_frames(error)
    assert cleared >= 1  # _nested's frame; the test's own frame is still running
    inner_tb = error.__cause__.__traceback__
    while inner_tb.tb_next is not None:
        inner_tb = inner_tb.tb_next
    assert "big" not in inner_tb.tb_frame.f_locals


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11+")
def test_clear_frames_reaches_into_exception_groups() -> None:
    try:
        _nested()
    except RuntimeError as exc:
        member = exc
    group = BaseExceptionGroup("many", [member])  # noqa: F821 (3.11+)
    assert clear_frames(group) >= 1
    tb = member.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert "big" not in tb.tb_frame.f_locals


def test_clear_frames_leaves_frames_a_user_variable_holds() -> None:
    try:
        _nested()
    except RuntimeError as exc:
        error = exc
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    kept = tb.tb_frame
    clear_frames(error, keep=frozenset({id(kept)}))
    assert "big" in kept.f_locals


def test_user_traceback_starts_at_the_first_frame_outside_the_package() -> None:
    seen: list[str] = []

    def first_frame(exc: BaseException) -> str:
        tb = user_traceback(exc)
        seen.append(tb.tb_frame.f_code.co_name if tb is not None else "")
        return ""

    def load() -> None:
        raise MemoryError("mine")

    guard = GuardedLoad("cpu", cleanup=False, expandable_segments=False, namespace={}, quiet=True,
                        raise_on_oom=False, format_traceback=first_frame)
    guard.run(load)
    assert seen == ["load"]  # the guard's own run() frame came first
