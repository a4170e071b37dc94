"""Say who holds each storage: a user variable's path, the output cache, a traceback, garbage.

First match wins, in DESIGN.md's order: user → output-cache → traceback → garbage → other.
The walk reads objects through C-level slots (``dict.items``, ``object.__getattribute__``) so a
hostile ``__getattr__``, ``__iter__`` or ``__eq__`` in the user's namespace is never called.
"""
from __future__ import annotations

import gc
import re
import sys
import time
import types
import weakref
from dataclasses import dataclass
from itertools import chain, islice, repeat
from typing import Any, Iterator

from .roots import Roots
from .tracker import LiveTensors, gc_paused, group_storages

USER, OUTPUT_CACHE, TRACEBACK, GARBAGE, OTHER = "user", "output-cache", "traceback", "garbage", "other"
STALE_KINDS = (OUTPUT_CACHE, TRACEBACK, GARBAGE)

_ATOMIC = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range,
                     type(Ellipsis), type(NotImplemented), memoryview})
_NEVER_DESCEND = frozenset({types.ModuleType, type, types.BuiltinFunctionType,
                            types.MethodWrapperType, types.WrapperDescriptorType,
                            types.CodeType, types.GetSetDescriptorType, types.MemberDescriptorType,
                            weakref.ref})
_KEY_MARK = re.compile("\x00(\\d+):(\\d+)\x00")
# nn.Module's child dicts: their entries are shown as attributes (model.fc.weight).
_MODULE_CHILD_DICTS = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class Holder:
    """Who holds a storage: the kind, the path to show, and the root it was reached from."""

    kind: str
    path: str
    root: str


@dataclass(frozen=True)
class Attribution:
    """The holders found for a set of storages, and whether the walk finished in its budget."""

    holders: dict[int, Holder]
    complete: bool
    nodes_walked: int
    user_reachable: frozenset[int]  # ids of objects reachable from user variables


# How a child hangs off its parent, rendered into path text only for the tensors found: building
# every visited object's path string cost more than the rest of the walk.
_ROOT, _SUFFIX, _INDEX, _KEY, _KEYPOS, _ATTR, _MODATTR = range(7)
# What the walk does with an object, decided once per class (first match, as listed).
(_TENSOR, _DICT, _LIST, _TUPLE, _SET, _FROZENSET, _LEAF, _FUNCTION, _METHOD, _TRACEBACK, _FRAME,
 _EXCEPTION, _LRU_CACHE, _CELL, _NN_MODULE, _OBJECT, _SLOTTED) = range(17)  # _SLOTTED: __dict__ not read

# A queue entry: (object, parent entry, step kind, step data, step index); roots have no parent.
_Entry = tuple
# Containers with more items than this are expanded after everything else, _BIG items at a time.
_BIG = 4096


def _keyed_entries(entry: _Entry, pairs: Any) -> list[_Entry]:
    """Queue entries for a dict's tracked keys and values, from ``(index, (key, value))`` pairs.

    A value that is a plain list of untracked items (token ids) is not queued: nothing in it can
    be or hold a tensor.
    """
    is_tracked = gc.is_tracked
    entries: list[_Entry] = []
    for i, (key, value) in pairs:
        if is_tracked(key):
            entries.append((key, entry, _KEYPOS, i, 0))
        if is_tracked(value) and (type(value) is not list or any(map(is_tracked, value))):
            entries.append((value, entry, _KEY, key, i))
    return entries


