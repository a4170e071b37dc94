"""Say who holds each storage: a user variable's path, the output cache, a traceback, garbage.

First match wins, in this order: user → output-cache → traceback → garbage → other.
The walk (walk.py) reaches objects through the interpreter's own traversal and names only the
storages found, with C-level reads, so a hostile ``__getattr__``, ``__iter__``, ``__eq__`` or
``__hash__`` in the user's namespace is never called.

Exact first, then fast: a user-held storage's path is remembered as steps (strings and ints, no
references; ``remembered``); the next scan re-reads each one from its variable and trusts it only if
it still reaches a tensor of that same storage. Whatever is left gets a walk, which stops as soon as
every storage left has a holder; the garbage and library-held tests run only for what is left after it.
"""
from __future__ import annotations

import gc
import operator
import sys
import time
import types
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ..records.snapshot import GARBAGE, OTHER, OUTPUT_CACHE, STALE_KINDS, TRACEBACK, USER, HolderKind
from .roots import Roots
from .storages import LiveTensors, group_storages, storage_types
from .tracker import gc_paused, pins_nothing
from .walk import Root, Walk
from .names import Namer
from .path_text import render
from .reads import instance_attributes, plain_dict_slot, qualname
from .remembered import RememberedPaths
from .garbage import forget_garbage, garbage_storages, still_garbage
from .library import forget_library_chains, held_as_defaults, remember_chain, still_library_held
from .referrers import referrers_of

__all__ = ["GARBAGE", "OTHER", "OUTPUT_CACHE", "STALE_KINDS", "TRACEBACK", "USER", "Attribution", "Holder",
           "attribute", "attribute_reachable", "forget_paths", "recheck_remembered"]


def _root_kinds(roots: Roots) -> tuple[tuple[HolderKind, tuple[tuple[str, object], ...]], ...]:
    """The roots of each kind, in the order their holders win: user, output cache, traceback."""
    return ((USER, roots.user), (OUTPUT_CACHE, roots.output_cache), (TRACEBACK, roots.traceback))


@dataclass(frozen=True, slots=True)  # slots: a scan reads kind and path of 100,000 of them into records
class Holder:
    """Who holds a storage: the kind, the path to show, and the root it was reached from.

    ``hint``: how to free it where the path alone does not say (an lru cache: ``f.cache_clear()``).
    """

    kind: HolderKind
    path: str
    root: str
    hint: str | None = None


@dataclass(frozen=True)
class Attribution:
    """The holders found for a set of storages, and whether the walk finished in its budget."""

    holders: dict[int, Holder]
    complete: bool
    nodes_walked: int
    # ids of the output-cache and traceback roots' objects that a user variable also reaches
    # (cleanup never clears what a user variable holds)
    user_reachable: frozenset[int]


_REMEMBER_LIMIT = 1_000_000
# User-held paths of the last scans, re-checked before use.
_REMEMBERED = RememberedPaths(_REMEMBER_LIMIT)
# Steps that resolve() can re-read; a path with any other step is walked again each time.
_RESOLVABLE = frozenset({"", "key", "attr", "index", "closure", "cell", "member", "flat", "keyat", "grad", "run",
                         "pandas"})


def instance_dict(obj: object) -> dict:
    """An object's ``__dict__`` read through the C slot (no user code runs), or {}.

    ``object.__getattribute__`` skips a user ``__getattr__``, but would still run a ``__dict__``
    property defined on the class: such classes are read as having no attributes.
    """
    return instance_attributes(obj)


_plain_dict_slot = plain_dict_slot


def forget_paths() -> None:
    """Drop every remembered path and the garbage found (the next scan walks and searches from scratch)."""
    _REMEMBERED.clear()
    forget_garbage()
    forget_library_chains()


@pins_nothing
def attribute(live: LiveTensors, roots: Roots, torch: Any, tensor_types: frozenset[type], *,
              budget_nodes: int = 10_000_000, budget_seconds: float = 5.0,
              find_garbage: bool = True, trace_other: bool = True) -> Attribution:
    """Find a holder for every storage in ``live`` (user → output-cache → traceback → garbage → other)."""
    with gc_paused():
        return _attribute(live, roots, torch, tensor_types, budget_nodes=budget_nodes, budget_seconds=budget_seconds,
                          find_garbage=find_garbage, trace_other=trace_other)


