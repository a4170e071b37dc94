"""Where memory can be held from: user variables (and the user's own classes and modules), IPython's
output cache, stored exceptions.

This module knows IPython's naming conventions (``Out``, ``_N``, ``sys.last_*``) but never
imports IPython: the shell, when there is one, is passed in or found in ``sys.modules``.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from .user_code import user_code_roots

# IPython's own names: never user variables (docs/DESIGN.md, holders).
IPYTHON_NAMES = frozenset(
    {"_", "__", "___", "_i", "_ii", "_iii", "In", "Out", "_oh", "_ih", "_dh", "exit", "quit",
     "get_ipython", "__builtin__", "__builtins__", "__name__", "__doc__", "__package__",
     "__loader__", "__spec__", "_exit_code"}
)
_HISTORY_NAME = re.compile(r"^_(i?\d+)$")


def is_user_name(name: object) -> bool:
    """Say whether a namespace key is a user variable rather than one of IPython's names."""
    if not isinstance(name, str):
        return True
    return name not in IPYTHON_NAMES and _HISTORY_NAME.match(name) is None


@dataclass(frozen=True)
class Roots:
    """The starting points of the holder walk, by holder kind, as (display name, object)."""

    user: tuple[tuple[str, object], ...] = ()
    output_cache: tuple[tuple[str, object], ...] = ()
    traceback: tuple[tuple[str, object], ...] = ()
    # Objects that hold the namespaces themselves: never attribute through them.
    containers: tuple[object, ...] = field(default=(), repr=False)


def user_owned_unders(shell: Any | None, namespace: dict) -> frozenset[str]:
    """Which of ``_``, ``__``, ``___`` the user assigned: IPython writes them only while each still
    holds its displayhook's value, so one that differs is a variable of the user's."""
    hook = getattr(shell, "displayhook", None) if shell is not None else None
    if hook is None:
        return frozenset()
    return frozenset(u for u in ("_", "__", "___")
                     if u in namespace and dict.get(namespace, u) is not getattr(hook, u, None))


def current_shell() -> Any | None:
    """Return the running IPython shell if IPython is loaded and active, else None."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None) if ipython is not None else None
    try:
        return get() if get is not None else None
    except Exception:
        return None


def variable_path(name: object) -> str:
    """Show a namespace key as the user would type it (globals() keys need not be identifiers)."""
    if isinstance(name, str) and name.isidentifier():
        return name
    return f"globals()[{name!r}]"


def collect_roots(shell: Any | None = None, namespace: dict | None = None) -> Roots:
    """Gather the walk's roots from a shell (IPython) or a plain namespace (a script's globals)."""
    if shell is None and namespace is None:
        shell = current_shell()
    if namespace is None:
        namespace = getattr(shell, "user_ns", None)
        if namespace is None:
            namespace = sys.modules["__main__"].__dict__
    owned = user_owned_unders(shell, namespace)
    # Variables first: a tensor both reach is shown by its variable.
    user = tuple(
        (variable_path(k), v) for k, v in list(dict.items(namespace)) if is_user_name(k) or k in owned
    ) + tuple(user_code_roots(namespace))
    return Roots(
        user=user,
        output_cache=tuple(_output_cache_roots(shell, namespace, owned)),
        traceback=tuple(_traceback_roots(shell)),
        containers=(namespace,) + _shell_internals(shell),
    )


def _shell_internals(shell: Any | None) -> tuple[object, ...]:
    """The shell and the parts of it that hold outputs: a user's `ip = get_ipython()` must not
    make output-cache tensors look user-held by walking through them."""
    if shell is None:
        return ()
    parts = [shell]
    for name in ("user_ns_hidden", "displayhook", "history_manager", "display_pub", "events"):
        part = getattr(shell, name, None)
        if part is not None:
            parts.append(part)
    return tuple(parts)


def _output_cache_roots(shell: Any | None, namespace: dict,
                        owned: frozenset[str] = frozenset()) -> list[tuple[str, object]]:
    roots: list[tuple[str, object]] = []
    out = namespace.get("Out")
    if type(out) is dict:
        roots += [(f"Out[{n!r}]", v) for n, v in list(out.items())]
    for name in ("_", "__", "___"):
        if name in namespace and name not in owned:
            roots.append((name, namespace[name]))
    roots += [(k, v) for k, v in list(namespace.items())
              if isinstance(k, str) and _HISTORY_NAME.match(k) and not k.startswith("_i")]
    if shell is not None:
        hook = getattr(shell, "displayhook", None)
        for name in ("_", "__", "___"):
            value = getattr(hook, name, None)
            if value is not None:
                roots.append((name, value))
        last = getattr(shell, "last_execution_result", None)
        result = getattr(last, "result", None)
        if result is not None:
            roots.append(("_", result))
    return roots


def _traceback_roots(shell: Any | None) -> list[tuple[str, object]]:
    roots = [(f"sys.{name}", getattr(sys, name)) for name in ("last_value", "last_exc", "last_traceback")
             if getattr(sys, name, None) is not None]
    last = getattr(shell, "last_execution_result", None) if shell is not None else None
    for name in ("error_in_exec", "error_before_exec"):
        error = getattr(last, name, None)
        if error is not None:
            roots.append((f"last error ({type(error).__name__})", error))
    return roots