class _Walk:
    """Breadth-first walk from named roots; the first path reaching a storage wins.

    Containers with more than ``_BIG`` items are expanded last, in slices, so one list of ten
    million records cannot spend the budget before the model beside it is walked. With
    ``collect`` the walk itself gathers the tensors it meets (no heap pass was made).
    """

    def __init__(self, live: LiveTensors, tensor_types: frozenset[type], torch: Any,
                 skip: tuple[object, ...], budget_nodes: int, deadline: float, *, collect: bool = False) -> None:
        self.storage_of = live.storage_of
        self.tensor_types = tensor_types
        self.module_type = getattr(getattr(torch, "nn", None), "Module", None)
        self.found: dict[int, tuple[str, _Entry]] = {}  # storage key -> (kind, entry of its first tensor)
        self.visited: set[int] = {id(o) for o in skip}
        self.tensor_entries: dict[int, _Entry] = {}  # id(tensor) -> its first entry (names dict keys)
        self.met: list[tuple[str, _Entry]] | None = [] if collect else None  # (kind, entry) per tensor met
        self.nodes = 0
        self.budget_nodes = budget_nodes
        self.deadline = deadline
        self.complete = True
        self._kinds: dict[type, int] = {}
        self._slots: dict[type, tuple[str, ...]] = {}
        self._big: list[tuple[_Entry, int]] = []  # (entry, _DICT or _LIST or _TUPLE) expanded last

    def run(self, kind: str, roots: tuple[tuple[str, object], ...]) -> None:
        self._level_walk(kind, [(obj, None, _ROOT, name, 0) for name, obj in roots])
        while self._big and self.complete:
            entry, what = self._big.pop(0)
            for chunk, leaves in self._slices(entry, what):
                if leaves:
                    self._mark_walked(leaves)
                else:
                    self._level_walk(kind, chunk)
                if not self.complete:
                    break
        self._big.clear()

    def _slices(self, entry: _Entry, what: int) -> Iterator[tuple[list[_Entry], list[object]]]:
        """A big container's children, ``_BIG`` at a time (never all at once): (entries to walk, leaves).

        A slice of records that cannot lead to a tensor (a tokenised dataset's rows) comes back
        as leaves: marked as walked in C-level passes, without a queue entry each.
        """
        obj = entry[0]
        if what is _DICT:
            items = enumerate(dict.items(obj))
            while chunk := list(islice(items, _BIG)):
                yield _keyed_entries(entry, chunk), []
        else:
            values = iter(list.__iter__(obj) if what is _LIST else tuple.__iter__(obj))
            start = 0
            while chunk := list(islice(values, _BIG)):
                if self._leaves(chunk):
                    yield [], chunk
                else:
                    yield [(item, entry, _INDEX, i, 0) for i, item in enumerate(chunk, start)
                           if gc.is_tracked(item)], []
                start += len(chunk)

    def _leaves(self, items: list[object]) -> bool:
        """Whether none of ``items`` can lead to a tensor, decided in C-level passes.

        For rows of one shape only: plain dicts, or instances of one plain class (its ``__dict__``
        CPython's own, no ``__slots__``), whose keys are untracked and whose tracked values are
        plain lists of untracked items (``{"id": 7, "tokens": [101, 2023], "meta": {"n": 2}}``).
        """
        classes = set(map(type, items))
        if len(classes) != 1:
            return False
        cls = classes.pop()
        if cls is dict:
            dicts = items
        else:
            what = self._kinds.get(cls)
            if what is None:
                what = self._kinds[cls] = self._classify(cls)
            slots = self._slots.get(cls)
            if slots is None:
                slots = self._slots[cls] = _slot_names(cls)
            if what is not _OBJECT or slots:
                return False
            try:  # the class's __dict__ is CPython's slot (_OBJECT): no user code runs
                dicts = list(map(object.__getattribute__, items, repeat("__dict__")))
            except Exception:
                return False
            if set(map(type, dicts)) != {dict}:
                return False
        if any(map(gc.is_tracked, chain.from_iterable(map(dict.keys, dicts)))):
            return False
        values = list(filter(gc.is_tracked, chain.from_iterable(map(dict.values, dicts))))
        if not values:
            return True
        return set(map(type, values)) == {list} and not any(map(gc.is_tracked, chain.from_iterable(values)))

    def _mark_walked(self, leaves: list[object]) -> None:
        """Count objects that hold nothing worth a visit as walked (no entry, no classification)."""
        self.visited.update(map(id, leaves))
        self.nodes += len(leaves)
        if self.nodes >= self.budget_nodes or time.perf_counter() > self.deadline:
            self.complete = False

    def _level_walk(self, kind: str, level: list[_Entry]) -> None:
        # Level by level in FIFO order: the same order as a queue, with fewer operations per object.
        visited, storage_of, found, met = self.visited, self.storage_of, self.found, self.met
        kinds, slots_of, big = self._kinds, self._slots, self._big.append
        # Only gc-tracked objects can hold a tensor (a tensor is tracked, and so is anything holding
        # one): untracked children (ints, strings, dicts of atoms) are never queued, and neither
        # is a plain list of them (token lists: half the objects of a tokenised dataset).
        is_tracked = gc.is_tracked
        nodes, budget, deadline = self.nodes, self.budget_nodes, self.deadline
        while level:
            following: list[_Entry] = []
            push = following.append
            for entry in level:
                obj = entry[0]
                oid = id(obj)
                if oid in visited:
                    continue
                visited.add(oid)
                nodes += 1
                if nodes >= budget or (nodes & 1023 == 0 and time.perf_counter() > deadline):
                    self.nodes = nodes
                    self.complete = False
                    return
                cls = type(obj)
                what = kinds.get(cls)
                if what is None:
                    what = kinds[cls] = self._classify(cls)
                # Children are queued without a visited test: the test at pop time decides, and
                # the first occurrence in queue order still wins.
                try:
                    if what is _DICT:
                        # An untracked dict holds only untracked objects: no tensor can be in it.
                        if not is_tracked(obj):
                            continue
                        if dict.__len__(obj) > _BIG:
                            big((entry, what))
                            continue
                        following.extend(_keyed_entries(entry, enumerate(list(dict.items(obj)))))
                    elif what is _LIST or what is _TUPLE:
                        if what is _TUPLE and not is_tracked(obj):
                            continue
                        if (list.__len__(obj) if what is _LIST else tuple.__len__(obj)) > _BIG:
                            big((entry, what))
                            continue
                        items = list(list.__iter__(obj) if what is _LIST else tuple.__iter__(obj))
                        if len(items) >= 16 and self._leaves(items):  # records: walked in C-level passes
                            visited.update(map(id, items))
                            nodes += len(items)
                        elif any(map(is_tracked, items)):
                            for i, item in enumerate(items):
                                if is_tracked(item) and (type(item) is not list or any(map(is_tracked, item))):
                                    push((item, entry, _INDEX, i, 0))
                    elif what is _OBJECT or what is _SLOTTED:
                        if what is _OBJECT:  # the class's __dict__ is CPython's slot: no user code runs
                            try:
                                attrs = object.__getattribute__(obj, "__dict__")
                            except Exception:
                                attrs = None
                            if type(attrs) is dict:
                                for name, value in list(attrs.items()):
                                    if is_tracked(value) and (type(value) is not list or any(map(is_tracked, value))):
                                        push((value, entry, _ATTR, name, 0))
                        slots = slots_of.get(cls)
                        if slots is None:
                            slots = slots_of[cls] = _slot_names(cls)
                        for slot in slots:
                            try:
                                push((object.__getattribute__(obj, slot), entry, _ATTR, slot, 0))
                            except Exception:
                                continue
                    elif what is _LEAF:
                        pass
                    elif what is _NN_MODULE:
                        for child, step, data in _module_children(obj):
                            push((child, entry, step, data, 0))
                    elif what is _TENSOR:
                        self.tensor_entries.setdefault(oid, entry)
                        key = storage_of.get(oid)
                        if key is not None and key not in found:
                            found[key] = (kind, entry)
                        elif met is not None:
                            met.append((kind, entry))
                        # .grad on a non-leaf warns; only leaves carry a user-visible gradient.
                        if obj.is_leaf:
                            grad = obj.grad
                            if grad is not None:
                                push((grad, entry, _SUFFIX, ".grad", 0))
                        for name, value in list(instance_dict(obj).items()):
                            push((value, entry, _ATTR, name, 0))
                    else:
                        for child, suffix in self._other_children(obj, what):
                            push((child, entry, _SUFFIX, suffix, 0))
                except Exception:
                    # A hostile or half-built object: walk what we got, skip the rest.
                    pass
            level = following
        self.nodes = nodes

    def _classify(self, cls: type) -> int:
        """Which branch of the walk handles instances of ``cls`` (checked in this order)."""
        try:
            if cls in self.tensor_types:
                return _TENSOR
            if cls is dict or issubclass(cls, dict):
                return _DICT
            if cls is list or cls is tuple or issubclass(cls, (list, tuple)):
                return _LIST if issubclass(cls, list) else _TUPLE
            if issubclass(cls, (set, frozenset)):
                return _SET if issubclass(cls, set) else _FROZENSET
            if cls in _ATOMIC or cls in _NEVER_DESCEND or issubclass(cls, type):
                return _LEAF
            if cls is types.FunctionType:
                return _FUNCTION
            if cls is types.MethodType:
                return _METHOD
            if cls is types.TracebackType:
                return _TRACEBACK
            if cls is types.FrameType:
                return _FRAME
            if issubclass(cls, BaseException):
                return _EXCEPTION
            if cls.__name__ == "_lru_cache_wrapper":
                return _LRU_CACHE
            if cls.__name__ == "cell":
                return _CELL
            if self.module_type is not None and issubclass(cls, self.module_type):
                return _NN_MODULE
            return _OBJECT if _plain_dict_slot(cls) else _SLOTTED
        except Exception:
            return _LEAF  # a class that cannot be inspected safely: do not descend

    def _other_children(self, obj: Any, what: int) -> Iterator[tuple[object, str]]:
        """Children of the less common kinds, with the path text each adds."""
        if what is _SET or what is _FROZENSET:
            for i, item in enumerate(set.__iter__(obj) if what is _SET else frozenset.__iter__(obj)):
                if type(item) not in _ATOMIC:
                    yield item, f"{{#{i}}}"
        elif what is _FUNCTION:
            yield from _function_children(obj)
        elif what is _METHOD:
            yield obj.__self__, ".__self__"
        elif what is _TRACEBACK:
            yield from _traceback_children(obj)
        elif what is _FRAME:
            yield from _frame_children(obj)
        elif what is _EXCEPTION:
            yield from _exception_children(obj)
        elif what is _LRU_CACHE:
            for ref in gc.get_referents(obj):
                if type(ref) is dict:
                    yield ref, ".cache"
            wrapped = instance_dict(obj).get("__wrapped__")
            if wrapped is not None:
                yield wrapped, ".__wrapped__"
        elif what is _CELL:
            yield obj.cell_contents, ""

    def _key_text(self, key: object, index: int) -> str:
        if type(key) in (str, int, float, bool, type(None)):
            return repr(key)
        if type(key) in self.tensor_types:
            # The key's own path may be found later in the walk: resolved in named_paths().
            return f"\x00{id(key)}:{index}\x00"
        return f"<key #{index}>"

    def _path(self, entry: _Entry, rendered: dict[int, tuple[str, str]]) -> tuple[str, str]:
        """The entry's path text and root name; prefixes shared by many tensors are rendered once."""
        chain = [entry]
        node = entry
        while True:
            parent = node[1]
            if parent is None:  # a root: its name is the path
                chain.pop()
                path = root = node[3]
                break
            known = rendered.get(id(parent))
            if known is not None:
                path, root = known
                break
            chain.append(parent)
            node = parent
        key_text = self._key_text
        for node in reversed(chain):
            _, _, step, data, index = node
            if step is _KEY:
                try:
                    path += f"[{key_text(data, index)}]"
                except Exception:  # a key whose repr fails (an int too long to print)
                    path += f"[<key #{index}>]"
            elif step is _INDEX:
                path += f"[{data}]"
            elif step is _ATTR:
                path += f".{data}"
            elif step is _MODATTR:
                path += f"[{data}]" if isinstance(data, str) and data.isdigit() else f".{data}"
            elif step is _KEYPOS:
                path += f".keys()[{data}]"
            else:
                path += data
            if node is not entry:
                rendered[id(node)] = (path, root)
        return path, root

    def named_paths(self) -> dict[int, Holder]:
        """Holders with tensor dict keys shown by their path (``opt.state[model.fc.weight]``)."""
        rendered: dict[int, tuple[str, str]] = {}

        def name(match: re.Match) -> str:
            entry = self.tensor_entries.get(int(match.group(1)))
            path = self._path(entry, rendered)[0] if entry is not None else None
            return path if path is not None and "\x00" not in path else f"<key #{match.group(2)}>"

        result: dict[int, Holder] = {}
        for key, (kind, entry) in self.found.items():
            path, root = self._path(entry, rendered)
            if "\x00" in path:
                path = _KEY_MARK.sub(name, path)
            result[key] = Holder(kind, path, root)
        # The entries hold the walked objects: drop them before anything counts references.
        self.found.clear()
        self.tensor_entries.clear()
        rendered.clear()
        return result