def _attribute(live: LiveTensors, roots: Roots, torch: Any, tensor_types: frozenset[type], *,
               budget_nodes: int, budget_seconds: float, find_garbage: bool, trace_other: bool) -> Attribution:
    deadline = time.perf_counter() + budget_seconds
    holders = _REMEMBERED.holders_now(live, roots)
    if find_garbage:  # garbage is unreachable from every root: no walk needs to look for it
        for key in still_garbage(live, holders):
            holders[key] = Holder(GARBAGE, "unreachable reference cycle", "gc")
    # Held alone by a library's module or class, as last time: no walk reaches it, and it is no
    # garbage. Asked also without trace_other: the cleanup's garbage search would climb to it again
    # (not for a reach from given roots alone, which searches nothing: its holders are what it reached).
    if trace_other or find_garbage:
        for key, text in still_library_held(live, holders).items():
            holders[key] = Holder(OTHER, text, "referrers")
    # A steady scan's remembered paths often name every storage: no walk, and no look at each tensor.
    wanted = {} if holders.keys() >= live.sizes.keys() else \
        {tid: key for tid, key in live.storage_of.items() if key not in holders}
    skip = roots.containers + (live.tensors, live.storage_of, sys.modules, wanted, roots)
    walk = Walk(skip, wanted=wanted, deadline=deadline, budget_nodes=budget_nodes)
    complete = True
    user_exhausted = False
    # The stale roots, and each stored exception's tracebacks and frames: cleanup keeps any of
    # them a user variable reaches (`fr = err.__traceback__.tb_frame`).
    stale_objects = [o for _, o in roots.output_cache] + _traceback_parts([o for _, o in roots.traceback])
    user_reached: set[int] = set()
    try:
        if wanted:
            for kind, named in _root_kinds(roots):
                walk.start(kind, named)
                walk.run()
                if kind == USER:
                    user_exhausted = walk.exhausted
                    user_reached = _reached(walk, stale_objects)
                if walk.done or not walk.complete:
                    break
            complete = walk.complete
            holders.update(_name_found(walk, torch, live))
            _grads(walk, live, torch, holders)
        nodes = walk.nodes
    finally:
        walk.release()
    # Which stale roots a variable reaches matters only where the output cache or a traceback holds
    # something: garbage is unreachable by definition.
    if stale_objects and not user_exhausted and any(h.kind in (OUTPUT_CACHE, TRACEBACK) for h in holders.values()):
        user_reached = _user_reach(roots, live, stale_objects, deadline, budget_nodes)
    unclaimed = [] if holders.keys() >= live.sizes.keys() else \
        [t for t in live.tensors if live.storage_of[id(t)] not in holders]
    known: dict[int, list[Any]] = {}  # the garbage search's referrers, climbed again by the chains
    try:
        if unclaimed and (find_garbage or trace_other) and _few_storages(live, unclaimed):
            # A library function's default argument: one pass over the functions, not a climb of five.
            for key, text in held_as_defaults(live, unclaimed).items():
                holders.setdefault(key, Holder(OTHER, text, "library"))
            unclaimed = [t for t in unclaimed if live.storage_of[id(t)] not in holders]
        if unclaimed and find_garbage:
            for key in garbage_storages(live, unclaimed, referrers=known):
                holders.setdefault(key, Holder(GARBAGE, "unreachable reference cycle", "gc"))
            unclaimed = [t for t in live.tensors if live.storage_of[id(t)] not in holders]
        if unclaimed and trace_other:
            for key, path in _referrer_chains(live, unclaimed, known=known).items():
                holders.setdefault(key, Holder(OTHER, path, "referrers"))
        elif unclaimed and find_garbage and _few_storages(live, unclaimed):
            # A few library-held storages (a Function's default argument): their chains, climbed from
            # the search's referrers and remembered, spare every later cleanup its garbage search.
            _referrer_chains(live, unclaimed, known=known)
    finally:
        known.clear()
    del unclaimed
    return Attribution(holders, complete, nodes, frozenset(user_reached))


