"""The user-held paths of the last scans, kept between scans as steps (strings and ints, no
references) with the holder record they named, and grouped for re-reading many at once.

A steady scan re-reads every remembered path and trusts one only if it still reaches a tensor of
that same storage (``holders``). Paths of one form from one variable (``tokens[i].vector`` for
100,000 ``i``) are re-read together, a step at a time over all of them (``resolve_columns``): the
groups are built once after paths change, and a scan selects each group's storages still alive in
one C-level pass, with no per-path lookup.
"""
from __future__ import annotations

import operator
from itertools import compress
from typing import Any, NamedTuple
from collections.abc import Iterable

from .reads import MISSING, mro_has
from .resolve import column_form, resolve, resolve_columns
from .roots import Roots
from .storages import LiveTensors


def _variables(roots: Roots) -> dict[str, Any]:
    """The user's variables by name (the first of a name wins, as the walk's roots do)."""
    variables: dict[str, Any] = {}
    for name, obj in roots.user:
        variables.setdefault(name, obj)
    return variables


class Remembered(NamedTuple):
    variable: str
    steps: tuple
    holder: Any  # holders.Holder: the same record each scan, not made anew


class Column(NamedTuple):
    """Remembered paths of one form from one variable, in parallel lists (``arguments``: a list per
    index or key of the form, each as long as ``keys``)."""

    keys: list[int]
    arguments: list[list[Any]]
    holders: list[Any]


class RememberedPaths:
    """storage key -> its remembered path, and the paths grouped into columns (rebuilt when they change)."""

    def __init__(self, limit: int) -> None:
        self._paths: dict[int, Remembered] = {}
        self._limit = limit
        self._columns: dict[tuple[str, tuple], Column] | None = None
        self._singles: list[int] = []

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key: int) -> bool:
        return key in self._paths

    def get(self, key: int) -> Remembered | None:
        return self._paths.get(key)

    def remember(self, key: int, variable: str, steps: tuple, holder: Any) -> None:
        if len(self._paths) > self._limit:
            self.clear()
        known = Remembered(variable, steps, holder)
        if key in self._paths:
            self._columns = None  # a path changed: the columns are rebuilt when next asked for
        elif self._columns is not None:
            self._add(self._columns, self._singles, key, known)  # a new path joins its column
        self._paths[key] = known

    def clear(self) -> None:
        self._paths.clear()
        self._columns = None
        self._singles = []

    def columns(self) -> tuple[dict[tuple[str, tuple], Column], list[int]]:
        """((variable, operations) -> its column, the keys of paths re-read one by one)."""
        if self._columns is None:
            columns: dict[tuple[str, tuple], Column] = {}
            singles: list[int] = []
            for key, known in self._paths.items():
                self._add(columns, singles, key, known)
            self._columns, self._singles = columns, singles
        return self._columns, self._singles

    @staticmethod
    def _add(columns: dict[tuple[str, tuple], Column], singles: list[int], key: int, known: Remembered) -> None:
        form = column_form(known.steps)
        if form is None:
            singles.append(key)
            return
        ops, arguments = form
        column = columns.get((known.variable, ops))
        if column is None:
            column = columns[(known.variable, ops)] = Column([], [[] for _ in arguments], [])
        column.keys.append(key)
        for values, argument in zip(column.arguments, arguments):
            values.append(argument)
        column.holders.append(known.holder)

    def holders_now(self, live: LiveTensors, roots: Roots) -> dict[int, Any]:
        """The holders of the storages of ``live`` whose remembered path still reaches a tensor of that
        storage now (paths of one column re-read together, the others one by one)."""
        if not self._paths or not roots.user:
            return {}
        variables = _variables(roots)
        holders: dict[int, Any] = {}
        storage_of = live.storage_of
        alive = live.sizes.__contains__
        listed: dict[int, Any] = {}  # sets and arrays listed once for every path through them
        if len(live.sizes) * 4 < len(self._paths):  # a few storages (the quick view's): each path alone
            columns: dict[tuple[str, tuple], Column] = {}
            one_by_one = list(filter(self.__contains__, live.sizes))
        else:
            columns, singles = self.columns()
            one_by_one = list(filter(alive, singles))
        try:
            for (name, ops), column in columns.items():
                if name not in variables or len(column.keys) == 1:
                    one_by_one += filter(alive, column.keys)
                    continue
                here = list(map(alive, column.keys))
                keys, arguments, found_holders = column
                if not all(here):
                    keys, found_holders = list(compress(keys, here)), list(compress(found_holders, here))
                    arguments = [list(compress(values, here)) for values in arguments]
                if not keys:
                    continue
                found = resolve_columns(variables[name], ops, arguments)
                if found is None:
                    one_by_one += keys
                    continue
                reached = list(map(operator.eq, map(storage_of.get, map(id, found)), keys))
                del found
                holders.update(zip(compress(keys, reached), compress(found_holders, reached)))
            for key in one_by_one:
                known = self.get(key)
                if known is None or known.variable not in variables:
                    continue
                try:
                    obj = resolve(variables[known.variable], known.steps, listed, variables)
                except Exception:
                    continue
                if obj is not MISSING and storage_of.get(id(obj)) == key:
                    holders[key] = known.holder
                del obj
        finally:
            listed.clear()
            variables.clear()
        return holders

    def recheck(self, keys: Iterable[int], roots: Roots, torch: Any) -> dict[int, Any] | None:
        """Holders for these storages by their remembered paths alone, each re-read now and checked to
        reach a tensor of that same storage; None unless every one does."""
        variables = _variables(roots)
        base = getattr(getattr(torch, "_C", None), "TensorBase", None)
        address = getattr(getattr(torch, "_C", None), "_storage_address", None)
        disable = getattr(getattr(torch, "_C", None), "DisableTorchFunctionSubclass", None)
        if base is None or address is None or disable is None:
            return None
        holders: dict[int, Any] = {}
        listed: dict[Any, Any] = {}
        try:
            with disable():
                for key in keys:
                    known = self.get(key)
                    if known is None or known.variable not in variables:
                        return None
                    try:
                        obj = resolve(variables[known.variable], known.steps, listed, variables)
                        if obj is MISSING or not mro_has(type(obj), base) or address(obj) != key:
                            return None
                    except Exception:
                        return None
                    finally:
                        obj = None
                    holders[key] = known.holder
        finally:
            listed.clear()
            variables.clear()
        return holders
