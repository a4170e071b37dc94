"""Load and unload the extension: register exactly what unload removes."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

_REGISTRY_NAME = "OomMagics"


def load(shell: InteractiveShell) -> None:
    """Register the magics once; loading again is harmless."""
    from .magics import OomMagics

    if _REGISTRY_NAME in shell.magics_manager.registry:
        return
    shell.register_magics(OomMagics(shell))


def unload(shell: InteractiveShell) -> None:
    """Remove the magics this extension registered, and nothing else."""
    magics = shell.magics_manager.registry.pop(_REGISTRY_NAME, None)
    if magics is None:
        return
    for kind, table in magics.magics.items():
        registered = shell.magics_manager.magics.get(kind, {})
        for name in table:
            registered.pop(name, None)
