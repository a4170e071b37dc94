"""Reach what the roots hold through the interpreter's own traversal, and name the way to a few objects.

The walk is breadth-first over ``gc.get_referents`` (each type's C-level ``tp_traverse``), so
no Python code of the user's ever runs and every holder is reached (deques, lru caches,
``functools.partial``, closures, slots, C extension containers) without per-type code. It
works a level at a time in bulk C-level passes (``map``, ``compress``, set difference on ids),
keeps the id of each object visited and, in the order reached, its parent; it never hashes or compares a
user's object or type: membership is by ``id``.

Never entered: modules, classes, code, builtin functions and descriptors; a function is entered
through its closure, defaults and ``__dict__`` only (its ``__globals__`` would lead everywhere),
a frame through its locals. Untracked numpy object arrays are expanded by their items. Paths
through a dict's *keys* are taken only after everything reachable through values, attributes and
indexes (an optimizer's ``state`` is keyed by the parameters a model names).

Names are made after the walk, for the objects asked about only: each parent-to-child link is
found with C-level reads (dict items, sequence indexes, member descriptors, a frame's locals) and
kept as *steps* (plain strings and ints, no references), which ``resolve`` re-reads later to
check a remembered path still reaches the same object.

One file (over 600 lines) because reaching, naming and re-reading share one private layout: the
walk's segments of (ids, parents), its roots, and the step tuples that ``Namer`` writes, ``render``
shows and ``resolve`` follows; split, each half would depend on the other's internals.
"""
from __future__ import annotations

import gc
import operator
import sys
import time
import types
from itertools import chain, compress, count, islice, repeat
from typing import Any
from collections.abc import Callable, Iterable

from .records.snapshot import HolderKind

# What the walk does with an object, decided once per type (by the type's id).
GENERIC, DICT, FUNCTION, FRAME, NDARRAY, SKIP, LATER, SEQ = range(8)
# Bulk passes work on this many parents at a time, so one huge container cannot overrun a deadline.
SLICE = 8192
# Levels this narrow are walked object by object (cheaper than the bulk passes' fixed cost).
NARROW = 4
# Paths longer than this many steps are shown with their middle elided.
MAX_SHOWN_STEPS = 64

_SKIP_TYPES = (types.ModuleType, types.CodeType, types.BuiltinFunctionType, types.MethodWrapperType,
               types.WrapperDescriptorType, types.MethodDescriptorType, types.GetSetDescriptorType,
               types.MemberDescriptorType, types.ClassMethodDescriptorType, property, staticmethod,
               classmethod, types.MappingProxyType)
_MODULE_CHILD_DICTS = ("_parameters", "_buffers", "_modules")
_type_dict = type.__dict__["__dict__"].__get__
_type_mro = type.__dict__["__mro__"].__get__
_type_name = type.__dict__["__name__"].__get__


class Root:
    """A starting point of the walk: its holder kind and the name the user knows it by."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: HolderKind, name: str) -> None:
        self.kind, self.name = kind, name


def is_plain_key(key: Any) -> bool:
    """Whether a key is shown by value (str, int, float, bool, bytes, None): by identity of its type."""
    cls = type(key)
    return cls is str or cls is int or cls is float or cls is bool or cls is bytes or key is None


def mro_has(cls: type, base: type) -> bool:
    """Whether ``base`` is in ``cls``'s MRO, by identity (no metaclass ``__eq__``/``__hash__`` runs)."""
    try:
        return any(k is base for k in _type_mro(cls))
    except Exception:
        return False


def classify(cls: type, ndarray: type | None, later: tuple[type, ...] = ()) -> int:
    """Which branch of the walk handles instances of ``cls``."""
    if cls is dict:
        return DICT
    if cls is list or cls is tuple or cls is set or cls is frozenset or cls is _deque():
        return SEQ  # exact builtin containers: len() and iteration are their own C code
    if cls is types.FunctionType:
        return FUNCTION
    if cls is types.FrameType:
        return FRAME
    try:
        mro = _type_mro(cls)
    except Exception:
        return SKIP
    for base in mro:
        if base is type or any(base is s for s in _SKIP_TYPES):
            return SKIP
    if ndarray is not None and any(k is ndarray for k in mro):
        return NDARRAY
    if any(k is dict for k in mro):
        return DICT
    if later and any(k is base for k in mro for base in later):
        return LATER
    return GENERIC


def _later_types() -> tuple[type, ...]:
    """Holders whose paths a user recognises less than a model's: an optimizer holds the parameters too."""
    optim = sys.modules.get("torch.optim")
    optimizer = getattr(optim, "Optimizer", None) if optim is not None else None
    return (optimizer,) if isinstance(optimizer, type) else ()


