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
from collections import deque
from dataclasses import dataclass
from itertools import compress
from typing import Any, Iterator

from .roots import Roots
from .tracker import LiveTensors

USER, OUTPUT_CACHE, TRACEBACK, GARBAGE, OTHER = "user", "output-cache", "traceback", "garbage", "other"
STALE_KINDS = (OUTPUT_CACHE, TRACEBACK, GARBAGE)

_ATOMIC = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range,
                     type(Ellipsis), type(NotImplemented), memoryview})
_NEVER_DESCEND = frozenset({types.ModuleType, type, types.BuiltinFunctionType,
                            types.MethodWrapperType, types.WrapperDescriptorType,
                            types.CodeType, types.GetSetDescriptorType, types.MemberDescriptorType,
                            weakref.ref})
_KEY_MARK = re.compile("\x00(\\d+):(\\d+)\x00")
# nn.Module internals shown as attributes, and hook dicts that only hold callables.
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


class _Walk:
    """Breadth-first walk from named roots; the first path reaching a storage wins."""

    def __init__(self, live: LiveTensors, tensor_types: frozenset[type], torch: Any,
                 skip: tuple[object, ...], budget_nodes: int, deadline: float) -> None:
        self.storage_of = live.storage_of
        self.tensor_types = tensor_types
        self.module_type = getattr(getattr(torch, "nn", None), "Module", None)
        self.holders: dict[int, Holder] = {}
        self.visited: set[int] = {id(o) for o in skip}
        self.tensor_paths: dict[int, str] = {}
        self.nodes = 0
        self.budget_nodes = budget_nodes
        self.deadline = deadline
        self.complete = True

    def run(self, kind: str, roots: tuple[tuple[str, object], ...]) -> None:
        queue: deque[tuple[object, str, str]] = deque((obj, name, name) for name, obj in roots)
        while queue:
            obj, path, root = queue.popleft()
            if id(obj) in self.visited:
                continue
            self.visited.add(id(obj))
            self.nodes += 1
            if self.nodes >= self.budget_nodes or (self.nodes & 1023 == 0 and time.perf_counter() > self.deadline):
                self.complete = False
                return
            cls = type(obj)
            if cls in self.tensor_types:
                key = self.storage_of.get(id(obj))
                self.tensor_paths.setdefault(id(obj), path)
                if key is not None and key not in self.holders:
                    self.holders[key] = Holder(kind, path, root)
            for child, child_path in self._children(obj, cls, path):
                if id(child) not in self.visited:
                    queue.append((child, child_path, root))

    def _children(self, obj: Any, cls: type, path: str) -> Iterator[tuple[object, str]]:
        try:
            if cls in self.tensor_types:
                yield from _tensor_children(obj, path)
            elif cls is dict or (issubclass(cls, dict)):
                yield from self._dict_children(obj, path)
            elif cls is list or cls is tuple or issubclass(cls, (list, tuple)):
                seq = list.__iter__(obj) if issubclass(cls, list) else tuple.__iter__(obj)
                for i, item in enumerate(seq):
                    if type(item) not in _ATOMIC:
                        yield item, f"{path}[{i}]"
            elif issubclass(cls, (set, frozenset)):
                for i, item in enumerate(set.__iter__(obj) if issubclass(cls, set) else frozenset.__iter__(obj)):
                    if type(item) not in _ATOMIC:
                        yield item, f"{path}{{#{i}}}"
            elif cls in _ATOMIC or cls in _NEVER_DESCEND or issubclass(cls, type):
                return
            elif cls is types.FunctionType:
                yield from _function_children(obj, path)
            elif cls is types.MethodType:
                yield obj.__self__, path + ".__self__"
            elif cls is types.TracebackType:
                yield from _traceback_children(obj, path)
            elif cls is types.FrameType:
                yield from _frame_children(obj, path)
            elif issubclass(cls, BaseException):
                yield from _exception_children(obj, path)
            elif cls.__name__ == "_lru_cache_wrapper":
                for i, ref in enumerate(gc.get_referents(obj)):
                    if type(ref) is dict:
                        yield ref, f"{path}.cache"
                wrapped = _instance_dict(obj).get("__wrapped__")
                if wrapped is not None:
                    yield wrapped, f"{path}.__wrapped__"
            elif cls.__name__ == "cell":
                yield obj.cell_contents, path
            elif self.module_type is not None and issubclass(cls, self.module_type):
                yield from _module_children(obj, path)
            else:
                yield from _object_children(obj, cls, path)
        except Exception:
            # A hostile or half-built object: walk what we got, skip the rest.
            return

    def _dict_children(self, obj: dict, path: str) -> Iterator[tuple[object, str]]:
        items = list(dict.items(obj))
        values = [v for _, v in items]
        keep = list(map(_ATOMIC.__contains__, map(type, values)))
        for i, ((key, value), atomic) in enumerate(zip(items, keep)):
            key_text = self._key_text(key, i)
            if type(key) not in _ATOMIC:
                yield key, f"{path}.keys()[{i}]"
            if not atomic:
                yield value, f"{path}[{key_text}]"

    def _key_text(self, key: object, index: int) -> str:
        if type(key) in (str, int, float, bool, type(None)):
            return repr(key)
        if type(key) in self.tensor_types:
            # The key's own path may be found later in the walk: resolved in named_paths().
            return f"\x00{id(key)}:{index}\x00"
        return f"<key #{index}>"

    def named_paths(self) -> dict[int, Holder]:
        """Holders with tensor dict keys shown by their path (``opt.state[model.fc.weight]``)."""
        def name(match: re.Match) -> str:
            path = self.tensor_paths.get(int(match.group(1)))
            return path if path is not None and "\x00" not in path else f"<key #{match.group(2)}>"

        return {k: Holder(h.kind, _KEY_MARK.sub(name, h.path), h.root) if "\x00" in h.path else h
                for k, h in self.holders.items()}


