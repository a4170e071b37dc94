"""Read an object's parts at C level, so none of the user's code runs: its type's dict and MRO, an
instance's attributes and slots, a function's ``__dict__``, an object array's items.

What the walk, its naming (``names``) and re-reading (``resolve``) all read through.
"""
from __future__ import annotations

import collections
import gc
import operator
import types
from itertools import compress, count, repeat
from typing import Any
from collections.abc import Callable

type_dict = type.__dict__["__dict__"].__get__
type_mro = type.__dict__["__mro__"].__get__
type_name = type.__dict__["__name__"].__get__
module_dict = type_dict(types.ModuleType)["__dict__"].__get__  # a module's globals, past any __getattr__


# A tuple or frozenset key is shown by value when it is this small and made of plain keys.
_KEY_ITEMS = 16


def is_plain_key(key: Any, nested: int = 0) -> bool:
    """Whether a key is shown by value: str, int, float, bool, bytes, None, and small tuples and
    frozensets of those (``frozenset({'v0', 'alpha'})``), all by the identity of their exact types,
    so showing or hashing one runs no user code."""
    cls = type(key)
    if cls is str or cls is int or cls is float or cls is bool or cls is bytes or key is None:
        return True
    if (cls is tuple or cls is frozenset) and nested < 2 and len(key) <= _KEY_ITEMS:
        return all(is_plain_key(item, nested + 1) for item in key)
    return False


def mro_has(cls: type, base: type) -> bool:
    """Whether ``base`` is in ``cls``'s MRO, by identity (no metaclass ``__eq__``/``__hash__`` runs)."""
    try:
        return any(k is base for k in type_mro(cls))
    except Exception:
        return False


def function_dict(f: types.FunctionType) -> dict | None:
    try:
        d = types.FunctionType.__dict__["__dict__"].__get__(f)
    except Exception:
        return None
    return d if type(d) is dict and dict.__len__(d) else None


def array_items(array: Any, ndarray: Any) -> list[Any]:
    """The objects in a numpy object array (none for any other dtype), read through ndarray's own methods."""
    if ndarray is None:
        return []
    try:
        if not ndarray.dtype.__get__(array).hasobject:
            return []
        return ndarray.tolist(ndarray.ravel(array))
    except Exception:
        return []


def mapping_items(klass: type) -> list[tuple[Any, Any]]:
    try:
        return list(type_dict(klass).items())  # a mappingproxy over the class dict: C-level
    except Exception:
        return []


def find_referent(objs: list[Any], obj_id: int) -> Any:
    for o in objs:
        if id(o) == obj_id:
            return o
    return None


def deque_type() -> type[collections.deque]:
    return collections.deque


def deque_iter() -> Callable[[Any], Any]:
    return deque_type().__iter__


def qualname(cls: type) -> str:
    try:
        name = type.__dict__["__qualname__"].__get__(cls)
        return name if type(name) is str else "?"
    except Exception:
        return "?"


def plain_dict_slot(cls: type) -> bool:
    """Whether the first ``__dict__`` along ``cls``'s MRO is CPython's own descriptor (no user code)."""
    try:
        for klass in type_mro(cls):
            found = type_dict(klass).get("__dict__", MISSING)
            if found is not MISSING:
                return type(found) is types.GetSetDescriptorType or type(found) is types.MemberDescriptorType
    except Exception:
        return False
    return False
MISSING = object()  # what a read returns where the object has no such part


def instance_dict_if_present(obj: Any) -> dict | None:
    """The instance's ``__dict__`` if one is already materialised and reachable as a referent."""
    for ref in gc.get_referents(obj):
        if type(ref) is dict:
            d = instance_attributes(obj)
            return d if d is ref else None
    return None


def instance_attributes(obj: Any) -> dict:
    """An object's ``__dict__`` read through CPython's own slot (no user code runs), or {}.

    On Python 3.11+ this makes the dict if the instance kept its attributes inline: it is called
    only for objects on a path being named (a handful), never per object walked.
    """
    if not plain_dict_slot(type(obj)):
        return {}
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return {}
    return d if type(d) is dict else {}


def attribute_source(cls: type, name: str) -> tuple[str, Any]:
    """Where ``.name`` of a ``cls`` instance can be read without running code, decided from the
    class's MRO dicts: ("member", its slot's descriptor), ("exception", BaseException's getset
    descriptor), ("own", None): the instance's own value past any ``__getattr__``; ("none", None):
    reading it could run code (a property, another descriptor, a ``__dict__`` the class overrides)."""
    try:
        mro = type_mro(cls)
    except Exception:
        return "none", None
    for klass in mro:
        found = type_dict(klass).get(name, MISSING)
        if found is not MISSING:
            if type(found) is types.MemberDescriptorType:
                return "member", found
            if klass is BaseException and type(found) is types.GetSetDescriptorType:
                return "exception", found
            return "none", None
    return ("own", None) if plain_dict_slot(cls) else ("none", None)