class Walk:
    """One breadth-first walk: ``visited`` holds the id of every object reached, and the walk keeps,
    in the order reached, segments of (ids, parents) from which ``parents_of`` reads paths back.

    ``skip``: objects never entered (the namespace dicts, the shell, our own lists). ``wanted``:
    ids of the tensors whose storages need a holder (id -> storage key); the walk stops once each
    of those storages is reached. ``collect``: tensor type ids whose instances are gathered as met
    (the quick view, which has no heap pass).
    """

    def __init__(self, skip: Iterable[object], *, wanted: dict[int, int] | None = None,
                 collect: frozenset[int] | None = None, deadline: float = float("inf"),
                 budget_nodes: int = 10_000_000) -> None:
        numpy = sys.modules.get("numpy")
        self.ndarray: type | None = getattr(numpy, "ndarray", None)
        self._nd_id = id(self.ndarray) if self.ndarray is not None else -1
        self._skip = frozenset(map(id, skip))
        self.visited: set[int] = set(self._skip)  # never entered: the skipped objects
        self.roots: dict[int, Root] = {}
        # (ids, their parents, whether a parent may sit in the same segment): a parent is always
        # reached before its children, so one backwards pass finds every ancestor of a set of ids.
        self._segments: list[tuple[list[int], list[Any], bool]] = []
        self.wanted = wanted if wanted is not None else {}
        self._wanted_ids = set(self.wanted)
        self.storages_left = len(set(self.wanted.values()))
        self.found: dict[int, int] = {}  # storage key -> id(first tensor reaching it)
        self.collect = collect
        self.met: list[Any] = []  # tensors met (collect mode)
        self.deadline = deadline
        self.budget_nodes = budget_nodes
        self.complete = True   # False: stopped by the deadline or the node budget
        self.exhausted = False  # True: everything reachable from the roots given was walked
        self.nodes = 0
        self._cats: dict[int, int] = {}
        self._types: list[type] = []  # keeps classified types alive while their ids are cached
        self._level: list[Any] = []
        self._keys: list[Any] = []  # dict keys met, walked after values (objects and their dicts)
        self._key_parents: list[Any] = []
        self._frames: list[Any] = []  # locals dicts read from frames: kept alive while ids are in use
        self._later: list[Any] = []  # reached optimizers, entered once everything else is walked
        self._big: list[Any] = []  # containers too big to read in one pass, read in slices
        self._later_types = _later_types()

    # -- walking -------------------------------------------------------------------------------
    def start(self, kind: HolderKind, roots: Iterable[tuple[str, object]]) -> None:
        """Queue roots of one holder kind (walked by ``run``); a root already reached is skipped."""
        visited = self.visited
        for name, obj in roots:
            if id(obj) not in visited:
                visited.add(id(obj))
                self.roots[id(obj)] = Root(kind, name)
                self._level.append(obj)
                self._note_wanted((id(obj),))
        self.exhausted = False

    def run(self) -> None:
        """Walk from the queued roots until done, every wanted storage is reached, or out of budget."""
        while self.complete and not self.done:
            if not self._level and self._later:
                later, self._later = self._later, []
                kids, parents = self._expand(later, defer=False)
                self._level = self._mark(kids, parents)
                del kids, parents, later
                continue
            if not self._level and self._big:
                # Huge containers last: ten million records must not starve the model beside them.
                following: list[Any] = []
                self._expand_big(following)
                self._level = following
                continue
            if not self._level:
                if not self._keys:
                    self.exhausted = True
                    return
                level, parents = self._keys, self._key_parents
                self._keys, self._key_parents = [], []
                self._level = self._mark(level, parents)
                continue
            level, self._level = self._level, []
            if len(level) <= NARROW:
                self._level = self._narrow(level)
                continue
            following: list[Any] = []
            for start in range(0, len(level), SLICE):
                kids, parents = self._expand(level[start:start + SLICE])
                stop = self._mark_slices(kids, parents, following)
                del kids, parents
                if stop:
                    break
            self._level = following

    def _mark_slices(self, kids: list[Any], parents: list[Any], following: list[Any]) -> bool:
        """Mark children a slice at a time (one huge container too), on the clock; True: stop now."""
        for at in range(0, len(kids), SLICE):
            following.extend(self._mark(kids[at:at + SLICE], parents[at:at + SLICE]))
            if self._out_of_budget() or self.done:
                return True
        return False

    def _narrow(self, level: list[Any]) -> list[Any]:
        """Levels of a few objects (a linked list, a deep chain) one object at a time: the bulk
        passes cost microseconds per level whatever its width, a 200,000-deep chain seconds."""
        visited, cats, is_tracked, nd_id = self.visited, self._cats, gc.is_tracked, self._nd_id
        seg_ids: list[int] = []
        seg_parents: list[Any] = []

        def flush() -> None:
            nonlocal seg_ids, seg_parents
            if seg_ids:
                self._segments.append((seg_ids, seg_parents, True))
                seg_ids, seg_parents = [], []

        steps = 0
        while level and len(level) <= NARROW:
            following: list[Any] = []
            for obj in level:
                what = cats.get(id(type(obj)))
                if what is not GENERIC:
                    flush()  # the bulk passes append segments of their own: keep parents first
                    kids, parents = self._expand([obj])
                    if self._mark_slices(kids, parents, following):
                        return following
                    continue
                kids = gc.get_referents(obj)
                if len(kids) > 64:  # one big container: bulk passes, a slice at a time, on the clock
                    flush()
                    if self._mark_slices(kids, [obj] * len(kids), following):
                        return following
                    continue
                for kid in kids:
                    kid_id = id(kid)
                    if kid_id not in visited and (is_tracked(kid) or id(type(kid)) == nd_id):
                        visited.add(kid_id)
                        seg_ids.append(kid_id)
                        seg_parents.append(obj)
                        following.append(kid)
                        self.nodes += 1
                        if kid_id in self._wanted_ids:
                            self._note_wanted((kid_id,))
                        if self.collect is not None and id(type(kid)) in self.collect:
                            self.met.append(kid)
            level = following
            steps += 1
            if steps & 255 == 0 and (self._out_of_budget() or self.done):
                break
            if self.done:
                break
        flush()
        return level

    def seen(self, obj_id: int) -> bool:
        """Whether the walk reached this object or started from it (a root counts)."""
        return obj_id in self.visited and obj_id not in self._skip

    def reached(self, obj_id: int) -> bool:
        """Whether the walk reached this object from a root (a root itself does not count)."""
        return obj_id in self.visited and obj_id not in self._skip and obj_id not in self.roots

    def parents_of(self, ids: Iterable[int]) -> dict[int, Any]:
        """id -> parent (a Root for a root) for these objects and all their ancestors: one backwards pass."""
        roots = self.roots
        result: dict[int, Any] = {}
        wanted: set[int] = set()
        for i in ids:
            if i in roots:
                result[i] = roots[i]
            elif i in self.visited and i not in self._skip:
                wanted.add(i)

        def found(i: int, parent: Any) -> None:
            result[i] = parent
            wanted.discard(i)
            up = id(parent)
            if up in roots:
                result[up] = roots[up]
            elif up not in result:
                wanted.add(up)

        for seg_ids, seg_parents, chained in reversed(self._segments):
            if not wanted:
                break
            if chained:
                for at in range(len(seg_ids) - 1, -1, -1):
                    if seg_ids[at] in wanted:
                        found(seg_ids[at], seg_parents[at])
            else:
                for at in list(compress(range(len(seg_ids)), map(wanted.__contains__, seg_ids))):
                    if seg_ids[at] in wanted:
                        found(seg_ids[at], seg_parents[at])
        return result

    @property
    def done(self) -> bool:
        return bool(self.wanted) and self.storages_left == 0

    def release(self) -> None:
        """Drop every reference the walk holds (parents, queues): nothing is pinned after a scan."""
        self.visited.clear()
        self.roots.clear()
        self._segments.clear()
        self.found.clear()
        self.met.clear()
        self._level.clear()
        self._keys.clear()
        self._key_parents.clear()
        self._frames.clear()
        self._later.clear()
        self._big.clear()
        self._types.clear()

    def _out_of_budget(self) -> bool:
        if self.nodes >= self.budget_nodes or time.perf_counter() > self.deadline:
            self.complete = False
        return not self.complete

    def _expand(self, level: list[Any], defer: bool = True) -> tuple[list[Any], list[Any]]:
        """What one slice of a level refers to, and the parent of each (the same length)."""
        cats = self._cats
        tids = list(map(id, map(type, level)))
        unknown = set(tids).difference(cats)
        if unknown:
            for obj in level:
                tid = id(type(obj))
                if tid in unknown:
                    cats[tid] = classify(type(obj), self.ndarray, self._later_types)
                    self._types.append(type(obj))
                    unknown.discard(tid)
                    if not unknown:
                        break
        kinds = list(map(cats.__getitem__, tids))
        present = set(kinds)
        kids: list[Any] = []
        parents: list[Any] = []
        for what in present:
            objs = level if len(present) == 1 else list(compress(level, map(what.__eq__, kinds)))
            if what is LATER and defer:
                self._later.extend(objs)
            elif what is GENERIC or what is LATER:
                lists = list(map(gc.get_referents, objs))
                self._extend(kids, parents, objs, lists)
            elif what is SEQ:
                if max(map(len, objs)) > SLICE:  # a huge container is read a slice at a time, on the clock
                    self._big.extend(o for o in objs if len(o) > SLICE)
                    objs = [o for o in objs if len(o) <= SLICE]
                lists = list(map(gc.get_referents, objs))
                self._extend(kids, parents, objs, lists)
            elif what is DICT:
                if max(map(dict.__len__, objs)) > SLICE:
                    self._big.extend(d for d in objs if dict.__len__(d) > SLICE)
                    objs = [d for d in objs if dict.__len__(d) <= SLICE]
                lists = list(map(list, map(dict.values, objs)))
                self._extend(kids, parents, objs, lists)
                if any(map(gc.is_tracked, chain.from_iterable(map(dict.keys, objs)))):
                    self._defer_keys(objs)
            elif what is FUNCTION:
                lists = [[c for c in (f.__closure__, f.__defaults__, f.__kwdefaults__,
                                      _function_dict(f)) if c is not None] for f in objs]
                self._extend(kids, parents, objs, lists)
            elif what is FRAME:
                lists = [self._frame_locals(f) for f in objs]
                self._extend(kids, parents, objs, lists)
            elif what is NDARRAY:
                lists = [_array_items(a, self.ndarray) for a in objs]
                self._extend(kids, parents, objs, lists)
        return kids, parents

    def _defer_keys(self, dicts: list[Any]) -> None:
        """Queue the tracked keys of these dicts: walked after every value (an optimizer's state keys)."""
        dicts = [d for d in dicts if dict.__len__(d)]
        keys = [list(filter(gc.is_tracked, dict.keys(d))) for d in dicts]
        self._keys.extend(chain.from_iterable(keys))
        self._key_parents.extend(chain.from_iterable(map(repeat, dicts, map(len, keys))))

    def _expand_big(self, following: list[Any]) -> bool:
        """Read the huge containers a level met, a slice at a time with the clock checked; True: stop."""
        while self._big:
            obj = self._big.pop()
            if type(obj) is dict or mro_has(type(obj), dict):
                it = iter(dict.values(obj))
                self._defer_keys([obj])
            else:
                it = iter(obj)  # an exact builtin container: its own C iterator
            while True:
                part = list(islice(it, SLICE))
                if not part:
                    break
                following.extend(self._mark(part, [obj] * len(part)))
                if self._out_of_budget() or self.done:
                    return True
        return False

    @staticmethod
    def _extend(kids: list[Any], parents: list[Any], objs: list[Any], lists: list[list[Any]]) -> None:
        kids.extend(chain.from_iterable(lists))
        parents.extend(chain.from_iterable(map(repeat, objs, map(len, lists))))

    def _mark(self, kids: list[Any], parents: list[Any]) -> list[Any]:
        """Keep the tracked children (and untracked object arrays) not reached before; record parents."""
        mask = list(map(gc.is_tracked, kids))
        if not all(mask):
            nd_id = self._nd_id
            if nd_id != -1 and nd_id in set(map(id, map(type, compress(kids, map(operator.not_, mask))))):
                # numpy arrays are not gc-tracked: keep the ones among the children (by type id).
                for i in compress(count(), map(nd_id.__eq__, map(id, map(type, kids)))):
                    mask[i] = True
            kids = list(compress(kids, mask))
            parents = list(compress(parents, mask))
        ids = list(map(id, kids))
        new = set(ids).difference(self.visited)  # iterates the slice, not everything visited
        if not new:
            return []
        self.visited.update(new)
        keep = list(map(new.__contains__, ids))
        self._segments.append((list(compress(ids, keep)), list(compress(parents, keep)), False))
        self.nodes += len(new)
        level = list(compress(kids, keep))  # a child twice in one slice is expanded twice (harmless)
        if self.wanted:
            self._note_wanted(new)
        if self.collect is not None:
            tensors = list(compress(level, map(self.collect.__contains__, map(id, map(type, level)))))
            self.met.extend(tensors)
        return level

    def _note_wanted(self, ids: Iterable[int]) -> None:
        if not self.wanted:
            return
        hits = self._wanted_ids.intersection(ids)
        for tid in hits:
            key = self.wanted[tid]
            if key not in self.found:
                self.found[key] = tid
                self.storages_left -= 1

    def _frame_locals(self, frame: types.FrameType) -> list[Any]:
        """A function frame's local values; a module or class body's locals are globals: not entered."""
        try:
            if frame.f_code.co_flags & 0x1 == 0:  # CO_OPTIMIZED unset: module or class body
                return []
            local = frame.f_locals
        except Exception:
            return []
        if type(local) is not dict:
            return []
        self._frames.append(local)
        return list(dict.values(local))