_TAG = operator.itemgetter(0)  # a step's kind
_CHAINS_REMEMBERED = 16  # storages a cleanup climbs to once, to skip their garbage search after


_TB_OF = BaseException.__dict__["__traceback__"].__get__  # C-level reads: no user property runs
_CAUSE_OF = BaseException.__dict__["__cause__"].__get__
_CONTEXT_OF = BaseException.__dict__["__context__"].__get__


def _traceback_parts(objects: list[Any]) -> list[Any]:
    """The objects, and for exceptions and tracebacks among them every traceback and frame of
    their chains (causes and contexts included), each once."""
    found: dict[int, Any] = {}
    stack = list(objects)
    while stack:
        item = stack.pop()
        if item is None or id(item) in found:
            continue
        found[id(item)] = item
        try:
            if isinstance(item, BaseException):
                stack += [_TB_OF(item), _CAUSE_OF(item), _CONTEXT_OF(item)]
            elif type(item) is types.TracebackType:
                stack += [item.tb_frame, item.tb_next]
        except Exception:
            continue
    return list(found.values())


def _few_storages(live: LiveTensors, tensors: list[Any]) -> bool:
    """Whether these tensors view few enough storages for a chain each to be found and remembered."""
    return len({live.storage_of[id(t)] for t in tensors}) <= _CHAINS_REMEMBERED


def _reached(walk: Walk, objects: list[Any]) -> set[int]:
    """Which of ``objects`` a walk from the user's variables alone reached (a variable itself counts)."""
    return {id(o) for o in objects if walk.seen(id(o))}


def _user_reach(roots: Roots, live: LiveTensors, objects: list[Any], deadline: float,
                budget_nodes: int) -> set[int]:
    """Which of ``objects`` the user's variables reach: a full walk, run only when stale memory exists."""
    walk = Walk(roots.containers + (live.tensors, live.storage_of, sys.modules, roots),
                deadline=max(deadline, time.perf_counter() + 1.0), budget_nodes=budget_nodes)
    try:
        walk.start(USER, roots.user)
        walk.run()
        reached = _reached(walk, objects)
        if not walk.complete:  # not known: count every one as reached (cleanup then leaves it alone)
            reached = {id(o) for o in objects}
        return reached
    finally:
        walk.release()


def recheck_remembered(keys: Iterable[int], roots: Roots, torch: Any) -> dict[int, Holder] | None:
    """Holders for these storages by their remembered user paths alone, each re-read now and
    checked to reach a tensor of that same storage; None unless every one does (then a heap pass
    is needed). No heap pass: what it costs is the paths' length, not the heap's size."""
    return _REMEMBERED.recheck(keys, roots, torch)


def _name_found(walk: Walk, torch: Any, live: LiveTensors | None) -> dict[int, Holder]:
    """Path text for each storage the walk reached (its first tensor's path), remembered for next time."""
    namer = Namer(walk, getattr(getattr(torch, "nn", None), "Module", None))
    holders: dict[int, Holder] = {}
    try:
        def key_text(obj_id: int) -> str | None:
            root, steps = namer.steps(obj_id)
            if root is None:
                return None
            return render(root, steps, lambda _: None)

        namer.prepare(walk.found.values())
        paths = {key: namer.steps(tid) for key, tid in walk.found.items()}
        # Keys shown by their own path (opt.state[model.fc.weight]): their parents in one more pass.
        namer.prepare(namer.key_paths)
        views: dict[int, dict[int, list[int]]] = {}  # id(list) -> storage -> [first index, views]
        for key, (root, steps) in paths.items():
            if root is None:
                continue
            shared = _shared_views(namer, walk.found[key], key, live, views) if steps and steps[-1][0] == "index" else None
            if shared is not None:  # one storage viewed from many items of one list: named once, as shared
                steps = steps[:-1] + (("index", shared[0]),)
            text = render(root, steps, key_text)
            if shared is not None:
                text += f" (first of {shared[1]:,} views)"
            holders[key] = holder = Holder(root.kind, text, root.name, _hint(root, steps))
            if root.kind == USER and shared is None:  # a count of views could change unseen: not remembered
                if namer.key_paths:
                    steps = tuple(_key_at(namer, step) if step[0] == "keypath" else step for step in steps)
                _remember(key, root.name, steps, holder)
    finally:
        namer.clear()
    return holders


