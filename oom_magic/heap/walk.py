"""Reach what the roots hold through the interpreter's own traversal, and name the way to a few objects.

The walk is breadth-first over ``gc.get_referents`` (each type's C-level ``tp_traverse``), so
no Python code of the user's ever runs and every holder is reached (deques, lru caches,
``functools.partial``, closures, slots, C extension containers) without per-type code. It
works a level at a time in bulk C-level passes (``map``, ``compress``, set difference on ids),
keeps the id of each object visited and, in the order reached, its parent; it never hashes or compares a
user's object or type: membership is by ``id``. An object whose reference count says its one owner
alone holds it (most of a heap) can be reached no other way: it is kept with no visited lookup.
A slice's children are read into one flat list (exact builtin containers, dict values and
namedtuples through their own C iterators, other objects through ``gc.get_referents``), its atoms
(ints, strings: untracked) dropped before any other read, and a child's parent is found back from
its position in that list (``children.Parents``) only for the objects being named. Records
(instances of classes written in Python, ``kinds.RECORD``) are read without their class, which
their traversal visits last and the walk never enters: a slice of one class in one call.

Never entered: modules, classes, code, builtin functions and descriptors; a function is entered
through its closure, defaults and ``__dict__`` only (its ``__globals__`` would lead everywhere),
a frame through its locals. Untracked numpy object arrays are expanded by their items. Paths
through a dict's *keys* are taken only after everything reachable through values, attributes and
indexes (an optimizer's ``state`` is keyed by the parameters a model names); an optimizer and a
bound method (a PEFT model keeps its base model's) are entered once everything else is walked.

Names are made after the walk, for the objects asked about only: ``names`` climbs from each to its
root (a chain a segment at a time, ``chain_above``), ``links`` reads each link, ``path_text``
shows the steps, ``resolve`` re-reads a remembered path; the C-level reads they share: ``reads``.
"""
from __future__ import annotations

import gc
import operator
import sys
import time
import types
from itertools import chain, compress, count, islice, repeat
from typing import Any
from collections.abc import Iterable

from ..records.snapshot import HolderKind
from .children import ONCE_FOLLOWED, ONCE_ITERATED, ONCE_LISTED, Parents
from .kinds import (DICT, DICT_ID, DICT_OFFSET, FRAME, FUNCTION, GENERIC, LATER, NDARRAY, RECORD, ROW, SEQ, TIE_ORDER,
                    classify, later_types)
from .reads import array_items, function_dict, mro_has

# Bulk passes work on this many parents at a time, so one huge container cannot overrun a deadline.
SLICE = 8192
# Levels this narrow are walked object by object (cheaper than the bulk passes' fixed cost).
NARROW = 4
# A chain is followed through objects of at most this many referents (more: the bulk passes read it).
_FOLLOW_WIDEST = 64
# How a segment's parents sit: a level's (none among its ids), a followed chain's (each but the first
# is one of its ids).
LEVELS, CHAIN = 0, 1


class _Several(list):
    """The objects one link of a chain reached, where it reached more than one (never a user's list)."""