def _instance_dict(obj: object) -> dict:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return {}
    return d if type(d) is dict else {}


def _tensor_children(tensor: Any, path: str) -> Iterator[tuple[object, str]]:
    # .grad on a non-leaf warns; only leaves carry a user-visible gradient.
    if tensor.is_leaf:
        grad = tensor.grad
        if grad is not None:
            yield grad, path + ".grad"
    for name, value in list(_instance_dict(tensor).items()):
        yield value, f"{path}.{name}"


def _attr(path: str, name: object) -> str:
    if isinstance(name, str) and name.isdigit():
        return f"{path}[{name}]"
    return f"{path}.{name}"


def _module_children(module: Any, path: str) -> Iterator[tuple[object, str]]:
    attrs = _instance_dict(module)
    for group in _MODULE_CHILD_DICTS:
        children = attrs.get(group)
        if type(children) is dict:
            for name, value in list(children.items()):
                if value is not None:
                    yield value, _attr(path, name)
    for name, value in list(attrs.items()):
        if name not in _MODULE_CHILD_DICTS and type(value) not in _ATOMIC and not (
            isinstance(name, str) and name.startswith("_") and name.endswith("hooks")
        ):
            yield value, f"{path}.{name}"


def _object_children(obj: object, cls: type, path: str) -> Iterator[tuple[object, str]]:
    for name, value in list(_instance_dict(obj).items()):
        if type(value) not in _ATOMIC:
            yield value, f"{path}.{name}"
    for klass in cls.__mro__:
        for slot in klass.__dict__.get("__slots__", ()) if isinstance(klass.__dict__.get("__slots__", ()), (tuple, list)) else ():
            try:
                value = object.__getattribute__(obj, slot)
            except Exception:
                continue
            yield value, f"{path}.{slot}"