def _shared_views(namer: Namer, tensor_id: int, key: int, live: LiveTensors | None,
                  views: dict[int, dict[int, list[int]]]) -> tuple[int, int] | None:
    """(first index, how many items) where several items of the list or tuple holding this tensor
    view its storage; None where it is the only one. Each list is read once per scan."""
    container = namer.parent_of.get(tensor_id)
    if live is None or not (type(container) is list or type(container) is tuple):
        return None
    by_storage = views.get(id(container))
    if by_storage is None:
        by_storage = views[id(container)] = {}
        storage_of = live.storage_of
        for at, item in enumerate(container):
            found = storage_of.get(id(item))
            if found is not None:
                entry = by_storage.get(found)
                if entry is None:
                    by_storage[found] = [at, 1]
                else:
                    entry[1] += 1
        item = None
    entry = by_storage.get(key)
    return (entry[0], entry[1]) if entry is not None and entry[1] > 1 else None


def _key_at(namer: Namer, step: tuple) -> tuple:
    """A dict key named by its own path, as a step resolve() can follow: the key's variable and steps."""
    root, steps = namer.steps(step[1])
    if root is None or root.kind != USER or not all(s[0] in _RESOLVABLE and s[0] != "keyat" for s in steps):
        return step  # not re-readable: the path is walked again next time
    return ("keyat", root.name, steps)


def _remember(key: int, name: str, steps: tuple, holder: Holder) -> None:
    """Keep a user-held storage's path for the next scan, if every step can be re-read."""
    if _RESOLVABLE.issuperset(map(_TAG, steps)):
        _REMEMBERED.remember(key, name, steps, holder)


def _hint(root: Root, steps: tuple) -> str | None:
    """How to free an lru cache's result: ``cached.cache_clear()``."""
    if ("cache",) not in steps and ("", "cache") not in steps:  # steps hold plain values: compared in C
        return None
    for i, step in enumerate(steps):
        if step[0] == "cache" or step == ("", "cache"):
            return render(root, steps[:i], lambda _: None) + ".cache_clear()"
    return None


def _grads(walk: Walk, live: LiveTensors, torch: Any, holders: dict[int, Holder]) -> None:
    """Name storages only a reached tensor's ``.grad`` holds (read through TensorBase, no user code)."""
    left = {key for key in live.sizes if key not in holders}
    if not left or not walk.exhausted:
        return
    base = getattr(getattr(torch, "_C", None), "TensorBase", None)
    disable = getattr(getattr(torch, "_C", None), "DisableTorchFunctionSubclass", None)
    if base is None or disable is None:
        return
    by_id = {id(t): t for t in live.tensors}
    reached = [by_id[i] for i in set(by_id).intersection(walk.visited) if walk.reached(i) or i in walk.roots]
    by_id.clear()
    with disable():
        for tensor in reached:
            try:
                if not base.is_leaf.__get__(tensor):
                    continue
                grad = base.grad.__get__(tensor)
            except Exception:
                continue
            key = live.storage_of.get(id(grad)) if grad is not None else None
            if key is not None and key in left:
                tensor_key = live.storage_of.get(id(tensor))
                holder = holders.get(tensor_key) if tensor_key is not None else None
                if holder is not None:
                    holders[key] = grad_holder = Holder(holder.kind, holder.path + ".grad", holder.root)
                    left.discard(key)
                    known = _REMEMBERED.get(tensor_key) if tensor_key is not None else None
                    if holder.kind == USER and known is not None and known[0] == holder.root:
                        _remember(key, holder.root, known[1] + (("grad",),), grad_holder)
            del grad
    reached.clear()