def instance_dict(obj: object) -> dict:
    """An object's ``__dict__`` read through the C slot (no user code runs), or {}.

    ``object.__getattribute__`` skips a user ``__getattr__``, but would still run a ``__dict__``
    property defined on the class: such classes are read as having no attributes.
    """
    if not _plain_dict_slot(type(obj)):
        return {}
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return {}
    return d if type(d) is dict else {}


# id(class) -> (weak reference to the class, whether its ``__dict__`` is the C slot); weak so no
# class (and the tensors its attributes hold) is kept alive by the cache.
_DICT_SLOT: dict[int, tuple[Any, bool]] = {}
_SLOT_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


def _plain_dict_slot(cls: type) -> bool:
    """Whether the first ``__dict__`` along ``cls``'s MRO is CPython's own descriptor (no user code)."""
    cached = _DICT_SLOT.get(id(cls))
    if cached is not None and cached[0]() is cls:
        return cached[1]
    plain = False
    try:
        for klass in type.__dict__["__mro__"].__get__(cls):
            found = type.__dict__["__dict__"].__get__(klass).get("__dict__", _MISSING)
            if found is not _MISSING:
                plain = type(found) in _SLOT_DESCRIPTORS
                break
        _DICT_SLOT[id(cls)] = (weakref.ref(cls, lambda _, key=id(cls): _DICT_SLOT.pop(key, None)), plain)
    except Exception:  # a class that cannot be inspected or weakly referenced: read nothing
        return False
    return plain