def _function_children(func: types.FunctionType, path: str) -> Iterator[tuple[object, str]]:
    for i, cell in enumerate(func.__closure__ or ()):
        try:
            yield cell.cell_contents, f"{path}.__closure__[{i}]"
        except ValueError:  # an empty cell
            continue
    for i, value in enumerate(func.__defaults__ or ()):
        yield value, f"{path}.__defaults__[{i}]"
    for name, value in (func.__kwdefaults__ or {}).items():
        yield value, f"{path}.__kwdefaults__[{name!r}]"
    wrapped = func.__dict__.get("__wrapped__")
    if wrapped is not None:
        yield wrapped, f"{path}.__wrapped__"


def _traceback_children(tb: types.TracebackType, path: str) -> Iterator[tuple[object, str]]:
    while tb is not None:
        yield tb.tb_frame, path
        tb = tb.tb_next


def _frame_children(frame: types.FrameType, path: str) -> Iterator[tuple[object, str]]:
    # A module-level frame's locals are the user's (or a library's) globals: walked elsewhere.
    if frame.f_code.co_flags & 0x1 == 0:  # CO_OPTIMIZED unset: module or class body
        return
    for name, value in list(frame.f_locals.items()):
        yield value, f"{path} → frame {frame.f_code.co_name} → local {name}"


def _exception_children(exc: BaseException, path: str) -> Iterator[tuple[object, str]]:
    if exc.__traceback__ is not None:
        yield exc.__traceback__, path
    for i, arg in enumerate(exc.args):
        yield arg, f"{path}.args[{i}]"
    if exc.__cause__ is not None:
        yield exc.__cause__, f"{path}.__cause__"
    if exc.__context__ is not None:
        yield exc.__context__, f"{path}.__context__"
    for name, value in list(_instance_dict(exc).items()):
        yield value, f"{path}.{name}"


def attribute(live: LiveTensors, roots: Roots, torch: Any, tensor_types: frozenset[type], *,
              budget_nodes: int = 2_000_000, budget_seconds: float = 5.0,
              find_garbage: bool = True, trace_other: bool = True) -> Attribution:
    """Find a holder for every storage in ``live`` (user → output-cache → traceback → garbage → other)."""
    walk = _Walk(live, tensor_types, torch, roots.containers + (live.tensors, live.storage_of, sys.modules),
                 budget_nodes, time.perf_counter() + budget_seconds)
    walk.run(USER, roots.user)
    user_reachable = frozenset(walk.visited)
    walk.run(OUTPUT_CACHE, roots.output_cache)
    walk.run(TRACEBACK, roots.traceback)
    holders = walk.named_paths()
    unclaimed = [t for t in live.tensors if live.storage_of[id(t)] not in holders]
    if unclaimed and find_garbage:
        for key in _garbage_storages(live, unclaimed):
            holders.setdefault(key, Holder(GARBAGE, "unreachable reference cycle", "gc"))
        unclaimed = [t for t in live.tensors if live.storage_of[id(t)] not in holders]
    if unclaimed and trace_other:
        for key, chain in _referrer_chains(live, unclaimed).items():
            holders.setdefault(key, Holder(OTHER, chain, "referrers"))
    return Attribution(holders, walk.complete, walk.nodes, user_reachable)


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
                     budget_seconds: float = 0.5) -> dict[int, str]:
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
        segments: list[str] = []  # innermost first: how each holder reaches the next target
        base = "<held outside Python (C++ or an untracked object)>"
        target: Any = by_key[key]
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
        chains[key] = base + "".join(reversed(segments))
    return chains


def _key_of(mapping: dict, target: Any) -> str:
    return next((str(k) for k, v in list(mapping.items()) if v is target), "?")


def _segment(holder: Any, target: Any) -> str:
    """How ``holder`` refers to ``target``, as a path segment (``['key']``, ``[3]``, ``.attr``)."""
    cls = type(holder)
    if cls is dict:
        key = next((k for k, v in list(holder.items()) if v is target), None)
        return f"[{key!r}]" if key is not None else "[<key>]"
    if cls in (list, tuple):
        index = next((i for i, v in enumerate(holder) if v is target), "?")
        return f"[{index}]"
    attr = next((k for k, v in list(_instance_dict(holder).items()) if v is target), None)
    return f".{attr}" if attr is not None else f"→{cls.__qualname__}"