def _function_dict(f: types.FunctionType) -> dict | None:
    try:
        d = types.FunctionType.__dict__["__dict__"].__get__(f)
    except Exception:
        return None
    return d if type(d) is dict and dict.__len__(d) else None


def _array_items(array: Any, ndarray: type | None) -> list[Any]:
    """The objects in a numpy object array (none for any other dtype), read through ndarray's own methods."""
    if ndarray is None:
        return []
    try:
        if not ndarray.dtype.__get__(array).hasobject:
            return []
        return ndarray.tolist(ndarray.ravel(array))
    except Exception:
        return []


# -- naming ------------------------------------------------------------------------------------
# A step is a tuple: ("attr", name) an attribute or slot; ("key", k) a dict value by a plain key;
# ("keytype", "Type") a dict value by a key shown by its type; ("keypath", id) a dict value keyed by
# an object named elsewhere (a parameter); ("iskey", "Type") the dict key itself; ("index", i);
# ("member", i) a set's i-th member; ("closure", i) a closure cell's contents; ("local", fn, name);
# ("cache",) an lru cache's result; ("flat", i) an object array's i-th item; ("via", "Type") an
# unnamed link; ("", ) a step shown as nothing (an instance's __dict__, a traceback).
Step = tuple


class Namer:
    """Turns the walk's parent links into steps, for the objects asked about, with memoised prefixes."""

    def __init__(self, walk: Walk, module_type: type | None) -> None:
        self.walk = walk
        self.module_type = module_type
        self._links: dict[int, tuple[Step, ...]] = {}  # id(child) -> the steps from its parent
        self.parent_of: dict[int, Any] = {}  # id -> parent (or Root), for the objects asked about
        self._reverse: dict[int, dict[int, Any]] = {}  # id(container) -> id(child) -> its key/index
        self._shapes: dict[int, str] = {}
        self._shape_types: list[type] = []  # keeps the types whose ids key _shapes alive
        self._member_cache: dict[int, list[tuple[str, Any]]] = {}
        self._by_parent: dict[int, set[int]] = {}
        self._by_parent_size = -1
        self._candidates: dict[int, list[str]] = {}

    def steps(self, obj_id: int) -> tuple[Root | None, tuple[Step, ...]]:
        """The root and the steps from it to the object with this id (None root: not reached).

        Each link is read once and kept per object (memory linear in the path's length), never a
        whole path per level: a 200,000-node linked list costs 200,000 links, not their squares.
        """
        chain_ids: list[int] = []
        node = obj_id
        parent = self.parent_of
        if node not in parent:
            self.prepare((node,))
        while True:
            up = parent.get(node)
            if up is None:
                return None, ()
            if type(up) is Root:
                break
            chain_ids.append(node)
            node = id(up)
        links = self._links
        steps: list[Step] = []
        forward = chain_ids[::-1]

        def link_of(child_id: int) -> tuple[Step, ...]:
            link = links.get(child_id)
            if link is None:
                link = links[child_id] = tuple(self._link(parent[child_id], child_id))
            return link

        if len(forward) <= MAX_SHOWN_STEPS:
            at = 0
            while at < len(forward):
                column = self._pandas_column(forward, at)
                if column is not None:  # df -> _mgr -> blocks -> block -> values -> item: df['emb'].iloc[i]
                    steps.append(column)
                    at += 5
                    continue
                steps.extend(link_of(forward[at]))
                at += 1
            return up, tuple(steps)
        # Only the ends are shown (8 visible steps each): the middle is never read.
        head: list[Step] = []
        at = 0
        while at < len(forward) and sum(map(_visible, head)) < 8:
            head.extend(link_of(forward[at]))
            at += 1
        tail: list[Step] = []
        end = len(forward)
        while end > at and sum(map(_visible, tail)) < 8:
            end -= 1
            tail[:0] = link_of(forward[end])
        steps = head + ([("elide",)] if end > at else []) + tail
        return up, tuple(steps)

    def _link(self, parent: Any, child_id: int) -> list[Step]:
        """How ``parent`` refers to the object with id ``child_id``, read at C level."""
        try:
            return self._link_unsafe(parent, child_id)
        except Exception:
            return [("via", _qualname(type(parent)))]

    def _shape_of(self, cls: type) -> str:
        """Which kind of link reading applies to instances of ``cls`` (decided once per type)."""
        known = self._shapes.get(id(cls))
        if known is not None:
            return known
        shape = "inst"
        exact = {types.FunctionType: "func", types.FrameType: "frame", types.TracebackType: "tb",
                 types.CellType: "cell"}
        for t, name in exact.items():
            if cls is t:
                shape = name
                break
        else:
            ndarray = self.walk.ndarray
            for base, name in ((dict, "dict"), (list, "list"), (tuple, "tuple"), (_deque(), "deque"),
                               (set, "set"), (frozenset, "frozenset"), (ndarray, "ndarray"),
                               (BaseException, "exc")):
                if base is not None and mro_has(cls, base):
                    shape = name
                    break
            if shape == "inst" and _type_name(cls) == "_lru_cache_wrapper":
                shape = "lru"
        self._shapes[id(cls)] = shape
        self._shape_types.append(cls)
        return shape

    def _members(self, cls: type) -> list[tuple[str, Any]]:
        """The slots and C members along ``cls``'s MRO, read from the class dicts (no user code)."""
        known = self._member_cache.get(id(cls))
        if known is None:
            known = [(name, value) for klass in _type_mro(cls) for name, value in _mapping_items(klass)
                     if type(value) is types.MemberDescriptorType and type(name) is str]
            self._member_cache[id(cls)] = known
        return known

    def _inline_name(self, obj: Any, cls: type, child_id: int) -> str | None:
        """The attribute holding the child, tried by the names the class's methods assign
        (``self.x = ...``), read without making the instance's ``__dict__``."""
        if not plain_dict_slot(cls):
            return None
        names = self._candidates.get(id(cls))
        if names is None:
            names = self._candidates[id(cls)] = _assigned_names(cls)
        for name in names:
            value = _read_attribute(obj, name)
            if value is not _MISSING and id(value) == child_id:
                return name
        return None

    def _link_unsafe(self, parent: Any, child_id: int) -> list[Step]:
        cls = type(parent)
        shape = self._shape_of(cls)
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
            names = self._reverse_map(parent, local, child_id) if type(local) is dict else {}
            return [("local", parent.f_code.co_name, names.get(child_id, "?"))]
        if shape == "tb":
            return [("tb",)]
        if shape == "cell":
            return [("cell",)]
        if shape == "dict":
            values = self._reverse_map(parent, parent, child_id)
            if child_id in values:
                return [self._key_step(values[child_id])]
            for key in dict.keys(parent):
                if id(key) == child_id:
                    return [("iskey", _qualname(type(key)))]
            return [("via", _qualname(cls))]
        if shape == "tuple" and self._is_closure_of_parent(parent):
            return [("closure", self._index_of(parent, child_id, tuple.__iter__))]
        if shape == "list" or shape == "tuple" or shape == "deque":
            it = list.__iter__ if shape == "list" else tuple.__iter__ if shape == "tuple" else _deque_iter()
            return [("index", self._index_of(parent, child_id, it))]
        if shape == "set" or shape == "frozenset":
            it = set.__iter__ if shape == "set" else frozenset.__iter__
            return [("member", self._index_of(parent, child_id, it))]
        if shape == "ndarray":
            ndarray = self.walk.ndarray
            index = self._index_of(parent, child_id, lambda a: iter(_array_items(a, ndarray)))
            return [("flat", index, ndarray.ndim.__get__(parent))]
        if shape == "lru":
            d = _instance_dict_if_present(parent)
            if d is not None and id(d) == child_id:
                return [("",)]
            if type(_find(gc.get_referents(parent), child_id)) is dict:
                return [("", "cache")]
            return [("cache",)]
        if shape == "exc":
            for name in ("args", "__traceback__", "__cause__", "__context__"):
                value = BaseException.__dict__[name].__get__(parent)
                if id(value) == child_id:
                    return [("",)] if name == "__traceback__" else [("attr", name)]
        # An instance: a slot or C member, its __dict__ (already there), or an inline attribute.
        for name, member in self._members(cls):
            try:
                if id(member.__get__(parent, cls)) == child_id:
                    return [("attr", name)]
            except Exception:
                continue
        d = _instance_dict_if_present(parent)
        if d is not None and id(d) == child_id:
            return [("",)]
        name = self._inline_name(parent, cls, child_id)
        if name is not None:
            return [("attr", name)]
        # Last resort: the instance's dict (made now on 3.11+ if its attributes were inline; only
        # for an object on a path being shown, whose attribute no method of its class names).
        d = instance_attributes(parent)
        if d:
            for name, value in dict.items(d):
                if id(value) == child_id and type(name) is str:
                    return [("attr", name)]
        return [("via", _qualname(cls))]

    def _pandas_column(self, forward: list[int], at: int) -> Step | None:
        """``('pandas', column, row)`` where the path goes from a DataFrame through a block's values.

        Read through pandas' own attributes (library code, exact DataFrame type only); any doubt
        and the path is shown link by link instead.
        """
        if at + 4 >= len(forward):
            return None
        frame = self.parent_of.get(forward[at])
        cls = type(frame)
        if _type_name(cls) != "DataFrame" or getattr(sys.modules.get("pandas"), "DataFrame", None) is not cls:
            return None
        try:
            parent_of = self.parent_of
            block, array = parent_of[forward[at + 3]], parent_of[forward[at + 4]]
            ndarray = self.walk.ndarray
            if ndarray is None or type(array) is not ndarray or array.ndim != 2 or array is not block.values:
                return None
            index = self._index_of(array, forward[at + 4], lambda a: iter(_array_items(a, ndarray)))
            rows = array.shape[1]
            position = int(block.mgr_locs.as_array[index // rows])
            label = frame.columns[position]
            if not is_plain_key(label):
                return None
            return ("pandas", label, index % rows)
        except Exception:
            return None

    def prepare(self, ids: Iterable[int]) -> None:
        """Read the parents of these objects and their ancestors back from the walk, in one pass."""
        wanted = [i for i in ids if i not in self.parent_of]
        if wanted:
            self.parent_of.update(self.walk.parents_of(wanted))

    def _is_closure_of_parent(self, tup: Any) -> bool:
        up = self.parent_of.get(id(tup))
        return type(up) is types.FunctionType and up.__closure__ is tup

    def _key_step(self, key: Any) -> Step:
        if is_plain_key(key):
            return ("key", key)
        if self.walk.reached(id(key)) or id(key) in self.walk.roots:
            return ("keypath", id(key), _qualname(type(key)))
        return ("keytype", _qualname(type(key)))

    def _needed(self, container: Any, child_id: int) -> set[int]:
        """Ids of the children of ``container`` on the paths being named (so a huge container is
        searched once, in a C-level pass, for just those)."""
        if self._by_parent_size != len(self.parent_of):
            by_parent: dict[int, set[int]] = {}
            for cid, up in self.parent_of.items():
                by_parent.setdefault(id(up), set()).add(cid)
            self._by_parent, self._by_parent_size = by_parent, len(self.parent_of)
        return self._by_parent.get(id(container), set()) | {child_id}

    def _reverse_map(self, container: Any, mapping: dict, child_id: int) -> dict[int, Any]:
        """id(value) -> its key in ``mapping`` for the children being named (the first key wins)."""
        cached = self._reverse.get(id(container))
        if cached is None or child_id not in cached:
            needed = self._needed(container, child_id)
            mask = list(map(needed.__contains__, map(id, dict.values(mapping))))
            keys = list(compress(dict.keys(mapping), mask))
            values = list(compress(dict.values(mapping), mask))
            cached = dict(zip(map(id, reversed(values)), reversed(keys)))
            self._reverse[id(container)] = cached
        return cached

    def _index_of(self, container: Any, child_id: int, iterate: Callable[[Any], Any]) -> int:
        """The position of a child in a sequence, set or array (found with those of its siblings being named)."""
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
        self._links.clear()
        self.parent_of.clear()
        self._reverse.clear()
        self._shapes.clear()
        self._shape_types.clear()
        self._member_cache.clear()
        self._candidates.clear()


def _visible(step: Step) -> bool:
    return not (step[0] in ("", "tb", "cell") and len(step) == 1)


def _assigned_names(cls: type) -> list[str]:
    """Names the functions in ``cls``'s MRO dicts use as attributes (``co_names``), in order, once each."""
    seen: dict[str, None] = {}
    try:
        for klass in _type_mro(cls):
            if klass is object:
                continue
            for _, value in _mapping_items(klass):
                if type(value) is types.FunctionType:
                    code = value.__code__
                    for name in code.co_names:
                        if type(name) is str:
                            seen.setdefault(name)
    except Exception:
        pass
    return list(seen)


def _mapping_items(klass: type) -> list[tuple[Any, Any]]:
    try:
        return list(_type_dict(klass).items())  # a mappingproxy over the class dict: C-level
    except Exception:
        return []


def _find(objs: list[Any], obj_id: int) -> Any:
    for o in objs:
        if id(o) == obj_id:
            return o
    return None


_DEQUE: list[Any] = []


def _deque() -> type | None:
    if not _DEQUE:
        import collections

        _DEQUE.append(collections.deque)
    return _DEQUE[0]


def _deque_iter() -> Callable[[Any], Any]:
    return _deque().__iter__


def _qualname(cls: type) -> str:
    try:
        name = type.__dict__["__qualname__"].__get__(cls)
        return name if type(name) is str else "?"
    except Exception:
        return "?"


def plain_dict_slot(cls: type) -> bool:
    """Whether the first ``__dict__`` along ``cls``'s MRO is CPython's own descriptor (no user code)."""
    try:
        for klass in _type_mro(cls):
            found = _type_dict(klass).get("__dict__", _MISSING)
            if found is not _MISSING:
                return type(found) is types.GetSetDescriptorType or type(found) is types.MemberDescriptorType
    except Exception:
        return False
    return False


_MISSING = object()


def _instance_dict_if_present(obj: Any) -> dict | None:
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


# -- showing and re-reading steps -----------------------------------------------------------------
def render(root: Root, steps: tuple[Step, ...], key_text: Callable[[int], str | None],
           module_type: type | None = None) -> str:
    """The path text a user would type: ``model.layers[3].mlp.up_proj.weight``, ``d['k'][2]``."""
    parts: list[str] = [root.name]
    as_attr = False  # the next key step names an attribute (an instance's or a module's __dict__)
    module_child = False  # the next key step names a module's parameter, buffer or submodule
    for step in steps:
        tag = step[0]
        text = ""
        if tag == "":
            if len(step) > 1 and step[1] == "__closure__":
                text = ".__closure__"
            elif len(step) > 1 and step[1] == "cache":
                text = ".cache"
            as_attr = len(step) == 1
            parts.append(text)
            continue
        if tag == "key":
            key = step[1]
            if module_child and type(key) is str:
                text = f"[{key}]" if key.isdigit() else f".{key}"
            elif as_attr and type(key) is str and key.isidentifier():
                text = f".{key}"
            elif as_attr and type(key) is str:  # an attribute no `obj.name` can spell: as it is reached
                text = f".__dict__[{_key_repr(key)}]"
            else:
                text = f"[{_key_repr(key)}]"
            module_child = as_attr and type(key) is str and key in _MODULE_CHILD_DICTS
            if module_child:
                parts.append("")
                as_attr = False
                continue
        elif tag == "attr":
            text = f".{step[1]}"
            module_child = step[1] in _MODULE_CHILD_DICTS
            if module_child:
                parts.append("")
                as_attr = False
                continue
        else:
            module_child = False
            if tag == "keytype":
                text = f"[<{step[1]} key>]"
            elif tag == "keypath":
                shown = key_text(step[1])
                text = f"[{shown}]" if shown is not None else f"[<{step[2]} key>]"
            elif tag == "iskey":
                text = f".keys()[<{step[1]}>]"
            elif tag == "index":
                text = f"[{step[1]}]"
            elif tag == "member":
                text = f"{{#{step[1]}}}"
            elif tag == "closure":
                text = f"[{step[1]}]"
            elif tag == "cell":
                text = ".cell_contents"
            elif tag == "tb":
                text = ""
            elif tag == "local":
                text = f" → frame {step[1]} → local {step[2]}"
            elif tag == "cache":
                text = ".cache[…]"
            elif tag == "flat":
                text = f"[{step[1]}]" if len(step) > 2 and step[2] == 1 else f".flat[{step[1]}]"
            elif tag == "via":
                text = f"→{step[1]}"
            elif tag == "pandas":
                text = f"[{_key_repr(step[1])}].iloc[{step[2]}]"
            elif tag == "elide":
                text = " … "
        as_attr = False
        parts.append(text)
    shown = [p for p in parts[1:] if p]
    if len(shown) > MAX_SHOWN_STEPS:
        shown = shown[:8] + [" … "] + shown[-8:]
    return parts[0] + "".join(shown)


def _key_repr(key: Any) -> str:
    try:
        text = repr(key)  # plain keys only: str, int, float, bool, bytes, None
    except Exception:
        return f"<{_qualname(type(key))} key>"
    return text if len(text) <= 80 else text[:77] + "..."


def resolve(obj: Any, steps: tuple[Step, ...], items: dict[Any, Any] | None = None,
            variables: dict[str, Any] | None = None) -> Any:
    """Follow remembered steps from ``obj`` with C-level reads; _MISSING where a step no longer holds.

    Only steps that can be re-read without running code are followed (plain dict keys, indexes,
    instance attributes and slots, closure cells, set members and object-array items by position);
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
                    return _MISSING
                obj = obj.__closure__
                continue
            if len(step) > 1:
                return _MISSING
            if type(obj) is types.FunctionType:
                obj = _function_dict(obj) or {}
                continue
            pending_attr = True
            continue
        if tag == "key":
            if pending_attr:
                pending_attr = False
                obj = _read_attribute(obj, step[1])
            elif type(obj) is dict or mro_has(type(obj), dict) and is_plain_key(step[1]):
                obj = dict.get(obj, step[1], _MISSING)
            else:
                return _MISSING
        elif tag == "attr":
            obj = _read_attribute(obj, step[1])
        elif tag == "index":
            cls = type(obj)
            try:
                if cls is list or cls is tuple:
                    obj = obj[step[1]]
                elif mro_has(cls, list):
                    obj = list.__getitem__(obj, step[1])
                elif mro_has(cls, tuple):
                    obj = tuple.__getitem__(obj, step[1])
                elif mro_has(cls, _deque()):
                    listed = _listed(obj, "index", items)
                    if listed is None or not 0 <= step[1] < len(listed):
                        return _MISSING
                    obj = listed[step[1]]
                else:
                    return _MISSING
            except IndexError:
                return _MISSING
        elif tag == "keyat":
            if variables is None or step[1] not in variables or not mro_has(type(obj), dict):
                return _MISSING
            key = resolve(variables[step[1]], step[2], items, None)
            if key is _MISSING:
                return _MISSING
            by_key = _values_by_key_identity(obj, items)
            obj = by_key.get(id(key), _MISSING)
            if obj is not _MISSING and obj[0] is not key:
                return _MISSING
            obj = obj[1] if obj is not _MISSING else _MISSING
        elif tag == "grad":
            obj = _tensor_grad(obj)
        elif tag == "member" or tag == "flat":
            listed = _listed(obj, tag, items)
            if listed is None or not 0 <= step[1] < len(listed):
                return _MISSING
            obj = listed[step[1]]
        elif tag == "closure":
            if not mro_has(type(obj), tuple):
                return _MISSING
            try:
                obj = tuple.__getitem__(obj, step[1])
            except IndexError:
                return _MISSING
        elif tag == "cell":
            if type(obj) is not types.CellType:
                return _MISSING
            try:
                obj = obj.cell_contents
            except ValueError:
                return _MISSING
        else:
            return _MISSING
        if obj is _MISSING:
            return _MISSING
    return _MISSING if pending_attr else obj


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
    """A leaf tensor's ``.grad`` read through TensorBase with subclass code off; _MISSING if none."""
    torch = sys.modules.get("torch")
    try:
        base = torch._C.TensorBase
        if not mro_has(type(tensor), base):
            return _MISSING
        with torch._C.DisableTorchFunctionSubclass():
            if not base.is_leaf.__get__(tensor):
                return _MISSING
            grad = base.grad.__get__(tensor)
    except Exception:
        return _MISSING
    return _MISSING if grad is None else grad


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
        listed = _array_items(obj, ndarray)
    else:
        listed = list(_deque().__iter__(obj))
    if items is not None:
        items[id(obj)] = (obj, listed)
    return listed


def _read_attribute(obj: Any, name: Any) -> Any:
    """``obj.name`` read without running code: a slot's member descriptor, or the instance's own value."""
    if type(name) is not str:
        return _MISSING
    cls = type(obj)
    if cls is dict:  # a module's child dicts are walked as dicts with attribute-looking keys
        return dict.get(obj, name, _MISSING)
    try:
        mro = _type_mro(cls)
    except Exception:
        return _MISSING
    for klass in mro:
        found = _type_dict(klass).get(name, _MISSING)
        if found is not _MISSING:
            if type(found) is types.MemberDescriptorType:
                try:
                    return found.__get__(obj, cls)
                except AttributeError:
                    return _MISSING
            if klass is BaseException and type(found) is types.GetSetDescriptorType:
                return found.__get__(obj, cls)
            return _MISSING  # a property or other descriptor: reading it could run code
    if not plain_dict_slot(cls):
        return _MISSING
    try:
        # The name is no descriptor of the class: this reads the instance's own value (inline or in
        # its dict) without making a dict or calling __getattr__.
        return object.__getattribute__(obj, name)
    except AttributeError:
        return _MISSING


MISSING = _MISSING  # what resolve() returns where a remembered step no longer holds
