"""How a parent refers to its child, read at C level (``Links``): a dict's key, a sequence's index,
a slot or inline attribute, a frame's local; what ``names.Namer`` strings into a path's steps.

Each decision that depends only on the parent's class (its shape, its slots, the names its methods
assign) is made once per class; a big container's keys or indexes are read once, for all of its
children being named.
"""
from __future__ import annotations

import gc
import types
from itertools import chain, compress, count
from typing import Any
from collections.abc import Callable

from .path_text import Step
from .walk import Walk
from .reads import (MISSING, array_items, attribute_getter, deque_iter, deque_type, find_referent,
                    instance_attributes, instance_dict_if_present, is_plain_key, mapping_items, mro_has,
                    plain_dict_slot, qualname, type_mro, type_name)

# A suspended generator's (coroutine's) frame, read through its type's own getter.
_GEN_FRAME = {types.GeneratorType: "gi_frame", types.CoroutineType: "cr_frame", types.AsyncGeneratorType: "ag_frame"}
_GEN_FRAME_OF = {cls: cls.__dict__[name].__get__ for cls, name in _GEN_FRAME.items()}
# A dict this small is searched for the one child asked about, with nothing cached for its siblings.
_SMALL = 16


class Links:
    """Reads links for a ``Namer``: ``parent_of`` is the namer's own (id -> parent), shared."""

    def __init__(self, walk: Walk, parent_of: dict[int, Any]) -> None:
        self.walk = walk
        self.parent_of = parent_of
        self._reverse: dict[int, dict[int, Any]] = {}  # id(container) -> id(child) -> its key/index
        self._shapes: dict[int, str] = {}
        self._shape_types: list[type] = []  # keeps the types whose ids key _shapes alive
        self._member_cache: dict[int, list[tuple[str, Any]]] = {}
        self.key_paths: set[int] = set()  # ids of the keys a ("keypath", id) step names by their own path
        self._last_member: dict[int, int] = {}  # id(type) -> the member that named a child last
        self._by_parent: dict[int, set[int]] = {}
        self._by_parent_size = -1
        self._candidates: dict[int, list[str]] = {}
        self._getters: dict[tuple[int, str], Callable[[Any], Any]] = {}  # the MRO read once per type and name

    def link(self, parent: Any, child_id: int) -> list[Step]:
        """How ``parent`` refers to the object with id ``child_id``, read at C level."""
        try:
            return self._link_unsafe(parent, child_id)
        except Exception:
            return [("via", qualname(type(parent)))]

    def _shape_of(self, cls: type) -> str:
        """Which kind of link reading applies to instances of ``cls`` (decided once per type)."""
        known = self._shapes.get(id(cls))
        if known is not None:
            return known
        shape = "inst"
        exact = {types.FunctionType: "func", types.FrameType: "frame", types.TracebackType: "tb",
                 types.CellType: "cell", types.GeneratorType: "gen", types.CoroutineType: "gen",
                 types.AsyncGeneratorType: "gen"}
        for t, name in exact.items():
            if cls is t:
                shape = name
                break
        else:
            ndarray = self.walk.ndarray
            for base, name in ((dict, "dict"), (list, "list"), (tuple, "tuple"), (deque_type(), "deque"),
                               (set, "set"), (frozenset, "frozenset"), (ndarray, "ndarray"),
                               (BaseException, "exc")):
                if base is not None and mro_has(cls, base):
                    shape = name
                    break
            if shape == "inst" and type_name(cls) == "_lru_cache_wrapper":
                shape = "lru"
        self._shapes[id(cls)] = shape
        self._shape_types.append(cls)
        return shape

    def _members(self, cls: type) -> list[tuple[str, Any]]:
        """The slots and C members along ``cls``'s MRO, read from the class dicts (no user code)."""
        known = self._member_cache.get(id(cls))
        if known is None:
            known = [(name, value) for klass in type_mro(cls) for name, value in mapping_items(klass)
                     if type(value) is types.MemberDescriptorType and type(name) is str]
            self._member_cache[id(cls)] = known
        return known

    def _inline_name(self, obj: Any, cls: type, child_id: int) -> str | None:
        """The attribute holding the child, tried by the names the class's methods assign
        (``self.x = ...``), read without making the instance's ``__dict__``."""
        names = self._candidates.get(id(cls))
        if names is None:
            names = self._candidates[id(cls)] = _assigned_names(cls) if plain_dict_slot(cls) else []
        getters = self._getters
        for name in names:
            read = getters.get((id(cls), name))
            if read is None:
                read = getters[(id(cls), name)] = attribute_getter(cls, name)
            value = read(obj)
            if value is not MISSING and id(value) == child_id:
                return name
        return None

    def _link_unsafe(self, parent: Any, child_id: int) -> list[Step]:
        cls = type(parent)
        shape = self._shape_of(cls)
        if shape == "inst":  # the most common link first (records, modules)
            return self._instance_link(parent, cls, child_id)
        if shape == "list":
            return [("index", self.index_of(parent, child_id, list.__iter__))]
        if shape == "func":
            closure = parent.__closure__
            if closure is not None and id(closure) == child_id:
                return [("", "__closure__")]
            if id(parent.__defaults__) == child_id:
                return [("attr", "__defaults__")]
            if id(parent.__kwdefaults__) == child_id:
                return [("attr", "__kwdefaults__")]
            return [("",)]  # its __dict__: the next step is an attribute
        if shape == "frame":
            local = parent.f_locals
            names = self.reverse_map(parent, local, child_id) if type(local) is dict else {}
            return [("local", parent.f_code.co_name, names.get(child_id, "?"))]
        if shape == "gen":  # a suspended generator holds its frame's locals: name the local
            attr = _GEN_FRAME[type(parent)]
            frame = _GEN_FRAME_OF[type(parent)](parent)
            local = frame.f_locals if frame is not None else None
            names = self.reverse_map(parent, local, child_id) if type(local) is dict else {}
            if child_id in names and type(names[child_id]) is str:
                return [("genlocal", attr, names[child_id])]
            return [("via", qualname(cls))]
        if shape == "tb":
            return [("tb",)]
        if shape == "cell":
            return [("cell",)]
        if shape == "dict":
            values = self.reverse_map(parent, parent, child_id)
            if child_id in values:
                return [self._key_step(values[child_id])]
            for key in dict.keys(parent):
                if id(key) == child_id:
                    return [("iskey", qualname(type(key)))]
            if cls is not dict:  # a dict subclass's own attribute
                return self._instance_link(parent, cls, child_id)
            return [("via", qualname(cls))]
        if shape == "tuple" and self._is_closure_of_parent(parent):
            return [("closure", self.index_of(parent, child_id, tuple.__iter__))]
        if shape == "list" or shape == "tuple" or shape == "deque":
            it = list.__iter__ if shape == "list" else tuple.__iter__ if shape == "tuple" else deque_iter()
            return [("index", self.index_of(parent, child_id, it))]
        if shape == "set" or shape == "frozenset":
            it = set.__iter__ if shape == "set" else frozenset.__iter__
            return [("member", self.index_of(parent, child_id, it))]
        if shape == "ndarray":
            ndarray = self.walk.ndarray
            index = self.index_of(parent, child_id, lambda a: iter(array_items(a, ndarray)))
            return [("flat", index, ndarray.ndim.__get__(parent))]
        if shape == "lru":
            d = instance_dict_if_present(parent)
            if d is not None and id(d) == child_id:
                return [("",)]
            if type(find_referent(gc.get_referents(parent), child_id)) is dict:
                return [("", "cache")]
            return [("cache",)]
        if shape == "exc":
            for name in ("args", "__traceback__", "__cause__", "__context__"):
                value = BaseException.__dict__[name].__get__(parent)
                if id(value) == child_id:
                    return [("",)] if name == "__traceback__" else [("attr", name)]
        return self._instance_link(parent, cls, child_id)

    def _instance_link(self, parent: Any, cls: type, child_id: int) -> list[Step]:
        """An instance's link: a slot or C member, its __dict__ (already there), or an inline attribute."""
        members = self._members(cls)
        last = self._last_member.get(id(cls), 0)  # the slot that held the child last time, tried first
        for at in chain((last,), range(len(members))) if members else ():
            name, member = members[at]
            try:
                if id(member.__get__(parent, cls)) == child_id:
                    self._last_member[id(cls)] = at
                    return [("attr", name)]
            except Exception:
                continue
        d = instance_dict_if_present(parent)
        if d is not None and id(d) == child_id:
            return [("",)]
        inline = self._inline_name(parent, cls, child_id)
        if inline is not None:
            return [("attr", inline)]
        # Last resort: the instance's dict (made now on 3.11+ if its attributes were inline; only
        # for an object on a path being shown, whose attribute no method of its class names).
        d = instance_attributes(parent)
        if d:
            for name, value in dict.items(d):
                if id(value) == child_id and type(name) is str:
                    return [("attr", name)]
        return [("via", qualname(cls))]

    def pandas_column(self, forward: list[int], at: int) -> Step | None:
        """``('pandas', column, row)`` where the path goes from a DataFrame through a block's values.

        Asked by ``steps`` only where ``forward[at]``'s parent is exactly pandas' DataFrame and four more
        links follow. Read through pandas' own attributes (library code); any doubt and the path is
        shown link by link instead.
        """
        frame: Any = self.parent_of.get(forward[at])
        try:
            parent_of = self.parent_of
            block, array = parent_of[forward[at + 3]], parent_of[forward[at + 4]]
            ndarray = self.walk.ndarray
            if ndarray is None or type(array) is not ndarray or array.ndim != 2 or array is not block.values:
                return None
            index = self.index_of(array, forward[at + 4], lambda a: iter(array_items(a, ndarray)))
            rows = array.shape[1]
            position = int(block.mgr_locs.as_array[index // rows])
            label = frame.columns[position]
            if not is_plain_key(label):
                return None
            return ("pandas", label, index % rows)
        except Exception:
            return None

    def _is_closure_of_parent(self, tup: Any) -> bool:
        up = self.parent_of.get(id(tup))
        return type(up) is types.FunctionType and up.__closure__ is tup

    def _key_step(self, key: Any) -> Step:
        if is_plain_key(key):
            return ("key", key)
        if self.walk.reached(id(key)) or id(key) in self.walk.roots:
            self.key_paths.add(id(key))
            return ("keypath", id(key), qualname(type(key)))
        return ("keytype", qualname(type(key)))

    def _needed(self, container: Any, child_id: int) -> set[int]:
        """Ids of the children of ``container`` on the paths being named (so a huge container is
        searched once, in a C-level pass, for just those)."""
        if self._by_parent_size != len(self.parent_of):
            by_parent: dict[int, set[int]] = {}
            for cid, up in self.parent_of.items():
                by_parent.setdefault(id(up), set()).add(cid)
            self._by_parent, self._by_parent_size = by_parent, len(self.parent_of)
        return self._by_parent.get(id(container), set()) | {child_id}

    def reverse_map(self, container: Any, mapping: dict, child_id: int) -> dict[int, Any]:
        """id(value) -> its key in ``mapping`` for the children being named (the first key wins)."""
        if dict.__len__(mapping) <= _SMALL:  # a record-like dict (one per tensor): its first match, nothing kept
            key = next(compress(dict.keys(mapping), map(child_id.__eq__, map(id, dict.values(mapping)))), MISSING)
            return {} if key is MISSING else {child_id: key}
        cached = self._reverse.get(id(container))
        if cached is None or child_id not in cached:
            needed = self._needed(container, child_id)
            mask = list(map(needed.__contains__, map(id, dict.values(mapping))))
            keys = list(compress(dict.keys(mapping), mask))
            values = list(compress(dict.values(mapping), mask))
            cached = dict(zip(map(id, reversed(values)), reversed(keys)))
            self._reverse[id(container)] = cached
        return cached

    def index_of(self, container: Any, child_id: int, iterate: Callable[[Any], Any]) -> int:
        """The position of a child in a sequence, set or array (found with those of its siblings being named).

        A list's or tuple's child the walk read as its item has its index from the walk: checked by one
        read, never searched for (naming 1,000 items of a 280,000-item list reads 1,000 items, not all)."""
        at = self.walk.indexes.get(child_id)
        item_at = list.__getitem__ if iterate is list.__iter__ else tuple.__getitem__ if iterate is tuple.__iter__ \
            else None
        if at is not None and item_at is not None:
            try:
                if id(item_at(container, at)) == child_id:
                    return at
            except IndexError:
                pass
        cached = self._reverse.get(id(container))
        if cached is None or child_id not in cached:
            needed = self._needed(container, child_id)
            items = list(iterate(container))
            cached = {}
            for at in reversed(list(compress(count(), map(needed.__contains__, map(id, items))))):
                cached[id(items[at])] = at  # reversed: the first position wins
            del items
            self._reverse[id(container)] = cached
        return cached.get(child_id, -1)

    def clear(self) -> None:
        self._reverse.clear()
        self._shapes.clear()
        self._shape_types.clear()
        self._member_cache.clear()
        self.key_paths.clear()
        self._last_member.clear()
        self._by_parent.clear()
        self._by_parent_size = -1
        self._candidates.clear()
        self._getters.clear()


def _assigned_names(cls: type) -> list[str]:
    """Names the functions in ``cls``'s MRO dicts use as attributes (``co_names``), in order, once each."""
    seen: dict[str, None] = {}
    try:
        for klass in type_mro(cls):
            if klass is object:
                continue
            for _, value in mapping_items(klass):
                if type(value) is types.FunctionType:
                    code = value.__code__
                    for name in code.co_names:
                        if type(name) is str:
                            seen.setdefault(name)
    except Exception:
        pass
    return list(seen)
