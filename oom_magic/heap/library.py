"""Re-verify, without a walk, that a storage a library held last time is still held by it alone.

A storage no root reaches is named by a chain of referrers up to a library's module or class
(``…<FunctionMeta>→FunctionMeta['forward']→staticmethod→function[0]``). Finding it again costs a
full walk from the roots (to show no variable reaches it) and a climb through the heap's
referrers. Instead the chain is remembered as a weak reference to its top (the module or class)
and the ids below it, and the next scan descends it through ``gc.get_referents``: it holds when
every link is still there and every object on it, the tensor included, is referred to by its
parent on the chain and by nothing else (its reference count says so). Then no variable reaches
it, except through a module or class, which the walk never enters: the same answer as a walk.
Any doubt and the storage is searched for as on a first scan.

A library function's default argument (``def forward(ctx, x, scale=torch.tensor(1.0))`` in peft's
LoHa layer) is found on a first scan without that climb: one pass picks the heap's functions,
the one whose defaults hold the tensor is found on its module by its qualified name, and is
named so (``peft.tuners.loha.layer.HadaWeight.forward.__defaults__[0]``); a climb through the
referrers took a full heap pass for each of its five links.
"""
from __future__ import annotations

import gc
import operator
import sys
import types
import weakref
from collections import Counter
from itertools import compress, repeat
from typing import Any

from .reads import MISSING, module_dict, type_dict
from .storages import LiveTensors

# storage key -> (weak reference to the chain's top, ids below it down to the tensor, the text).
_CHAINS: dict[int, tuple[weakref.ref, tuple[int, ...], str]] = {}
_KEPT = 10_000


def forget_library_chains() -> None:
    _CHAINS.clear()


def remember_chain(key: int, top: Any, below: list[Any], text: str) -> None:
    """Keep a chain (``below``: the objects under ``top``, the tensor last) for the next scan."""
    try:
        ref = weakref.ref(top)
    except TypeError:  # a top that takes no weak reference: searched again next time
        return
    if len(_CHAINS) >= _KEPT:
        _CHAINS.clear()
    _CHAINS[key] = (ref, tuple(map(id, below)), text)


def still_library_held(live: LiveTensors, claimed: dict[int, Any]) -> dict[int, str]:
    """Storages of ``live`` still held alone by the chain remembered for them: key -> its text."""
    if not _CHAINS:
        return {}
    views = _views(live)
    tensors = {id(t) for t in live.tensors}
    held: dict[int, str] = {}
    for key, (ref, ids, text) in list(_CHAINS.items()):
        if key not in live.sizes or key in claimed:
            continue
        if views.get(key) == 1 and _holds_alone(ref, ids, tensors) and live.storage_of.get(ids[-1]) == key:
            held[key] = text
        else:
            del _CHAINS[key]
    return held


def _views(live: LiveTensors) -> Counter[int]:
    """storage key -> how many of ``live``'s tensors (and bare storages) view it."""
    return Counter(live.storage_of.values())


def _holds_alone(ref: weakref.ref, ids: tuple[int, ...], tensors: set[int]) -> bool:
    parent = ref()
    if parent is None:
        return False
    for child_id in ids:
        kids = gc.get_referents(parent)
        links = 0
        child = None
        for kid in kids:
            if id(kid) == child_id:
                child = kid
                links += 1
        kid = None
        del kids
        if child is None:
            return False
        # Ours: the ``child`` and ``parent`` names (``parent`` once it is the child) and
        # getrefcount's argument; a tensor is also in the scan's list.
        ours = 2 + (1 if child_id in tensors else 0)
        if sys.getrefcount(child) != links + ours:
            return False
        parent = child
        child = None
    return True


_DEFAULTS = types.FunctionType.__dict__["__defaults__"].__get__  # C-level reads: no user code runs
_KWDEFAULTS = types.FunctionType.__dict__["__kwdefaults__"].__get__
_MODULE_OF = types.FunctionType.__dict__["__module__"].__get__
_QUALNAME_OF = types.FunctionType.__dict__["__qualname__"].__get__
_IS_CLASS = type.__subclasscheck__
_WRAPPED = {staticmethod: staticmethod.__dict__["__func__"].__get__,
            classmethod: classmethod.__dict__["__func__"].__get__}


def held_as_defaults(live: LiveTensors, unclaimed: list[Any]) -> dict[int, str]:
    """Storages (each viewed by one tensor) that a function defined on a module or class holds as a
    default argument, found by its qualified name from its module: key -> the path, its chain
    remembered as ``remember_chain``'s."""
    wanted = set(map(id, unclaimed))
    objects = gc.get_objects()
    functions = list(compress(objects, map(operator.is_, map(type, objects), repeat(types.FunctionType))))
    objects.clear()
    views = _views(live)
    found: dict[int, str] = {}
    for function, positional, named in zip(functions, map(_DEFAULTS, functions), map(_KWDEFAULTS, functions)):
        if positional is not None and not wanted.isdisjoint(map(id, positional)):
            for i, value in enumerate(positional):
                if id(value) in wanted:
                    _name_default(live, views, function, positional, value, f".__defaults__[{i}]", found)
        if type(named) is dict and not wanted.isdisjoint(map(id, dict.values(named))):
            for name, value in dict.items(named):
                if id(value) in wanted:
                    _name_default(live, views, function, named, value, f".__kwdefaults__[{name!r}]", found)
    return found


def _name_default(live: LiveTensors, views: Counter[int], function: Any, held_in: Any, tensor: Any, step: str,
                  found: dict[int, str]) -> None:
    key = live.storage_of.get(id(tensor))
    if key is None or key in found or views.get(key) != 1:
        return
    place = _defined_at(function)
    if place is None:
        return
    top, below, path = place
    text = path + step
    found[key] = text
    remember_chain(key, top, [*below, held_in, tensor], text)


def _defined_at(function: Any) -> tuple[Any, list[Any], str] | None:
    """(the module or class whose namespace holds ``function``, the objects from that namespace's
    dict down to the function, its dotted path) when its module and qualified name reach it
    through dicts alone (a class's, a staticmethod's or classmethod's function), else None."""
    module_name, qualname = _MODULE_OF(function), _QUALNAME_OF(function)
    if type(module_name) is not str or type(qualname) is not str or "<" in qualname:
        return None
    module = sys.modules.get(module_name)
    if type(module) is not types.ModuleType:
        return None
    top: Any = module
    namespace = module_dict(module)
    parts = qualname.split(".")
    for part in parts[:-1]:  # the classes the function is defined in
        cls = dict.get(namespace, part, MISSING)
        if not _IS_CLASS(type, type(cls)):  # by the type's MRO: no __class__ of a proxy is read
            return None
        top, namespace = cls, _real_dict(cls)
        if namespace is None:
            return None
    attr = dict.get(namespace, parts[-1], MISSING)
    below = [namespace, attr]
    unwrap = _WRAPPED.get(type(attr))
    if unwrap is not None:
        attr = unwrap(attr)
        below.append(attr)
    if attr is not function:
        return None
    return top, below, f"{module_name}.{qualname}"


def _real_dict(cls: type) -> dict[str, Any] | None:
    """A class's own namespace dict: what its ``__dict__`` proxy refers to."""
    return next((r for r in gc.get_referents(type_dict(cls)) if type(r) is dict), None)