_MISSING = object()


def _slot_names(cls: type) -> tuple[str, ...]:
    """Every ``__slots__`` name along the class's MRO, in MRO order."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, (tuple, list)):
            names.extend(slots)
    return tuple(names)


def _module_children(module: Any) -> list[tuple[object, int, object]]:
    """An nn.Module's parameters, buffers and submodules by name, then its other tracked attributes."""
    attrs = instance_dict(module)
    children: list[tuple[object, int, object]] = []
    for group in _MODULE_CHILD_DICTS:
        named = attrs.get(group)
        if type(named) is dict:
            children.extend((value, _MODATTR, name) for name, value in list(named.items()) if value is not None)
    is_tracked, internal = gc.is_tracked, _MODULE_INTERNALS
    for name, value in list(attrs.items()):
        if name in internal or not is_tracked(value):
            continue
        if type(name) is str and name.startswith("_") and name.endswith("hooks"):
            continue  # hook dicts of other libraries' modules: callables, not weights
        children.append((value, _ATTR, name))
    return children


# What nn.Module.__init__ sets besides the three child dicts: flags, name sets and hook dicts.
_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set", "_is_full_backward_hook",
    "_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
})


def _function_children(func: types.FunctionType) -> Iterator[tuple[object, str]]:
    for i, cell in enumerate(func.__closure__ or ()):
        try:
            yield cell.cell_contents, f".__closure__[{i}]"
        except ValueError:  # an empty cell
            continue
    for i, value in enumerate(func.__defaults__ or ()):
        yield value, f".__defaults__[{i}]"
    for name, value in (func.__kwdefaults__ or {}).items():
        yield value, f".__kwdefaults__[{name!r}]"
    wrapped = func.__dict__.get("__wrapped__")
    if wrapped is not None:
        yield wrapped, ".__wrapped__"


