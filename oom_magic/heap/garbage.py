"""Find the tensors that sit in unreachable reference cycles, without collecting them; and next
time, re-verify the garbage found last time instead of searching for it again.

The search climbs the tensors' referrers (each level one pass over the heap, ``referrers_of``;
no climb from an ancestor whose every reference comes from inside the set) and runs the
collector's own test on the ancestors found. What it finds garbage is remembered as the ids of the cycle's members and weak references to those that take one (no
strong reference: the collector may still free them). The next scan rebuilds the set by
descending from those members through ``gc.get_referents``, restricted to the ids remembered,
and runs the same test on it: a set whose every reference comes from inside it, with no root
among its members, is unreachable whatever else changed. Any doubt (a member freed or changed,
an id reused, a reference from outside) and the storage is searched for as on a first scan.
"""
from __future__ import annotations

import gc
import sys
import time
import types
import weakref
from typing import Any

from .referrers import referrers_of
from .storages import LiveTensors

# The garbage found by the last searches, a group per search: weak references to its members that
# take one, the ids of all its members, and the storages it held. Never a strong reference.
_LAST: list[tuple[tuple[weakref.ref, ...], frozenset[int], frozenset[int]]] = []
_GROUPS_KEPT = 8
# Where a level's referrers are looked for, in turn: the young generations, then the whole heap.
_GENERATIONS = (0, 1, None)


def forget_garbage() -> None:
    """Drop the remembered garbage (the next scan searches from scratch)."""
    _LAST.clear()


def _remember(members: list[Any], storages: set[int]) -> None:
    if not storages or not members:
        return
    refs = []
    for obj in members:
        try:
            refs.append(weakref.ref(obj))
        except TypeError:  # dicts, lists, tuples: reached again from a member that takes one
            continue
    if refs:
        _LAST.append((tuple(refs), frozenset(map(id, members)), frozenset(storages)))
        del _LAST[:-_GROUPS_KEPT]


def still_garbage(live: LiveTensors, claimed: dict[int, Any]) -> set[int]:
    """Storages of ``live`` that the garbage found last time still holds alone, re-verified now.

    Costs a descent through the remembered members, not a climb through the heap: no
    ``gc.get_referrers`` pass. ``claimed``: storages already given a holder (left out).
    """
    found: set[int] = set()
    for group in list(_LAST):
        refs, ids, storages = group
        if not any(key in live.sizes and key not in claimed for key in storages):
            if not any(ref() is not None for ref in refs):
                _LAST.remove(group)  # collected: nothing left to re-verify
            continue
        confirmed = _verify(live, refs, ids)
        if confirmed:
            found |= confirmed
        else:
            _LAST.remove(group)  # changed: searched again, and remembered anew
    return {key for key in found if key not in claimed}


def _verify(live: LiveTensors, refs: tuple[weakref.ref, ...], ids: frozenset[int]) -> set[int]:
    """The storages a remembered group still holds as garbage alone (none if anything changed)."""
    members: list[Any] = []
    index: dict[int, int] = {}
    for ref in refs:
        obj = ref()
        if obj is not None and id(obj) not in index:
            index[id(obj)] = len(members)
            members.append(obj)
        del obj
    at = 0
    while at < len(members):  # the members reached from those: children remembered by id
        for child in gc.get_referents(members[at]):
            if id(child) in ids and id(child) not in index:
                index[id(child)] = len(members)
                members.append(child)
        at += 1
    child = None  # the loop variable would count as an outside reference
    tensors = {id(t) for t in live.tensors}
    inside = [i for i, o in enumerate(members) if id(o) in tensors]
    if not inside:
        members.clear()
        return set()
    # The tensors' only references must be those the members hold: drop ours while counting.
    live.tensors[:] = [t for t in live.tensors if id(t) not in index]
    try:
        external = {id(o) for o in members if _is_root_like(o)}
        marked = _reachable_ancestors(members, index, external)
        found = {live.storage_of[id(members[i])] for i in inside if i not in marked}
        alive = {live.storage_of[id(members[i])] for i in inside if i in marked}
    finally:
        live.tensors.extend(members[i] for i in inside)
        members.clear()
    # A storage is garbage only when every tensor viewing it is (a view held elsewhere keeps it).
    viewed_elsewhere = {live.storage_of[id(t)] for t in live.tensors if id(t) not in index}
    return found - alive - viewed_elsewhere