@pins_nothing
def attribute_reachable(roots: Roots, torch: Any, tensor_types: frozenset[type], device: str | None, *,
                        budget_nodes: int = 10_000_000, budget_seconds: float = 5.0) -> tuple[LiveTensors, Attribution]:
    """The tensors reachable from the roots, and their holders, found by the walk alone (no heap pass).

    What no root reaches (garbage, a library's globals) is not found: a quick view whose cost
    depends on what the user holds, not on the heap's size. Release the LiveTensors after use.
    """
    with gc_paused():
        return _attribute_reachable(roots, torch, tensor_types, device, budget_nodes, budget_seconds)


def _attribute_reachable(roots: Roots, torch: Any, tensor_types: frozenset[type], device: str | None,
                         budget_nodes: int, budget_seconds: float) -> tuple[LiveTensors, Attribution]:
    collect = frozenset(map(id, tensor_types)) | frozenset(map(id, storage_types(torch)))
    walk = Walk(roots.containers + (sys.modules, roots), collect=collect,
                deadline=time.perf_counter() + budget_seconds, budget_nodes=budget_nodes)
    live = LiveTensors([], {}, {}, 0)
    try:
        for kind, named in _root_kinds(roots):
            walk.start(kind, named)
            for _, obj in named:  # a root that is itself a tensor
                if id(type(obj)) in collect and id(obj) in walk.roots:
                    walk.met.append(obj)
            walk.run()
            if not walk.complete:
                break
        met = list({id(t): t for t in walk.met}.values())
        walk.met.clear()
        order = list(map(id, met))  # walk order: the first tensor met names its storage
        live = group_storages(met, tensor_types, device)
        known = _REMEMBERED.holders_now(live, roots)  # re-checked paths need no naming
        for tid in order:
            key = live.storage_of.get(tid)
            if key is not None and key not in walk.found and key not in known:
                walk.found[key] = tid
        holders = _name_found(walk, torch, live)
        holders.update(known)
        return live, Attribution(holders, walk.complete, walk.nodes, frozenset())
    except BaseException:
        live.release()
        raise
    finally:
        walk.release()


_UNREADABLE = "<held by an object that could not be inspected>"


class _Climb:
    """One tensor's chain as it climbs: the object reached, the segments below it, how it ends."""

    __slots__ = ("base", "climbed", "failed", "going", "segments", "target", "top")

    def __init__(self, target: Any) -> None:
        self.target = target
        self.segments: list[str] = []  # innermost first: how each holder reaches the next target
        self.climbed: list[Any] = [target]  # innermost first
        self.base = "<held outside Python (C++ or an untracked object)>"
        self.top: Any = None
        self.going = True
        self.failed = False

    def step(self, holder: Any) -> None:
        """Climb to ``holder`` (None: nothing else refers to the target), or end at a module's globals."""
        target = self.target
        if holder is None:
            self.going = False
            return
        if type(holder) is dict and "__name__" in holder and "__spec__" in holder:
            self.base = f"{holder['__name__']}.{_key_of(holder, target)}"  # a library global
            module = sys.modules.get(holder["__name__"]) if type(holder["__name__"]) is str else None
            if module is not None and getattr(module, "__dict__", None) is holder:
                self.top = module
                self.climbed.append(holder)
            self.going = False
            return
        self.segments.append(_segment(holder, target))
        self.base = f"<{qualname(type(holder))}>"
        self.target = holder
        self.climbed.append(holder)

    def finish(self) -> tuple[str, Any, list[Any]]:
        """The chain's text, its top and the objects below the top (the tensor last; none without a top)."""
        if self.going:  # more hops than we follow
            self.base = f"…<{qualname(type(self.target))}>"
            self.top = self.climbed.pop()
        below = self.climbed[::-1] if self.top is not None else []
        return self.base + "".join(reversed(self.segments)), self.top, below

    def release(self) -> None:
        self.target = self.top = None
        self.climbed.clear()