class Root:
    """A starting point of the walk: its holder kind and the name the user knows it by."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: HolderKind, name: str) -> None:
        self.kind, self.name = kind, name


def _beside_items(mapping: dict) -> list[Any]:
    """What a dict subclass's traversal reaches besides its keys and values: its attributes (or the
    attribute dict it already has), its class, a defaultdict's factory."""
    items = set(map(id, dict.values(mapping))) | set(map(id, dict.keys(mapping)))
    return [ref for ref in gc.get_referents(mapping) if id(ref) not in items]


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
        self.ndarray: Any = getattr(numpy, "ndarray", None)  # numpy.ndarray, or None without numpy
        # Held while walking: a skipped object or a root is never taken for one held by one owner alone.
        self._pinned: list[Any] = list(skip)
        self._skip = frozenset(map(id, self._pinned))
        self.visited: set[int] = set(self._skip)  # never entered: the skipped objects
        self.roots: dict[int, Root] = {}
        # (ids, their parents: a list or a Parents, how parents sit: LEVELS or CHAIN): a
        # parent is always reached before its children, so one backwards pass finds every ancestor.
        self._segments: list[tuple[list[int], list[Any] | Parents, int]] = []
        # id -> (chain segment, place): each one's last object, each wanted tensor met on one (chain_above)
        self._chain_at: dict[int, tuple[int, int]] = {}
        self.wanted = wanted if wanted is not None else {}
        self._wanted_ids = set(self.wanted)
        self.storages_left = len(set(self.wanted.values()))
        self.found: dict[int, int] = {}  # storage key -> id(first tensor reaching it)
        self.indexes: dict[int, int] = {}  # id -> its index in the sequence parents_of gave as its parent
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
        self._later: list[Any] = []  # reached optimizers and bound methods, entered once all else is walked
        self._wrapper_dicts: set[int] = set()  # ids of functools.wraps wrappers' __dict__s (entered last)
        self._big: list[Any] = []  # containers too big to read in one pass, read in slices
        self._later_types = later_types()

    # -- walking -------------------------------------------------------------------------------
    def start(self, kind: HolderKind, roots: Iterable[tuple[str, object]]) -> None:
        """Queue roots of one holder kind (walked by ``run``); a root already reached is skipped."""
        visited = self.visited
        for name, obj in roots:
            if id(obj) not in visited:
                visited.add(id(obj))
                self.roots[id(obj)] = Root(kind, name)
                self._pinned.append(obj)
                self._level.append(obj)
                self._note_wanted((id(obj),))
        self.exhausted = False

    def run(self) -> None:
        """Walk from the queued roots until done, every wanted storage is reached, or out of budget."""
        while self.complete and not self.done:
            if not self._level and self._later:
                later, self._later = self._later, []
                kids, parents, once = self._expand(later, defer=False)
                self._level = self._mark(kids, parents, once)
                del kids, parents, once, later
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
                level, key_parents = self._keys, self._key_parents
                self._keys, self._key_parents = [], []
                self._level = self._mark(level, key_parents)  # tracked keys alone
                continue
            level, self._level = self._level, []
            if len(level) <= NARROW:
                self._level = self._narrow(level)
                continue
            following = []
            for start in range(0, len(level), SLICE):
                kids, parents, once = self._expand(level[start:start + SLICE])
                stop = self._mark_slices(kids, parents, once, following)
                del kids, parents, once
                if stop:
                    break
            self._level = following

    def _mark_slices(self, kids: list[Any], parents: list[Any] | Parents, once: list[bool] | None,
                     following: list[Any]) -> bool:
        """Mark children a slice at a time (one huge container too), on the clock; True: stop now."""
        for at in range(0, len(kids), SLICE):
            part = once[at:at + SLICE] if once is not None else None
            ups = parents.part(at) if isinstance(parents, Parents) else parents[at:at + SLICE]
            following.extend(self._mark(kids[at:at + SLICE], ups, part))
            if self._out_of_budget() or self.done:
                return True
        return False

    def _narrow(self, level: list[Any]) -> list[Any]:
        """Levels of a few objects (a linked list, a deep chain) one object at a time: the bulk
        passes cost microseconds per level whatever its width, a 200,000-deep chain seconds."""
        while level and len(level) <= NARROW and self.complete and not self.done:
            if len(level) == 1:
                level = self._follow(level[0])
                continue
            following: list[Any] = []
            for obj in level:
                following.extend(self._follow(obj, links=1))
            level = following
        return level

    def _follow(self, obj: Any, links: int = -1) -> list[Any]:
        """Follow a chain of plain objects (a linked list's nodes) while each holds exactly one object
        not reached before, at most ``links`` links (-1: no end): no level list per link, and whether
        the walk is done asked only after a wanted tensor was met. Returns the level where it stops:
        none, several objects, the last one reached, or what the bulk passes read from one that is
        not plain (or big)."""
        visited, cats, is_tracked, ndarray = self.visited, self._cats, gc.is_tracked, self.ndarray
        wanted_ids, collect, get_referents, refs = self._wanted_ids, self.collect, gc.get_referents, sys.getrefcount
        last_class, record = None, False  # a list's nodes share one class: looked up once
        level: list[Any] | None = None
        bulk = False
        while level is None and not bulk:
            ids: list[int] = []
            parents: list[Any] = []
            for _ in range(256):  # a segment of links, then the clock
                cls = type(obj)
                if cls is not last_class:
                    cat = cats.get(id(cls))
                    if cat != RECORD and cat != GENERIC:
                        bulk = True
                        break
                    last_class, record = cls, cat == RECORD
                    if record:
                        visited.add(id(cls))
                kids = get_referents(obj)
                if len(kids) > _FOLLOW_WIDEST:
                    bulk = True
                    break
                if record and kids and kids[-1] is cls:  # a record's class ends its traversal: never entered
                    kids.pop()
                following: Any = None  # the one new object; a _Several once there are more
                met_wanted = False
                for kid in kids:
                    if is_tracked(kid) or type(kid) is ndarray:  # atoms (a node's int) first: no id made
                        kid_id = id(kid)
                        if refs(kid) != ONCE_FOLLOWED:  # one owner alone: reached no other way
                            if kid_id in visited:
                                continue
                            visited.add(kid_id)
                        ids.append(kid_id)
                        parents.append(obj)
                        if following is None:
                            following = kid
                        elif type(following) is _Several:
                            following.append(kid)
                        else:
                            following = _Several((following, kid))
                        if kid_id in wanted_ids:
                            self._chain_at[kid_id] = (len(self._segments), len(ids) - 1)
                            self._note_wanted((kid_id,))
                            met_wanted = True
                        if collect is not None and id(type(kid)) in collect:
                            self.met.append(kid)
                            visited.add(kid_id)  # looked up when naming, even where its owner alone holds it
                if following is None or type(following) is _Several:
                    level = list(following) if following is not None else []
                    break
                obj = following
                links -= 1
                if links == 0 or (met_wanted and self.done):
                    level = [obj]
                    break
            if ids:
                self._chain_at[ids[-1]] = (len(self._segments), len(ids) - 1)
                self._segments.append((ids, parents, CHAIN))
                self.nodes += len(ids)
                if self._out_of_budget():
                    return level if level is not None else [obj]
        if level is None:  # not a plain object, or a big one: the bulk passes read it
            level = []
            kids, parents_, once = self._expand([obj])
            self._mark_slices(kids, parents_, once, level)
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

        for seg_ids, seg_parents, how in reversed(self._segments):
            if not wanted:
                break
            if how == CHAIN:  # a deep chain: its parents sit in the segment itself, so all of it is taken
                if wanted.isdisjoint(seg_ids):
                    continue
                result.update(zip(seg_ids, seg_parents))  # each id once in a walk: nothing overwritten
                wanted.difference_update(seg_ids)
                up = id(seg_parents[0])  # the one parent from before the segment
                if up in roots:
                    result[up] = roots[up]
                elif up not in result:
                    wanted.add(up)
            else:
                if wanted.isdisjoint(seg_ids):  # stops at the first hit: a full pass only where none is
                    continue
                at = list(compress(count(), map(wanted.__contains__, seg_ids)))
                kids = list(map(seg_ids.__getitem__, at))
                ups = (seg_parents.of(at, self.indexes, kids) if isinstance(seg_parents, Parents)
                       else list(map(seg_parents.__getitem__, at)))
                result.update(zip(reversed(kids), reversed(ups)))  # reversed: a child's first parent wins
                wanted.difference_update(kids)
                for up in set(map(id, ups)).difference(result):  # no parent sits in its child's segment
                    if up in roots:
                        result[up] = roots[up]
                    else:
                        wanted.add(up)
        return result

    def chain_above(self, obj_id: int) -> tuple[list[int], list[Any], int] | None:
        """From an object indexed on a chain (``_chain_at``; else None), a climb a segment at a time: the ids
        climbed (it first), their parents, the id above. In a chain segment an object's parent is the one
        before it, but for the second and later of those its last node holds (the chain stopped there)."""
        place = self._chain_at.get(obj_id)
        if place is None:
            return None
        segment, at = place
        seg_ids, seg_parents, _ = self._segments[segment]
        assert type(seg_parents) is list  # a chain segment's parents are listed
        if not at or id(seg_parents[at]) == seg_ids[at - 1]:
            return seg_ids[at::-1], seg_parents[at::-1], id(seg_parents[0])
        holder = seg_parents[at]
        if holder is seg_parents[0]:  # held by the node before the segment: one link
            return [obj_id], [holder], id(holder)
        node = seg_ids.index(id(holder), max(0, at - _FOLLOW_WIDEST - 1), at)  # its last node: on from it
        return [obj_id] + seg_ids[node::-1], [holder] + seg_parents[node::-1], id(seg_parents[0])

    @property
    def done(self) -> bool:
        return bool(self.wanted) and self.storages_left == 0

    def release(self) -> None:
        """Drop every reference the walk holds (parents, queues): nothing is pinned after a scan."""
        for held in (self.visited, self.roots, self._pinned, self._segments, self._chain_at, self.found, self.indexes,
                     self.met, self._level, self._keys, self._key_parents, self._frames, self._later,
                     self._wrapper_dicts, self._big, self._types):
            held.clear()

    def _out_of_budget(self) -> bool:
        if self.nodes >= self.budget_nodes or time.perf_counter() > self.deadline:
            self.complete = False
        return not self.complete

    def _expand(self, level: list[Any], defer: bool = True) -> tuple[list[Any], Parents, list[bool]]:
        """What one slice of a level refers to (tracked objects and object arrays), their parents, and
        whether that parent is all that holds each (the same length)."""
        cats = self._cats
        first = type(level[0])
        # A level of one type (a list of records): its type read once more, no id per object.
        tids = [] if all(map(operator.is_, map(type, level), repeat(first))) else list(map(id, map(type, level)))
        present_types = set(tids) if tids else {id(first)}
        unknown = present_types.difference(cats)
        if unknown:
            for obj in level:
                tid = id(type(obj))
                if tid in unknown:
                    cats[tid] = classify(type(obj), self.ndarray, self._later_types)
                    self._types.append(type(obj))
                    unknown.discard(tid)
                    if not unknown:
                        break
        present = set(map(cats.__getitem__, present_types))
        # Each object's kind only where a slice mixes kinds (a level of one type needs no second pass).
        kinds = list(map(cats.__getitem__, tids)) if len(present) > 1 else []
        kids: list[Any] = []
        parents = Parents()
        once: list[bool] = []
        # Ties go to what is named by a key or index: a dict's values before generic referents.
        for what in sorted(present, key=TIE_ORDER.__getitem__):
            objs = level if len(present) == 1 else list(compress(level, map(what.__eq__, kinds)))
            if what == LATER and defer:
                self._later.extend(objs)
            elif what == GENERIC or what == LATER:
                self._extend_listed(kids, parents, once, objs, list(map(gc.get_referents, objs)))
            elif what == RECORD:
                self._extend_records(kids, parents, once, objs, [t for t in present_types if cats[t] == RECORD])
            elif what == SEQ:
                if max(map(len, objs)) > SLICE:  # a huge container is read a slice at a time, on the clock
                    self._big.extend(o for o in objs if len(o) > SLICE)
                    objs = [o for o in objs if len(o) <= SLICE]
                # Exact builtin containers: iterated by their own C code, no list per container.
                self._extend(kids, parents, once, objs, list(chain.from_iterable(objs)), map(len, objs),
                             ONCE_ITERATED, sequence=True)
            elif what == ROW:  # read as a tuple: its own C iterator, never the subclass's __iter__
                self._extend(kids, parents, once, objs, list(chain.from_iterable(map(tuple.__iter__, objs))),
                             map(tuple.__len__, objs), ONCE_ITERATED, sequence=True)
            elif what == DICT:
                if self._wrapper_dicts and defer:
                    self._later.extend(d for d in objs if id(d) in self._wrapper_dicts)
                    objs = [d for d in objs if id(d) not in self._wrapper_dicts]
                    if not objs:
                        continue
                # A dict subclass's own attributes (`c.t` on a `class Cfg(dict)`): whatever its traversal
                # reaches besides its items, never an attribute dict made for the asking.
                owned = [d for d in objs if type(d) is not dict and DICT_OFFSET(type(d)) != 0] \
                    if any(t != DICT_ID and cats[t] == DICT for t in present_types) else []
                if owned:
                    self._extend_listed(kids, parents, once, owned, list(map(_beside_items, owned)))
                if max(map(dict.__len__, objs)) > SLICE:
                    self._big.extend(d for d in objs if dict.__len__(d) > SLICE)
                    objs = [d for d in objs if dict.__len__(d) <= SLICE]
                self._extend(kids, parents, once, objs, list(chain.from_iterable(map(dict.values, objs))),
                             map(dict.__len__, objs), ONCE_ITERATED)
                if any(map(gc.is_tracked, chain.from_iterable(map(dict.keys, objs)))):
                    self._defer_keys(objs)
            elif what == FUNCTION:
                lists = [[c for c in (f.__closure__, f.__defaults__, f.__kwdefaults__,
                                      function_dict(f)) if c is not None] for f in objs]
                self._extend_listed(kids, parents, once, objs, lists)
                # functools.wraps copies the wrapped object's __dict__ into the wrapper's (torch.compile
                # wraps the model: `cm.forward._modules`): entered last, after the object's own names.
                self._wrapper_dicts.update(id(d) for f in objs if (d := function_dict(f)) is not None
                                           and "__wrapped__" in d)
            elif what == FRAME:
                self._extend_listed(kids, parents, once, objs, [self._frame_locals(f) for f in objs])
            elif what == NDARRAY:
                self._extend_listed(kids, parents, once, objs, [array_items(a, self.ndarray) for a in objs])
        return kids, parents, once

    def _extend_records(self, kids: list[Any], parents: Parents, once: list[bool], objs: list[Any],
                        classes: list[int]) -> None:
        """``_extend`` for records (instances of classes defined in Python: their traversal ends with
        their class, never entered). Records of one class with as many referents each (a list of
        one dataclass) are read in one ``gc.get_referents`` call, no list per record: the class
        found exactly once in each record's place, at its end and nowhere else, proves the split."""
        if len(classes) == 1:
            flat = gc.get_referents(*objs)
            count, cls = len(objs), type(objs[0])
            each = len(flat) // count
            if each and len(flat) == each * count and all(map(operator.is_, flat[each - 1::each], repeat(cls))):
                del flat[each - 1::each]
                if not any(map(operator.is_, flat, repeat(cls))):  # the class nowhere else: the split holds
                    self.visited.update(classes)
                    self._extend(kids, parents, once, objs, flat, repeat(each - 1, count), ONCE_ITERATED)
                    return
            del flat
        lists = list(map(gc.get_referents, objs))
        self._drop_classes(objs, lists, classes)
        self._extend_listed(kids, parents, once, objs, lists)

    def _drop_classes(self, objs: list[Any], lists: list[list[Any]], classes: list[int]) -> None:
        """Take each record's class off the end of its referents (a class is never entered, and it
        was half of what a level of records reached); ``classes``: the records' type ids, reached.
        Where a class's traversal does not end with the class, it is put back and walked as GENERIC."""
        if not all(lists):
            return
        last = list(map(list.pop, lists))
        if all(map(operator.is_, last, map(type, objs))):
            self.visited.update(classes)
            return
        list(map(list.append, lists, last))
        self._cats.update(zip(classes, repeat(GENERIC)))

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
            start = 0
            while True:
                part = list(islice(it, SLICE))
                if not part:
                    break
                # One owner whose children's positions are their indexes (a dict's: its values' order).
                kids: list[Any] = []
                parents = Parents()
                once: list[bool] = []
                kept = self._keep_tracked(kids, once, part, ONCE_ITERATED)
                parents.add([obj], [len(part)], kept, len(kids),
                            sequence=not (type(obj) is dict or mro_has(type(obj), dict)), first=start)
                start += len(part)
                following.extend(self._mark(kids, parents, once))
                del part, kids
                if self._out_of_budget() or self.done:
                    return True
        return False

    def _extend_listed(self, kids: list[Any], parents: Parents, once: list[bool], objs: list[Any],
                       lists: list[list[Any]]) -> None:
        """``_extend`` for children read into a list per owner."""
        self._extend(kids, parents, once, objs, list(chain.from_iterable(lists)), map(len, lists), ONCE_LISTED)

    def _extend(self, kids: list[Any], parents: Parents, once: list[bool], objs: list[Any], flat: list[Any],
                lens: Iterable[int], held: tuple[int, int], sequence: bool = False) -> None:
        """Add the tracked objects and object arrays of ``flat`` (``objs``' children, ``lens`` of each),
        their parents and whether that parent alone holds each (``held``: the reference counts that
        says so, ``_once_counts``). Most children are atoms (ints, strings), dropped before other reads."""
        before = len(kids)
        kept = self._keep_tracked(kids, once, flat, held)
        parents.add(objs, lens, kept, len(kids) - before, sequence)

    def _keep_tracked(self, kids: list[Any], once: list[bool], flat: list[Any], held: tuple[int, int]) -> bytes | None:
        """Append the tracked objects and object arrays of ``flat`` to ``kids`` and whether one owner
        alone holds each to ``once``; which of ``flat`` were kept, a byte each (None: all)."""
        if not flat:
            return None
        mask = list(map(gc.is_tracked, flat))
        if all(mask):
            once.extend(map(held[0].__eq__, map(sys.getrefcount, flat)))  # before kids holds them too
            kids.extend(flat)
            return None
        self._keep_arrays(flat, mask)
        if not any(mask):
            return None
        kept = list(compress(flat, mask))
        once.extend(map(held[1].__eq__, map(sys.getrefcount, kept)))
        kids.extend(kept)
        return bytes(mask)

    def _keep_arrays(self, objs: list[Any], mask: list[bool]) -> None:
        """Set ``mask`` for the numpy arrays among ``objs``: untracked by gc, an object array holds objects."""
        ndarray = self.ndarray
        # By identity over every child: cheaper than picking out the untracked ones first.
        if ndarray is not None and any(map(operator.is_, map(type, objs), repeat(ndarray))):
            for i in compress(count(), map(operator.is_, map(type, objs), repeat(ndarray))):
                mask[i] = True

    def _mark(self, kids: list[Any], parents: list[Any] | Parents, once: list[bool] | None = None) -> list[Any]:
        """Keep the children (tracked objects and object arrays: ``_keep_tracked``'s) not reached before;
        record parents.

        ``once``: for each child, whether its parent alone holds it (never reached another way, so
        not looked up in ``visited`` nor added to it); None: every child is looked up.
        """
        ids = list(map(id, kids))
        if once is None or not any(once):
            new = set(ids).difference(self.visited)  # iterates the slice, not everything visited
            keep: list[bool] | None = list(map(new.__contains__, ids))
        elif all(once):
            new, keep = set(), None
        else:
            new = set(compress(ids, map(operator.not_, once))).difference(self.visited)
            keep = list(map(operator.or_, once, map(new.__contains__, ids))) if new else once
        self.visited.update(new)
        if keep is not None:
            ids = list(compress(ids, keep))
            parents = parents.keep(keep) if isinstance(parents, Parents) else list(compress(parents, keep))
            kids = list(compress(kids, keep))  # a child twice in one slice is expanded twice (harmless)
        if not ids:
            return []
        self._segments.append((ids, parents, LEVELS))
        self.nodes += len(ids)
        if self.wanted:
            self._note_wanted(ids)
        if self.collect is not None:
            tensors = list(compress(kids, map(self.collect.__contains__, map(id, map(type, kids)))))
            self.visited.update(map(id, tensors))  # looked up when naming
            self.met.extend(tensors)
        return kids

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