def garbage_storages(live: LiveTensors, unclaimed: list[Any], *, budget_objects: int = 20_000,
                      budget_seconds: float = 2.0, referrers: dict[int, list[Any]] | None = None) -> set[int]:
    """Storages whose tensors sit in unreachable reference cycles, found without collecting.

    A saving ``gc.collect()`` would clear the user's weakrefs and run finalizers; instead this
    runs the collector's own test on the tensors' ancestors: an object is reachable when
    something outside the ancestor set refers to it (its refcount exceeds the references from
    inside), or when a reachable ancestor refers to it. Where the budget runs out, the unexplored
    objects count as reachable, so a tensor is never called garbage by mistake.

    ``referrers`` (given): filled with id(object) -> every object referring to it, in the heap's
    order, for each object whose referrers the whole heap was searched for or whose one reference
    comes from another ancestor (a chain climbs them again).
    """
    deadline = time.perf_counter() + budget_seconds
    keys = {id(t): live.storage_of[id(t)] for t in unclaimed}
    # The ancestor list holds the only references we keep, so refcounts can be accounted exactly.
    ancestors: list[Any] = list(unclaimed)
    live.tensors[:] = [t for t in live.tensors if id(t) not in keys]
    unclaimed.clear()
    index = {id(o): i for i, o in enumerate(ancestors)}
    external: set[int] = set()
    frontier = list(range(len(ancestors)))  # indices into ancestors: the objects to climb from
    order: dict[int, list[int]] = {}  # id(object) -> ids of its referrers in the heap's order
    while frontier:
        if len(ancestors) > budget_objects or time.perf_counter() > deadline:
            external.update(id(ancestors[i]) for i in frontier)
            break
        new: list[int] = []
        # The young generations first (a cell's garbage is young): the older ones only for the
        # objects something outside the set still refers to.
        for generation in _GENERATIONS:
            targets = [ancestors[i] for i in frontier]
            found = referrers_of(targets, generation)
            targets.clear()
            ignore = {id(ancestors), id(targets), id(live.tensors), id(index), id(found)}
            if referrers is not None and generation is None:
                _note_order(found, {id(ancestors[i]) for i in frontier}, ignore, order)
            for referrer in found:
                if id(referrer) in ignore or id(referrer) in index:
                    continue
                index[id(referrer)] = len(ancestors)
                ancestors.append(referrer)
                if _is_root_like(referrer):
                    external.add(id(referrer))  # module globals, classes, running frames: always reachable
                else:
                    new.append(len(ancestors) - 1)
            del found, targets
            referrer = None  # the loop variable would count as an outside reference
            frontier = _unexplained(ancestors, index, frontier)
            if not frontier:
                break
        frontier = _unexplained(ancestors, index, new)
    marked = _reachable_ancestors(ancestors, index, external)
    if referrers is not None:
        sole = _sole_referrers(ancestors, index)
        # The counts are read: references may be kept now.
        referrers.update((oid, [ancestors[index[r]] for r in ids]) for oid, ids in order.items())
        for child, holder in sole.items():
            referrers.setdefault(id(ancestors[child]), [ancestors[holder]])
    garbage = {keys[id(o)] for i, o in enumerate(ancestors) if id(o) in keys and i not in marked}
    alive = {keys[id(o)] for i, o in enumerate(ancestors) if id(o) in keys and i in marked}
    _remember([o for i, o in enumerate(ancestors) if i not in marked], garbage - alive)
    live.tensors.extend(o for o in ancestors if id(o) in keys)
    ancestors.clear()
    # A storage is garbage only when every tensor viewing it is.
    return garbage - alive


def _note_order(found: list[Any], searched: set[int], ignore: set[int], order: dict[int, list[int]]) -> None:
    """Append each referrer's id, in the heap's order, to the list of every searched object it refers to."""
    for referrer in found:
        if id(referrer) not in ignore:
            for child in gc.get_referents(referrer):
                if id(child) in searched:
                    order.setdefault(id(child), []).append(id(referrer))


def _sole_referrers(ancestors: list[Any], index: dict[int, int]) -> dict[int, int]:
    """Ancestor -> the one ancestor that refers to it, where that one reference is all it has (no
    search was needed: its referrers are known, and their order too)."""
    holder_of: dict[int, int] = {}
    twice: set[int] = set()
    for at, holder in enumerate(ancestors):
        for child in gc.get_referents(holder):
            i = index.get(id(child))
            if i is not None:
                if i in holder_of:
                    twice.add(i)
                else:
                    holder_of[i] = at
    holder = child = None  # loop variables would add to the refcounts read below
    # getrefcount's own argument and the ancestors list are the two references we hold.
    return {i: at for i, at in holder_of.items() if i not in twice and sys.getrefcount(ancestors[i]) - 2 == 1}


def _unexplained(ancestors: list[Any], index: dict[int, int], which: list[int]) -> list[int]:
    """Those of these ancestors some object outside the set still refers to: the climb goes on from
    these alone (a cycle's last member, every reference to it from inside, needs no heap pass)."""
    inside = _inside_counts(ancestors, index)
    # getrefcount's own argument and the ancestors list are the two references we hold.
    return [i for i in which if sys.getrefcount(ancestors[i]) - 2 > inside[i]]


def _inside_counts(ancestors: list[Any], index: dict[int, int]) -> list[int]:
    """How many references each ancestor has from the others (and itself)."""
    inside = [0] * len(ancestors)
    for holder in ancestors:
        for child in gc.get_referents(holder):
            i = index.get(id(child))
            if i is not None:
                inside[i] += 1
    return inside


def _reachable_ancestors(ancestors: list[Any], index: dict[int, int], external: set[int]) -> set[int]:
    """Indices of ancestors reachable from outside the set (the collector's test, restricted to it)."""
    inside = _inside_counts(ancestors, index)
    # getrefcount's own argument and the ancestors list are the two references we hold.
    start = [i for i in range(len(ancestors))
             if id(ancestors[i]) in external or sys.getrefcount(ancestors[i]) - 2 > inside[i]]
    marked = set(start)
    while start:
        for child in gc.get_referents(ancestors[start.pop()]):
            i = index.get(id(child))
            if i is not None and i not in marked:
                marked.add(i)
                start.append(i)
    return marked


def _is_root_like(obj: Any) -> bool:
    cls = type(obj)
    if cls is types.ModuleType or issubclass(cls, type):
        return True
    if cls is dict and "__name__" in obj and "__builtins__" in obj:
        return True  # a module's globals
    if cls is types.FrameType:
        return _is_running(obj)
    return False


def _is_running(frame: types.FrameType) -> bool:
    current: types.FrameType | None = sys._getframe()
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


