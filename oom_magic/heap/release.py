"""Let go of what an error or a cache keeps alive: frames of tracebacks, ``sys.last_*``, PyTorch's cache.

Used by the guard's give-back after an out-of-memory error and by ``%freeall`` on stale
tracebacks: one way to clear frames (exception chains and groups included), one way to drop the
stored exception, one way to hand cached device memory back to the driver.
"""
from __future__ import annotations

import builtins
import sys
from types import TracebackType
from typing import Any

from ..common._torch import cuda_initialized
from .roots import is_user_name

__all__ = ["clear_frames", "drop_last_exception", "empty_cache", "forget_last_exception", "trim_c_heap"]

_CO_OPTIMIZED = 0x1  # inspect.CO_OPTIMIZED: a function frame (its locals are its own)
# Python 3.10 has no exception groups: nothing there is one.
_EXCEPTION_GROUP: type | None = getattr(builtins, "BaseExceptionGroup", None)
_LAST = ("last_type", "last_value", "last_traceback", "last_exc")


def clear_frames(obj: object, keep: frozenset[int] = frozenset()) -> int:
    """Clear the locals of every finished frame of an exception's (or a traceback's) whole chain.

    Follows ``__cause__``, ``__context__`` and the members of exception groups. Running frames
    and those a user variable reaches (``fr = err.__traceback__.tb_frame``: their ids in ``keep``)
    are skipped. Returns how many frames were cleared.
    """
    cleared = 0
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, BaseException):
            stack += [item.__traceback__, item.__cause__, item.__context__]
            if _EXCEPTION_GROUP is not None and isinstance(item, _EXCEPTION_GROUP):
                stack += list(item.exceptions)  # type: ignore[attr-defined]  # 3.11+: BaseExceptionGroup
            continue
        tb = item if isinstance(item, TracebackType) else None
        while tb is not None:
            if id(tb) not in keep and id(tb.tb_frame) not in keep and _clear_frame(tb.tb_frame):
                cleared += 1
            tb = tb.tb_next
    return cleared


def _clear_frame(frame: Any) -> bool:
    """Drop a finished frame's locals, including the dict snapshot ``f_locals`` may have cached."""
    try:
        frame.clear()
    except RuntimeError:  # a frame still running: the guard's own, or the with-block's owner
        return False
    if frame.f_code.co_flags & _CO_OPTIMIZED:
        # Python <= 3.12: clear() leaves the f_locals snapshot a traceback printer made (IPython
        # reads it for __tracebackhide__); reading it again syncs it to the now empty locals.
        # Function frames only: a module frame's f_locals is a namespace.
        try:
            frame.f_locals
        except Exception:
            pass
    return True


def forget_last_exception() -> None:
    """Delete ``sys.last_*``, where Python and IPython keep the last uncaught exception."""
    for name in _LAST:
        if hasattr(sys, name):
            delattr(sys, name)


def drop_last_exception(namespace: dict) -> bool:
    """Clear and delete ``sys.last_*`` (the stored exception and its frames) unless a user variable holds it."""
    stored = [s for s in (getattr(sys, name, None) for name in ("last_value", "last_exc", "last_traceback"))
              if s is not None]
    if not stored:
        return False
    held = {id(v) for k, v in list(dict.items(namespace)) if is_user_name(k)}
    if any(id(s) in held for s in stored):
        return False
    for value in stored:
        if isinstance(value, BaseException):
            clear_frames(value)
    forget_last_exception()
    return True


def empty_cache(torch: Any, device: str) -> None:
    """Hand cached, unused memory back: PyTorch's to the driver (CUDA once initialized, MPS), the C heap's to the OS (cpu)."""
    if device == "cpu":
        trim_c_heap()
        return
    if torch is None:
        return
    try:
        if device.startswith("cuda") and cuda_initialized():
            torch.cuda.empty_cache()
        elif device == "mps":
            torch.mps.empty_cache()
    except Exception:
        pass


_malloc_trim: Any = None  # looked up once: glibc's malloc_trim, or False where the C library has none


def trim_c_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``); False where there is no glibc.

    A tensor freed from a chunk glibc had already reused (a heap that earlier cells fragmented)
    stays resident until trimmed: without this, freeing a failed cpu load can leave the process's
    resident memory where it was.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    try:
        _malloc_trim(0)
    except Exception:
        return False
    return True