def _traceback_children(tb: types.TracebackType) -> Iterator[tuple[object, str]]:
    while tb is not None:
        yield tb.tb_frame, ""
        tb = tb.tb_next


def _frame_children(frame: types.FrameType) -> Iterator[tuple[object, str]]:
    # A module-level frame's locals are the user's (or a library's) globals: walked elsewhere.
    if frame.f_code.co_flags & 0x1 == 0:  # CO_OPTIMIZED unset: module or class body
        return
    for name, value in list(frame.f_locals.items()):
        yield value, f" → frame {frame.f_code.co_name} → local {name}"


def _exception_children(exc: BaseException) -> Iterator[tuple[object, str]]:
    if exc.__traceback__ is not None:
        yield exc.__traceback__, ""
    for i, arg in enumerate(exc.args):
        yield arg, f".args[{i}]"
    if exc.__cause__ is not None:
        yield exc.__cause__, ".__cause__"
    if exc.__context__ is not None:
        yield exc.__context__, ".__context__"
    for name, value in list(instance_dict(exc).items()):
        yield value, f".{name}"


def attribute(live: LiveTensors, roots: Roots, torch: Any, tensor_types: frozenset[type], *,
              budget_nodes: int = 2_000_000, budget_seconds: float = 5.0,
              find_garbage: bool = True, trace_other: bool = True) -> Attribution:
    """Find a holder for every storage in ``live`` (user → output-cache → traceback → garbage → other)."""
    with gc_paused():
        return _attribute(live, roots, torch, tensor_types, budget_nodes=budget_nodes, budget_seconds=budget_seconds,
                          find_garbage=find_garbage, trace_other=trace_other)


