"""Re-read a remembered path: follow its steps from the variable with C-level reads, running no code."""
from __future__ import annotations

import operator
import sys
import types
from itertools import repeat
from typing import Any

from .path_text import Step
from .reads import (MISSING, array_items, attribute_column, attribute_getter, attribute_reader, deque_type, function_dict,
                    is_plain_key, mro_has, read_attribute)

def resolve(obj: Any, steps: tuple[Step, ...], items: dict[Any, Any] | None = None,
            variables: dict[str, Any] | None = None) -> Any:
    """Follow remembered steps from ``obj`` with C-level reads; MISSING where a step no longer holds.

    Only steps that can be re-read without running code are followed (plain dict keys, indexes,
    instance attributes and slots, closure cells, set members and object-array items by position,
    a DataFrame column's item through pandas' own attributes, library code);
    any other step fails, so the caller walks. ``items``: id(container) -> (container, its items),
    shared by the paths checked in one scan (a set is listed once, not once per path); the caller
    clears it. ``variables``: name -> object, for a dict value keyed by an object that has a path of
    its own (``("keyat", variable, steps)``: the key is found by identity, never hashed).
    """
    pending_attr = False
    for step in steps:
        tag = step[0]
        if tag == "":
            if len(step) > 1 and step[1] == "__closure__":
                if type(obj) is not types.FunctionType or obj.__closure__ is None:
                    return MISSING
                obj = obj.__closure__
                continue
            if len(step) > 1:
                return MISSING
            if type(obj) is types.FunctionType:
                obj = function_dict(obj) or {}
                continue
            pending_attr = True
            continue
        if tag == "key":
            if pending_attr:
                pending_attr = False
                obj = _read_attribute(obj, step[1], items)
            elif type(obj) is dict or mro_has(type(obj), dict) and is_plain_key(step[1]):
                obj = dict.get(obj, step[1], MISSING)
            else:
                return MISSING
        elif tag == "attr":
            obj = _read_attribute(obj, step[1], items)
        elif tag == "index":
            cls = type(obj)
            try:
                if cls is list or cls is tuple:
                    obj = obj[step[1]]
                elif mro_has(cls, list):
                    obj = list.__getitem__(obj, step[1])
                elif mro_has(cls, tuple):
                    obj = tuple.__getitem__(obj, step[1])
                elif mro_has(cls, deque_type()):
                    listed = _listed(obj, "index", items)
                    if listed is None or not 0 <= step[1] < len(listed):
                        return MISSING
                    obj = listed[step[1]]
                else:
                    return MISSING
            except IndexError:
                return MISSING
        elif tag == "keyat":
            if variables is None or step[1] not in variables or not mro_has(type(obj), dict):
                return MISSING
            key = resolve(variables[step[1]], step[2], items, None)
            if key is MISSING:
                return MISSING
            by_key = _values_by_key_identity(obj, items)
            obj = by_key.get(id(key), MISSING)
            if obj is not MISSING and obj[0] is not key:
                return MISSING
            obj = obj[1] if obj is not MISSING else MISSING
        elif tag == "run":
            obj = _follow_run(obj, step[1], step[2], items)
        elif tag == "grad":
            obj = _tensor_grad(obj)
        elif tag == "pandas":
            obj = _frame_item(obj, step[1], step[2])
        elif tag == "member" or tag == "flat":
            listed = _listed(obj, tag, items)
            if listed is None or not 0 <= step[1] < len(listed):
                return MISSING
            obj = listed[step[1]]
        elif tag == "closure":
            if not mro_has(type(obj), tuple):
                return MISSING
            try:
                obj = tuple.__getitem__(obj, step[1])
            except IndexError:
                return MISSING
        elif tag == "cell":
            if type(obj) is not types.CellType:
                return MISSING
            try:
                obj = obj.cell_contents
            except ValueError:
                return MISSING
        else:
            return MISSING
        if obj is MISSING:
            return MISSING
    return MISSING if pending_attr else obj


def column_form(steps: tuple[Step, ...]) -> tuple[tuple[tuple[str, Any], ...], tuple[Any, ...]] | None:
    """The steps as (operations, arguments) where every one is an index, a plain key or an attribute
    (``resolve_columns`` re-reads many such paths at once); None for a path with any other step.
    An operation is ("index", None), ("key", None) or ("attr", name); the arguments are the indexes
    and keys, in order."""
    ops: list[tuple[str, Any]] = []
    args: list[Any] = []
    pending_attr = False
    for step in steps:
        tag = step[0]
        if tag == "" and len(step) == 1 and not pending_attr:
            pending_attr = True  # an instance's __dict__: its next key is an attribute
        elif tag == "key" and pending_attr and type(step[1]) is str:
            ops.append(("attr", step[1]))
            pending_attr = False
        elif tag == "attr" and type(step[1]) is str and not pending_attr:
            ops.append(("attr", step[1]))
        elif tag == "index" and type(step[1]) is int and not pending_attr:
            ops.append(("index", None))
            args.append(step[1])
        elif tag == "key" and is_plain_key(step[1]) and not pending_attr:
            ops.append(("key", None))
            args.append(step[1])
        else:
            return None
    return (tuple(ops), tuple(args)) if not pending_attr else None


