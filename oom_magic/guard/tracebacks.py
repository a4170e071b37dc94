"""An error's traceback as the user's code raised it: the package's own frames left out."""
from __future__ import annotations

import traceback
from types import TracebackType

__all__ = ["format_user_traceback", "user_traceback"]

_OWN = "oom_magic."


def user_traceback(exc: BaseException) -> TracebackType | None:
    """The exception's traceback from its first frame outside ``oom_magic`` (the guard's own come first)."""
    tb = exc.__traceback__
    while tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_OWN):
        tb = tb.tb_next
    return tb


def format_user_traceback(exc: BaseException) -> str:
    """The error as Python prints it, from the user's first frame."""
    return "".join(traceback.format_exception(type(exc), exc, user_traceback(exc)))
