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
"""
from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

from .tracker import LiveTensors

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
    views: dict[int, int] = {}
    for key in live.storage_of.values():
        views[key] = views.get(key, 0) + 1
    tensors = {id(t) for t in live.tensors}
    held: dict[int, str] = {}
    for key, (ref, ids, text) in list(_CHAINS.items()):
        if key not in live.storages or key in claimed:
            continue
        if views.get(key) == 1 and _holds_alone(ref, ids, tensors) and live.storage_of.get(ids[-1]) == key:
            held[key] = text
        else:
            del _CHAINS[key]
    return held


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