def _attribute(live: LiveTensors, roots: Roots, torch: Any, tensor_types: frozenset[type], *,
               budget_nodes: int, budget_seconds: float, find_garbage: bool, trace_other: bool) -> Attribution:
    walk = _Walk(live, tensor_types, torch, roots.containers + (live.tensors, live.storage_of, sys.modules),
                 budget_nodes, time.perf_counter() + budget_seconds)
    user_reachable = _walk_roots(walk, roots)
    holders = walk.named_paths()
    unclaimed = [t for t in live.tensors if live.storage_of[id(t)] not in holders]
    if unclaimed and find_garbage:
        for key in _garbage_storages(live, unclaimed):
            holders.setdefault(key, Holder(GARBAGE, "unreachable reference cycle", "gc"))
        unclaimed = [t for t in live.tensors if live.storage_of[id(t)] not in holders]
    if unclaimed and trace_other:
        for key, path in _referrer_chains(live, unclaimed).items():
            holders.setdefault(key, Holder(OTHER, path, "referrers"))
    return Attribution(holders, walk.complete, walk.nodes, user_reachable)


def attribute_reachable(roots: Roots, torch: Any, tensor_types: frozenset[type], device: str | None, *,
                        budget_nodes: int = 2_000_000, budget_seconds: float = 5.0) -> tuple[LiveTensors, Attribution]:
    """The tensors reachable from the roots, and their holders, found by the walk alone (no heap pass).

    What no root reaches (garbage, a library's globals) is not found: a quick view whose cost
    depends on what the user holds, not on the heap's size. Release the LiveTensors after use.
    """
    with gc_paused():
        return _attribute_reachable(roots, torch, tensor_types, device, budget_nodes, budget_seconds)


