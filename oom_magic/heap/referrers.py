"""Find what refers to a set of objects in one heap pass, whatever the set's size.

``gc.get_referrers(*targets)`` compares every reference in the heap with each target in turn:
a pass costs about the floor (``gc.get_objects()``) plus the floor again for every ~60 targets,
so climbing from 1,000 tensors at once costs ~17 floors a level. Past ``FEW`` targets the heap
is read instead in chunks through ``gc.get_referents`` (each type's C-level ``tp_traverse``,
no user code), their ids looked up in one set: ~5 floors a level, whatever the set's size.
Both answer the same objects in the same order (the collector's generations, oldest last).
"""
from __future__ import annotations

import gc
from typing import Any

# Targets up to this many are searched by gc.get_referrers itself (cheaper for a few).
FEW = 200
# Objects read per gc.get_referents call: one C call for many objects, then a look at each only
# in the chunks that hold a referrer.
CHUNK = 8192


def referrers_of(targets: list[Any], generation: int | None = None) -> list[Any]:
    """The gc-tracked objects that refer to any of ``targets``, in the order of ``gc.get_referrers``;
    only those of one of the collector's generations where ``generation`` is given (0 and 1
    are small: the young objects a search looks among first)."""
    if generation is None and len(targets) <= FEW:
        return gc.get_referrers(*targets)
    wanted = set(map(id, targets))
    isdisjoint = wanted.isdisjoint
    found: list[Any] = []
    objects = gc.get_objects() if generation is None else gc.get_objects(generation)
    try:
        for start in range(0, len(objects), CHUNK):
            chunk = objects[start:start + CHUNK]
            if isdisjoint(map(id, gc.get_referents(*chunk))):
                continue
            found.extend(o for o in chunk if not isdisjoint(map(id, gc.get_referents(o))))
            del chunk
    finally:
        objects.clear()  # every object's count is back as it was: the caller reads reference counts
    return found