def resolve_columns(root: Any, ops: tuple[tuple[str, Any], ...], arguments: list[list[Any]]) -> list[Any] | None:
    """``resolve`` for many paths of one ``column_form`` from one variable, a step at a time over all
    of them in C-level passes (100,000 paths ``tokens[i].vector``: a pass per step, not a call per
    path). ``arguments``: a column per index or key of the form (each as long as the paths). None
    where any path fails a step or a step meets mixed types (the caller resolves those paths one by one)."""
    paths = len(arguments[0]) if arguments else 0
    if not paths:
        return None
    objs = [root] * paths
    columns = iter(arguments)
    try:
        for op, name in ops:
            cls = type(objs[0])
            if not all(map(operator.is_, map(type, objs), repeat(cls))):  # by identity: no type is hashed
                return None
            if op == "index":
                if cls is not list and cls is not tuple:
                    return None
                objs = list(map(cls.__getitem__, objs, next(columns)))
            elif op == "key":
                if cls is not dict:
                    return None
                objs = list(map(dict.get, objs, next(columns), repeat(MISSING)))
            else:
                read = attribute_column(cls, name, objs)
                if read is None:
                    return None
                objs = read
            if any(map(operator.is_, objs, repeat(MISSING))):
                return None
    except (IndexError, TypeError, AttributeError):
        return None
    return objs


def _read_attribute(obj: Any, name: Any, items: dict[Any, Any] | None) -> Any:
    """``read_attribute``, its reader for the object's type kept for the scan in ``items`` (a
    scan re-reads 100,000 paths through one record type: the type's MRO is read once)."""
    if items is None or type(name) is not str:
        return read_attribute(obj, name)
    cls = type(obj)
    known = items.get(("attr", id(cls), name))
    if known is None or known[0] is not cls:
        known = items[("attr", id(cls), name)] = (cls, attribute_getter(cls, name))
    return known[1](obj)


def _frame_item(frame: Any, label: Any, row: int) -> Any:
    """``frame[label].iloc[row]`` read from the frame's block of objects, through pandas' own
    attributes (library code, an exact DataFrame only, as ``names`` reads it); MISSING on any doubt."""
    pandas, numpy = sys.modules.get("pandas"), sys.modules.get("numpy")
    if pandas is None or numpy is None or type(frame) is not getattr(pandas, "DataFrame", None) \
            or not is_plain_key(label) or type(row) is not int:
        return MISSING
    try:
        loc = frame.columns.get_loc(label)
        if type(loc) is not int:  # a label twice: a slice or a mask, no single column
            return MISSING
        manager = frame._mgr
        array = manager.blocks[int(manager.blknos[loc])].values
        if type(array) is not numpy.ndarray or array.ndim != 2 or not 0 <= row < array.shape[1]:
            return MISSING
        return numpy.ndarray.__getitem__(array, (int(manager.blklocs[loc]), row))
    except Exception:
        return MISSING


# Along a run (a linked list's .next ×199,600) the object every this many links is kept for the scan.
_MARK_EVERY = 1024


def _follow_run(obj: Any, name: str, links: int, items: dict[Any, Any] | None) -> Any:
    """``.name`` followed ``links`` times, read at C level. The objects every _MARK_EVERY links are
    kept for the scan (in ``items``), so the paths along one list share one climb, not one each."""
    key = ("run", id(obj), name)
    known = items.get(key) if items is not None else None
    if known is None or known[0] is not obj:
        fresh: tuple[Any, list[Any], dict[int, Any]] = (obj, [obj], {})
        known = fresh
        if items is not None:
            items[key] = known
    marks, readers = known[1], known[2]  # readers: id(type) -> its reader of .name
    at = min(links // _MARK_EVERY, len(marks) - 1)
    current, position = marks[at], at * _MARK_EVERY
    while position < links:
        cls = type(current)
        reader = readers.get(id(cls), MISSING)
        if reader is MISSING:
            reader = readers[id(cls)] = attribute_reader(cls, name)
        if reader is None:
            return MISSING
        try:
            current = reader(current)
        except AttributeError:
            return MISSING
        position += 1
        if position % _MARK_EVERY == 0 and position // _MARK_EVERY == len(marks):
            marks.append(current)
    return current


def _values_by_key_identity(mapping: dict, items: dict[Any, Any] | None) -> dict[int, tuple[Any, Any]]:
    """id(key) -> (key, value) for a dict, built once per scan: keys matched by identity, not hash."""
    known = items.get(("keys", id(mapping))) if items is not None else None
    if known is not None and known[0] is mapping:
        return known[1]
    keys = list(dict.keys(mapping))
    by_key = dict(zip(map(id, keys), zip(keys, dict.values(mapping))))
    if items is not None:
        items[("keys", id(mapping))] = (mapping, by_key)
    return by_key


def _tensor_grad(tensor: Any) -> Any:
    """A leaf tensor's ``.grad`` read through TensorBase with subclass code off; MISSING if none."""
    torch: Any = sys.modules.get("torch")
    try:
        base = torch._C.TensorBase
        if not mro_has(type(tensor), base):
            return MISSING
        with torch._C.DisableTorchFunctionSubclass():
            if not base.is_leaf.__get__(tensor):
                return MISSING
            grad = base.grad.__get__(tensor)
    except Exception:
        return MISSING
    return MISSING if grad is None else grad


def _listed(obj: Any, tag: str, items: dict[int, tuple[Any, list[Any]]] | None) -> list[Any] | None:
    """A set's members, a deque's items or an object array's items, in iteration order (C-level)."""
    known = items.get(id(obj)) if items is not None else None
    if known is not None and known[0] is obj:
        return known[1]
    cls = type(obj)
    if tag == "member":
        if cls is set or cls is frozenset:
            listed = list(obj)
        elif mro_has(cls, set):
            listed = list(set.__iter__(obj))
        elif mro_has(cls, frozenset):
            listed = list(frozenset.__iter__(obj))
        else:
            return None
    elif tag == "flat":
        ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
        if ndarray is None or not mro_has(cls, ndarray):
            return None
        listed = array_items(obj, ndarray)
    else:
        listed = list(deque_type().__iter__(obj))
    if items is not None:
        items[id(obj)] = (obj, listed)
    return listed
