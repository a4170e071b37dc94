"""What the guard tells the user as it runs: every printed line, and the short exception after an OOM.

The guard's steps hand their records to a ``GuardPrinter`` as they finish; it renders them
(``render/guard.py``) and prints, so the steps themselves never format or print. Outside
IPython the hints are reworded for a script (Python calls instead of magics and cells).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from ..render.diagnosis import diagnosis_text
from ..render.guard import (allocator_line, cleanup_line, give_back_line, preflight_text, refusal_line, rehearsal_line,
                           retry_line, script_wording, short_message)
from ..heap.roots import current_shell

if TYPE_CHECKING:
    from ..heap.cleanup import FreeReport
    from ..fit.preflight import Preflight
    from ..records.diagnosis import Diagnosis, RetryVerdict
    from ..records.guard import AllocatorSetting, GiveBack, GuardReport, Rehearsal
    from ..fit.targets import Target

__all__ = ["GuardPrinter", "refusal_message", "short_exception"]


class GuardPrinter:
    """Prints the guard's progress; ``quiet`` keeps only warnings and out-of-memory forensics."""

    def __init__(self, out: TextIO | None = None, quiet: bool = False, *, script: bool | None = None) -> None:
        self.out = out
        self.quiet = quiet
        self.script = current_shell() is None if script is None else script  # no magics or cells to point at

    def say(self, text: str, *, always: bool = False) -> None:
        """Print one message (the one place the guard prints)."""
        if text and self.script:
            text = script_wording(text)
        if text and (always or not self.quiet):
            print(text, file=self.out if self.out is not None else sys.stdout, flush=True)

    # ----------------------------------------------------------------- before the load
    def cleaned(self, report: FreeReport) -> None:
        self.say(cleanup_line(report))

    def allocator(self, setting: AllocatorSetting) -> None:
        self.say(allocator_line(setting))

    def preflight(self, preflight: Preflight | None) -> None:
        """The fit check, when it found a load call or has something to say; always when it warns."""
        if preflight is None or not (preflight.calls or preflight.notes):
            return
        worrying = bool(preflight.will_not_fit) or any(x.severity == "warning" for x in preflight.lints)
        self.say(preflight_text(preflight), always=worrying)

    def history(self, note: str) -> None:
        """--snapshot records nothing: said before the cell, not only in the report."""
        self.say(note, always=True)

    def recording(self, initialized_for_it: bool) -> None:
        self.say("recording CUDA allocator history for --snapshot"
                 + (" (CUDA initialized for it)" if initialized_for_it else ""))

    def rehearsal(self, rehearsal: Rehearsal, *, before: bool = False) -> None:
        """--target without a cap: expected on a CPU, a warning on a GPU."""
        self.say(rehearsal_line(rehearsal, before=before), always=rehearsal.reason != "not-cuda")

    # ----------------------------------------------------------------- after an out-of-memory error
    def traceback(self, text: str) -> None:
        self.say(text.rstrip("\n"), always=True)

    def history_written(self, path: str) -> None:
        self.say(f"allocator history written to {path}: open it at https://pytorch.org/memory_viz", always=True)

    def gave_back(self, give_back: GiveBack, device: str) -> None:
        self.say(give_back_line(give_back, device), always=True)

    def diagnosed(self, diagnosis: Diagnosis, capped_as: Target | None) -> None:
        self.say(diagnosis_text(diagnosis, capped_as), always=True)

    def retry(self, verdict: RetryVerdict | None, number: int, total: int) -> None:
        self.say(retry_line(verdict, number, total), always=True)


def refusal_message(preflight: Preflight) -> str:
    """--strict: why the cell was not run."""
    return refusal_line(preflight)


def short_exception(error_type: type[BaseException], report: GuardReport) -> BaseException:
    """The original's type with a one-line message; IPython shows it as that one line."""
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