def _attribute_reachable(roots: Roots, torch: Any, tensor_types: frozenset[type], device: str | None,
                         budget_nodes: int, budget_seconds: float) -> tuple[LiveTensors, Attribution]:
    walk = _Walk(LiveTensors([], {}, {}, 0, 0), tensor_types, torch, roots.containers + (sys.modules,),
                 budget_nodes, time.perf_counter() + budget_seconds, collect=True)
    user_reachable = _walk_roots(walk, roots)
    met = walk.met or []
    walk.met = None
    seen: dict[int, Any] = {}
    for _, entry in met:
        seen.setdefault(id(entry[0]), entry[0])
    live = group_storages(list(seen.values()), tensor_types, device, walk.nodes)
    seen.clear()
    for kind, entry in met:  # walk order: the first path to reach a storage names it
        key = live.storage_of.get(id(entry[0]))
        if key is not None and key not in walk.found:
            walk.found[key] = (kind, entry)
    met.clear()
    return live, Attribution(walk.named_paths(), walk.complete, walk.nodes, user_reachable)


def _walk_roots(walk: _Walk, roots: Roots) -> frozenset[int]:
    """Walk user → output-cache → traceback roots; the ids of what the user's variables reach."""
    walk.run(USER, roots.user)
    user_reachable = frozenset(walk.visited)
    walk.run(OUTPUT_CACHE, roots.output_cache)
    walk.run(TRACEBACK, roots.traceback)
    return user_reachable


def _garbage_storages(live: LiveTensors, unclaimed: list[Any], *, budget_objects: int = 20_000,
                      budget_seconds: float = 2.0) -> set[int]:
    """Storages whose tensors sit in unreachable reference cycles, found without collecting.

    A saving ``gc.collect()`` would clear the user's weakrefs and run finalizers; instead this
    runs the collector's own test on the tensors' ancestors: an object is reachable when
    something outside the ancestor set refers to it (its refcount exceeds the references from
    inside), or when a reachable ancestor refers to it. Where the budget runs out, the unexplored
    objects count as reachable, so a tensor is never called garbage by mistake.
    """
    deadline = time.perf_counter() + budget_seconds
    keys = {id(t): live.storage_of[id(t)] for t in unclaimed}
    # The ancestor list holds the only references we keep, so refcounts can be accounted exactly.
    ancestors: list[Any] = list(unclaimed)
    live.tensors[:] = [t for t in live.tensors if id(t) not in keys]
    unclaimed.clear()
    index = {id(o): i for i, o in enumerate(ancestors)}
    external: set[int] = set()
    frontier = list(ancestors)
    while frontier:
        if len(ancestors) > budget_objects or time.perf_counter() > deadline:
            external.update(id(o) for o in frontier)
            break
        ignore = {id(ancestors), id(frontier), id(live.tensors), id(index)}
        found = gc.get_referrers(*frontier)
        ignore.add(id(found))
        frontier = []
        for referrer in found:
            if id(referrer) in ignore or id(referrer) in index:
                continue
            index[id(referrer)] = len(ancestors)
            ancestors.append(referrer)
            if _is_root_like(referrer):
                external.add(id(referrer))  # module globals, classes, running frames: always reachable
            else:
                frontier.append(referrer)
        del found
    referrer = None  # the loop variable would count as an outside reference
    marked = _reachable_ancestors(ancestors, index, external)
    garbage = {keys[id(o)] for i, o in enumerate(ancestors) if id(o) in keys and i not in marked}
    alive = {keys[id(o)] for i, o in enumerate(ancestors) if id(o) in keys and i in marked}
    live.tensors.extend(o for o in ancestors if id(o) in keys)
    ancestors.clear()
    # A storage is garbage only when every tensor viewing it is.
    return garbage - alive


