"""oom-magic: fit checks, OOM forensics and safe cleanup for loading models in IPython/Jupyter.

``%load_ext oom_magic`` registers the magics; the same logic works from a plain script through
the functions below. Importing this package imports neither torch nor IPython.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> module that defines it; loaded on first use so `import oom_magic` stays free.
_EXPORTS = {
    "snapshot": "snapshot", "Snapshot": "snapshot",
    "free_stale": "cleanup", "FreeReport": "cleanup",
    "read_device": "devices", "DeviceReading": "devices", "available_devices": "devices",
    "parse_oom_message": "oom", "OOMMessage": "oom", "is_out_of_memory": "oom",
    "estimate_checkpoint": "estimate", "CheckpointEstimate": "estimate",
    "diagnose": "diagnose", "Diagnosis": "diagnose",
    "guard_load": "guard",
    "OomMagicError": "errors",
}
__all__ = sorted(_EXPORTS) + ["load_ipython_extension", "unload_ipython_extension"]

if TYPE_CHECKING:
    from .cleanup import FreeReport, free_stale
    from .devices import DeviceReading, available_devices, read_device
    from .errors import OomMagicError
    from .snapshot import Snapshot, snapshot


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oom_magic' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)


def load_ipython_extension(ipython: Any) -> None:
    """Register the oom-magic magics and hooks (``%load_ext oom_magic``)."""
    from ._extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Unregister exactly what loading registered (``%unload_ext oom_magic``)."""
    from ._extension import unload

    unload(ipython)
