"""Load and unload the extension: register exactly what unload removes.

Loading registers the magics (``OomMagics``), the after-cell hooks of its ``CellWatch``
(``pre_run_cell`` and ``post_run_cell``, the same callable objects each time), after each cell's
code (``post_execute``) ``targets.release_interrupted_caps``, and one input transformer
(``GuardedCellSyntax``: a %%guardload cell that does not parse fails as a plain cell). Loading again
is harmless; unloading unregisters exactly those callbacks and that transformer, freezes and closes every widget the
hooks displayed, and removes the magics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..fit.targets import release_interrupted_caps  # puts back a --target cap a Ctrl-C kept a guard from restoring

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

_REGISTRY_NAME = "OomMagics"


def load(shell: InteractiveShell) -> None:
    """Register the magics and the after-cell hooks once; loading again is harmless."""
    from .magics import OomMagics

    manager: Any = shell.magics_manager  # typed Optional in older IPython stubs; always set on a shell
    if _REGISTRY_NAME in manager.registry:
        return
    magics = OomMagics(shell)
    shell.register_magics(magics)
    transformers = getattr(shell, "input_transformers_cleanup", None)
    if transformers is not None and magics.syntax_check not in transformers:  # fails as a plain cell does
        transformers.append(magics.syntax_check)
    if release_interrupted_caps not in shell.events.callbacks["post_execute"]:
        shell.events.register("post_execute", release_interrupted_caps)
    watch = getattr(magics, "cell_watch", None)
    if watch is None:
        return
    for event, callback in watch.callbacks().items():
        if callback not in shell.events.callbacks[event]:
            shell.events.register(event, callback)
    watch.activate()


def unload(shell: InteractiveShell) -> None:
    """Remove the hooks, widgets and magics this extension registered, and nothing else."""
    manager: Any = shell.magics_manager  # typed Optional in older IPython stubs; always set on a shell
    magics = manager.registry.pop(_REGISTRY_NAME, None)
    if magics is None:
        return
    check = getattr(magics, "syntax_check", None)
    transformers = getattr(shell, "input_transformers_cleanup", [])
    while check is not None and check in transformers:
        transformers.remove(check)
    while release_interrupted_caps in shell.events.callbacks["post_execute"]:
        shell.events.unregister("post_execute", release_interrupted_caps)
    watch = getattr(magics, "cell_watch", None)
    if watch is not None:
        for event, callback in watch.callbacks().items():
            while callback in shell.events.callbacks[event]:
                shell.events.unregister(event, callback)
        watch.close()
    configurables = getattr(shell, "configurables", [])
    while magics in configurables:  # Magics.__init__ appended it; a kept reference would leak it per reload
        configurables.remove(magics)
    for kind, table in magics.magics.items():
        registered = manager.magics.get(kind, {})
        for name in table:
            registered.pop(name, None)


def loaded_magics(shell: InteractiveShell | None = None) -> Any:
    """The loaded OomMagics of ``shell`` (default: the running shell), or None."""
    if shell is None:
        from ..heap.roots import current_shell

        shell = current_shell()
    manager = getattr(shell, "magics_manager", None)
    return manager.registry.get(_REGISTRY_NAME) if manager is not None else None
