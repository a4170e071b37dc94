"""The user's own classes and modules, and what their attributes hold: ``Cfg.table``, ``mymod.CACHE``.

A user's own class is one defined in ``__main__`` (a notebook cell) or in a user module; a user
module is one imported from the notebook's folder (the working directory), not from
site-packages, the standard library or oom-magic itself. Their attributes are roots of kind
user, named as the user would type them. Everything is read at C level (a class's own dict
through ``type.__dict__``, a module's globals through ``ModuleType.__dict__``): no user
``__getattr__``, ``__eq__``, ``__hash__`` or ``__repr__`` runs.
"""
from __future__ import annotations

import os
import re
import sys
import types
from typing import Any

from .reads import module_dict, mro_has, type_dict

_OWN_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Module names (and their submodules) never counted as the user's, even inside the notebook's folder:
# a test harness's own modules, which hold the shell they drive (this project's suite sets its own).
HARNESS_PREFIXES: tuple[str, ...] = ()
# name -> (id of the module object, whether it is the user's, the folder it was judged against):
# a module's file never changes, so each is judged once per folder.
_VERDICTS: dict[str, tuple[int, bool, str]] = {}


def _is_dunder(name: object) -> bool:
    return type(name) is not str or (name.startswith("__") and name.endswith("__"))


# A folder of installed packages, as ``_is_user_file`` tells it from the path's parts; and what abspath
# would change in an absolute path (an empty, '.' or '..' part).
_SEP = re.escape(os.sep)
_INSTALLED = re.compile(rf"{_SEP}(?:site|dist)-packages{_SEP}")
_NOT_NORMAL = re.compile(rf"{_SEP}{_SEP}|{_SEP}\.\.?(?:{_SEP}|$)")


def _library_dirs() -> tuple[str, ...]:
    """Where the interpreter's own and installed modules live (a venv inside the folder included)."""
    prefixes = {os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return tuple(prefixes)


def user_module_names(folder: str | None = None) -> dict[int, str]:
    """id(module) -> its name, for every imported module whose file lies in ``folder`` (the cwd)."""
    try:
        base = os.path.abspath(folder if folder is not None else os.getcwd()) + os.sep
    except OSError:  # the working directory was deleted
        return {}
    libraries = _library_dirs()
    found: dict[int, str] = {}
    verdicts = _VERDICTS
    for name, module in list(dict.items(sys.modules)):
        known = verdicts.get(name) if type(name) is str else None
        if known is None or known[0] != id(module) or known[2] != base:
            if type(name) is not str or name == "__main__" or not mro_has(type(module), types.ModuleType):
                continue
            harness = any(name == p or name.startswith(p + ".") for p in HARNESS_PREFIXES)
            known = verdicts[name] = (id(module), not harness and _is_user_file(module, base, libraries), base)
        if known[1]:
            found[id(module)] = name
    return found


def _is_user_file(module: Any, base: str, libraries: tuple[str, ...]) -> bool:
    try:
        path = dict.get(module_dict(module), "__file__")
    except Exception:
        return False
    if type(path) is not str or not path:
        return False
    if os.path.isabs(path) and not _NOT_NORMAL.search(path) and (  # already normal: no abspath for each
            not path.startswith(base) or _INSTALLED.search(path)):  # of a thousand library modules
        return False
    path = os.path.abspath(path)
    if not path.startswith(base) or path.startswith(_OWN_PACKAGE):
        return False
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    # The interpreter's folders, unless the notebook's folder lies inside one (then site-packages decides).
    return not any(path.startswith(lib) and not base.startswith(lib) for lib in libraries)


def _class_module(cls: type) -> object:
    try:
        return type_dict(cls).get("__module__")
    except Exception:
        return None


def _class_attributes(prefix: str, cls: type) -> list[tuple[str, object]]:
    """A class's own attributes (not inherited, no dunders), named ``prefix.name``."""
    try:
        items = list(type_dict(cls).items())
    except Exception:
        return []
    return [(f"{prefix}.{name}", value) for name, value in items
            if not _is_dunder(name) and name.isidentifier() and not mro_has(type(value), type)]


def user_code_roots(namespace: dict, folder: str | None = None) -> list[tuple[str, object]]:
    """The attributes of the user's own classes and modules, as (name the user types, object).

    Classes come from the namespace (``Cfg.table``) and from user modules (``mymod.Cfg.table``);
    a user module's globals are named by the variable it was imported as (``mymod.CACHE``), or by
    its module name where no variable names it.
    """
    modules = user_module_names(folder)
    own = set(modules.values()) | {"__main__"}
    roots: list[tuple[str, object]] = []
    shown: dict[int, str] = {}  # id(module) -> the name a user reaches it by
    for name, value in list(dict.items(namespace)):
        if type(name) is not str or not name.isidentifier():
            continue
        if id(value) in modules and mro_has(type(value), types.ModuleType):
            shown.setdefault(id(value), name)
        elif mro_has(type(value), type) and _class_module(value) in own:
            roots += _class_attributes(name, value)
    by_id = {id(m): m for m in list(dict.values(sys.modules)) if id(m) in modules}
    for module_id, module_name in modules.items():
        module = by_id.get(module_id)
        if module is None:
            continue
        prefix = shown.get(module_id, module_name)
        try:
            globals_ = module_dict(module)
        except Exception:
            continue
        for name, value in list(dict.items(globals_)):
            if _is_dunder(name) or not name.isidentifier() or mro_has(type(value), types.ModuleType):
                continue
            if mro_has(type(value), type):
                if _class_module(value) == module_name:
                    roots += _class_attributes(f"{prefix}.{name}", value)
                continue
            roots.append((f"{prefix}.{name}", value))
    return roots