def attribute_reader(cls: type, name: str) -> Callable[[Any], Any] | None:
    """A reader of ``.name`` on instances of ``cls`` that runs no code (a slot's descriptor, or the
    instance's own value past any ``__getattr__``; it raises AttributeError where unset), or None
    where reading it could run code."""
    source, found = attribute_source(cls, name)
    if source == "member":
        return lambda obj: found.__get__(obj, cls)
    return (lambda obj: object.__getattribute__(obj, name)) if source == "own" else None


def read_attribute(obj: Any, name: Any) -> Any:
    """``obj.name`` read without running code: a slot's member descriptor, or the instance's own value."""
    if type(name) is not str:
        return MISSING
    cls = type(obj)
    if cls is dict:  # a module's child dicts are walked as dicts with attribute-looking keys
        return dict.get(obj, name, MISSING)
    return _read(obj, cls, name, *attribute_source(cls, name))


def _read(obj: Any, cls: type, name: str, source: str, found: Any) -> Any:
    try:
        if source == "member" or source == "exception":
            return found.__get__(obj, cls)
        if source == "own":
            # The name is no descriptor of the class: this reads the instance's own value (inline or in
            # its dict) without making a dict or calling __getattr__.
            return object.__getattribute__(obj, name)
    except AttributeError:
        if source == "exception":
            raise
    return MISSING


def attribute_getter(cls: type, name: str) -> Callable[[Any], Any]:
    """``read_attribute`` for instances of ``cls``, decided once: the class's MRO is read here, so
    a scan re-reading many paths through one type pays for it once."""
    if cls is dict:
        return lambda obj: dict.get(obj, name, MISSING)
    source, found = attribute_source(cls, name)
    return lambda obj: _read(obj, cls, name, source, found)


def attribute_column(cls: type, name: str, objs: list[Any]) -> list[Any] | None:
    """``read_attribute`` over instances of ``cls`` in one C-level pass; None where it could run
    code. Raises AttributeError where one instance has no such attribute."""
    if cls is dict:
        return list(map(dict.get, objs, repeat(name), repeat(MISSING)))
    source, found = attribute_source(cls, name)
    if source == "member" or source == "exception":
        return list(map(found.__get__, objs, repeat(cls)))
    return list(map(object.__getattribute__, objs, repeat(name))) if source == "own" else None


# Owners read in one C-level pass at most this many at a time (the list of values read is kept meanwhile).
_READ_BLOCK = 4096


def links_named(owners: list[Any], children: list[int], name: str, at: int = 0, end: int | None = None) -> int:
    """How many ``owners`` from ``at`` on (up to ``end``) hold the object of the same place in ``children``
    (ids) as ``.name``, read without running code: a class's run of owners in C-level passes of a block each."""
    start, end_all = at, len(owners) if end is None else end
    while at < end_all:
        cls = type(owners[at])
        block_end = min(at + _READ_BLOCK, end_all)  # never past ``end``: what lies beyond is known already
        # Slices, not islice: islice skips its ``at`` first items one by one (a 200,000-node run: quadratic).
        block = owners[at:block_end]
        stop = block_end if all(map(operator.is_, map(type, block), repeat(cls))) else \
            next(compress(count(at), map(operator.is_not, map(type, block), repeat(cls))))
        if attribute_source(cls, name)[0] not in ("member", "own"):  # as attribute_reader: read only where no code runs
            return at - start
        try:
            values = attribute_column(cls, name, block if stop == block_end else owners[at:stop])
        except AttributeError:  # one owner lacks it: the run ends at that owner
            values = _read_until_missing(cls, name, owners[at:stop])
        del block
        if values is None:
            return at - start
        ids, held = list(map(id, values)), children[at:stop]
        bad = None if ids == held else next(compress(count(at), map(operator.ne, ids, held)), None)
        if bad is not None or len(values) < stop - at:
            return (bad if bad is not None else at + len(values)) - start
        at = stop
    return end_all - start


def _read_until_missing(cls: type, name: str, owners: list[Any]) -> list[Any] | None:
    """``.name`` of each owner up to the first that has none (``attribute_reader``'s reads)."""
    reader = attribute_reader(cls, name)
    if reader is None:
        return None
    values = []
    for owner in owners:
        try:
            values.append(reader(owner))
        except AttributeError:
            break
    return values
