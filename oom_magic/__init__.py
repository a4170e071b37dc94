"""oom-magic: fit checks, OOM forensics and safe cleanup for loading models in IPython/Jupyter.

``%load_ext oom_magic`` registers the magics; the same logic works from a plain script through
the functions below. Importing this package imports neither torch nor IPython.
"""
from __future__ import annotations

from typing import Any

# Eager and cheap (none of these imports torch or IPython); bound here so that a module named
# like its function (snapshot, diagnose) never shadows the function on the package.
from .heap.cleanup import FreeReport, free_stale
from .device.reading import DeviceReading, available_devices, read_device
from .checkpoints.files import resolve_checkpoint
from .common.errors import OomMagicError
from .checkpoints.estimate import CheckpointEstimate, estimate_checkpoint
from .guard.oom import OOMMessage, is_out_of_memory, parse_oom_message
from .heap.snapshot import Snapshot, snapshot
from .guard.diagnose import Diagnosis, diagnose
from .guard.pipeline import GuardReport, guard_load
from .fit.preflight import Preflight, preflight_check
from .fit.check import fit_check
from . import render  # noqa: F401  (last: registers every record's renderer)

__version__ = "0.1.0"

__all__ = [
    "Diagnosis", "GuardReport", "Preflight", "diagnose", "fit_check", "guard_load", "preflight_check",
    "CheckpointEstimate", "DeviceReading", "FreeReport", "OOMMessage", "OomMagicError", "Snapshot",
    "available_devices", "estimate_checkpoint", "free_stale", "is_out_of_memory", "parse_oom_message", "read_device",
    "resolve_checkpoint", "snapshot", "load_ipython_extension", "unload_ipython_extension", "latest_widget",
]


def load_ipython_extension(ipython: Any) -> None:
    """Register the oom-magic magics and hooks (``%load_ext oom_magic``)."""
    from .notebook.extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Unregister exactly what loading registered (``%unload_ext oom_magic``)."""
    from .notebook.extension import unload

    unload(ipython)


def latest_widget(ipython: Any = None) -> Any:
    """The newest live memory widget under a cell (the pinned one while pinned), or None.

    ``latest_widget().button.click()`` does what a click does; ``.report`` holds its figures.
    """
    from .notebook.extension import loaded_magics

    magics = loaded_magics(ipython)
    return magics.cell_watch.latest if magics is not None else None