def _referrer_chains(live: LiveTensors, unclaimed: list[Any], *, hops: int = 5,
                     known: dict[int, list[Any]] | None = None) -> dict[int, str]:
    """A short chain of referrer types and keys for tensors nothing named holds (storage key -> text).

    Every chain climbs at once: one heap pass per hop (``referrers_of``), not one per tensor and hop;
    each takes its target's first referrer in ``gc.get_referrers``' order, ours and frames left out.
    ``known``: id(object) -> its referrers in that order, as the garbage search found them (no pass)."""
    known = known if known is not None else {}
    by_key: dict[int, Any] = {}
    for t in unclaimed:
        by_key.setdefault(live.storage_of[id(t)], t)
    order = sorted(by_key, key=lambda k: -live.sizes[k])
    climbs = [_Climb(by_key[key]) for key in order]
    # Our own containers refer to the tensors and holders too: never report them as holders.
    ours = {id(live.tensors), id(unclaimed), id(by_key), id(climbs), id(sys._getframe())}
    ours.update(map(id, climbs))
    ours.update(id(c.climbed) for c in climbs)
    ours.update(map(id, known.values()))  # they refer to the holders a later hop climbs from
    ours.add(id(known))
    chains: dict[int, str] = {}
    try:
        for _ in range(hops):
            going = [c for c in climbs if c.going]
            if not going:
                break
            holders = _first_referrers([c.target for c in going if id(c.target) not in known], ours)
            for climb in going:
                listed = known.get(id(climb.target))
                if listed is not None:
                    holders[id(climb.target)] = next(
                        (r for r in listed if id(r) not in ours and type(r) is not types.FrameType), None)
            for climb in going:
                try:
                    climb.step(holders.get(id(climb.target)))
                except Exception:  # a hostile holder on the way: said so rather than fail the snapshot
                    climb.failed, climb.going = True, False
            holders.clear()
            del holders, going
        for key, climb in zip(order, climbs):
            if climb.failed:
                chains[key] = _UNREADABLE
                continue
            text, top, below = climb.finish()
            chains[key] = text
            if top is not None:
                remember_chain(key, top, below, text)
            top = None
            below.clear()
    finally:
        for climb in climbs:
            climb.release()
        by_key.clear()
    return chains


def _first_referrers(targets: list[Any], ours: set[int]) -> dict[int, Any]:
    """id(target) -> its first referrer in the heap's order that is neither ours nor a frame."""
    if not targets:
        return {}  # gc.get_referrers() of nothing would still read the whole heap
    found = referrers_of(targets)
    skip = ours | {id(found), id(targets)}
    wanted = set(map(id, targets))
    first: dict[int, Any] = {}
    for referrer in found:
        if id(referrer) in skip or type(referrer) is types.FrameType:
            continue
        for child in gc.get_referents(referrer):
            if id(child) in wanted and id(child) not in first:
                first[id(child)] = referrer
    found.clear()
    targets.clear()
    return first


_SHOWN_KEYS = (str, int, float, bool, bytes, type(None))


def _is_shown_key(key: object) -> bool:
    cls = type(key)  # by identity: `in` on a tuple of types would call a metaclass __eq__
    return any(cls is t for t in _SHOWN_KEYS)


def _key_text_of(key: object) -> str:
    # Only plain keys are shown: repr() of an arbitrary key runs code we do not control.
    return repr(key) if _is_shown_key(key) else f"<{qualname(type(key))} key>"


def _key_of(mapping: dict, target: Any) -> str:
    key = next((k for k, v in list(mapping.items()) if v is target), "?")
    return key if type(key) is str else _key_text_of(key)


def _segment(holder: Any, target: Any) -> str:
    """How ``holder`` refers to ``target``, as a path segment (``['key']``, ``[3]``, ``.attr``)."""
    cls = type(holder)
    if cls is dict:
        found = [k for k, v in list(holder.items()) if v is target][:1]
        return f"[{_key_text_of(found[0])}]" if found else "[<key>]"
    if cls is list or cls is tuple:
        index = next((i for i, v in enumerate(holder) if v is target), "?")
        return f"[{index}]"
    attr = next((k for k, v in list(instance_dict(holder).items()) if v is target), None)
    return f".{attr}" if type(attr) is str else f"→{qualname(cls)}"