def _reachable_ancestors(ancestors: list[Any], index: dict[int, int], external: set[int]) -> set[int]:
    """Indices of ancestors reachable from outside the set (the collector's test, restricted to it)."""
    inside = [0] * len(ancestors)
    for holder in ancestors:
        for child in gc.get_referents(holder):
            i = index.get(id(child))
            if i is not None:
                inside[i] += 1
    holder = child = None  # loop variables would add to the refcounts read below
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
    current = sys._getframe()
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _referrer_chains(live: LiveTensors, unclaimed: list[Any], *, hops: int = 5,
                     budget_seconds: float = 2.0) -> dict[int, str]:
    """A short chain of referrer types and keys for tensors nothing named holds."""
    deadline = time.perf_counter() + budget_seconds
    by_key: dict[int, Any] = {}
    for t in unclaimed:
        by_key.setdefault(live.storage_of[id(t)], t)
    # Our own containers refer to the tensors too: never report them as holders.
    ours = {id(live.tensors), id(unclaimed), id(by_key), id(sys._getframe())}
    chains: dict[int, str] = {}
    for key in sorted(by_key, key=lambda k: -live.storages[k].bytes):
        if time.perf_counter() > deadline:
            break
        try:
            chains[key] = _chain(by_key[key], ours, hops)
        except Exception:  # a hostile holder on the way: say so rather than fail the snapshot
            chains[key] = "<held by an object that could not be inspected>"
    return chains


def _chain(target: Any, ours: set[int], hops: int) -> str:
    """The Python path from the nearest module global (or outermost holder) down to ``target``."""
    segments: list[str] = []  # innermost first: how each holder reaches the next target
    base = "<held outside Python (C++ or an untracked object)>"
    for _ in range(hops):
        referrers = [r for r in gc.get_referrers(target)
                     if id(r) not in ours and type(r) is not types.FrameType]
        if not referrers:
            break
        holder = referrers[0]
        ours.add(id(referrers))
        if type(holder) is dict and "__name__" in holder and "__spec__" in holder:
            base = f"{holder['__name__']}.{_key_of(holder, target)}"  # a library global
            break
        segments.append(_segment(holder, target))
        base = f"<{type(holder).__qualname__}>"
        target = holder
    else:
        base = f"…<{type(target).__qualname__}>"  # more hops than we follow
    return base + "".join(reversed(segments))


_SHOWN_KEYS = (str, int, float, bool, bytes, type(None))


def _key_text_of(key: object) -> str:
    # Only plain keys are shown: repr() of an arbitrary key runs code we do not control.
    return repr(key) if type(key) in _SHOWN_KEYS else f"<{type(key).__qualname__} key>"


def _key_of(mapping: dict, target: Any) -> str:
    key = next((k for k, v in list(mapping.items()) if v is target), "?")
    return key if type(key) is str else _key_text_of(key)


def _segment(holder: Any, target: Any) -> str:
    """How ``holder`` refers to ``target``, as a path segment (``['key']``, ``[3]``, ``.attr``)."""
    cls = type(holder)
    if cls is dict:
        found = [k for k, v in list(holder.items()) if v is target][:1]
        return f"[{_key_text_of(found[0])}]" if found else "[<key>]"
    if cls in (list, tuple):
        index = next((i for i, v in enumerate(holder) if v is target), "?")
        return f"[{index}]"
    attr = next((k for k, v in list(instance_dict(holder).items()) if v is target), None)
    return f".{attr}" if type(attr) is str else f"→{cls.__qualname__}"
