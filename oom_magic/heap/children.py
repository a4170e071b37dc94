"""How the walk keeps a slice's children: whether one owner alone holds each, and who that owner is.

An object whose reference count says one owner alone holds it can be reached no other way, so the
walk needs no visited entry for it (most of a heap); the count that says so depends on how the
children were read (``_once_counts``). A child's owner is not kept per child: ``Parents`` keeps
each owner and where its children end, and finds the owner back by position, and for a sequence
the child's index, only for the objects being named. Positions are kept in machine-int arrays: an
int object per child would double what a first scan's walk holds while it runs.
"""
from __future__ import annotations

import gc
import sys
from array import array
from bisect import bisect_right
from itertools import accumulate, chain, compress, islice
from typing import Any
from collections.abc import Iterable


def _once_counts(through_lists: bool) -> tuple[int, int]:
    """The reference count of an object one owner alone holds, read as the walk's ``_extend`` reads it: (in the
    flat list of the owners' children, in that list's tracked part too); ``through_lists``: the children
    were read into a list per owner (gc.get_referents), alive meanwhile, not iterated from the owner."""
    owner = [object()]  # the only reference to the object
    lists = [gc.get_referents(owner)] if through_lists else [owner]
    flat = list(chain.from_iterable(lists))
    in_flat = next(map(sys.getrefcount, flat))
    kept = list(compress(flat, [True]))
    return in_flat, next(map(sys.getrefcount, kept))


# Such an object is reached through that owner alone, so the walk needs no visited entry for it
# (most of a heap); free-threaded builds count references per thread: every object is looked up there.
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
ONCE_ITERATED = _once_counts(False) if _GIL else (-1, -1)
ONCE_LISTED = _once_counts(True) if _GIL else (-1, -1)


class Parents:
    """Who holds each child of one expanded slice, without an entry per child: the child at position
    ``p`` of the slice's children (atoms included) belongs to ``objs[bisect_right(ends, p)]``; ``at``
    holds each kept child's position, in the order of the kept children. ``sequences``: the ranges
    of owners read as sequences (lists, tuples, namedtuples, sets, deques), whose child at position
    ``p`` is their item ``p - (the owner's first position)``: its index, never searched for."""

    __slots__ = ("at", "ends", "objs", "sequences")

    def __init__(self, objs: list[Any], ends: Iterable[int] = (), at: Iterable[int] = (),
                 sequences: list[tuple[int, int]] | None = None) -> None:
        self.objs = objs
        self.ends, self.at = _positions(ends), _positions(at)
        self.sequences = sequences if sequences is not None else []

    def add(self, objs: list[Any], lens: Iterable[int], sequence: bool = False) -> int:
        """Append owners and how many children each has; the position of their first child."""
        base = self.ends[-1] if self.ends else 0
        if sequence:
            self.sequences.append((len(self.objs), len(self.objs) + len(objs)))
        self.objs.extend(objs)
        self.ends.extend(islice(accumulate(lens, initial=base), 1, None))
        return base

    def part(self, start: int, stop: int) -> Parents:
        return Parents(self.objs, self.ends, self.at[start:stop], self.sequences)

    def keep(self, mask: Iterable[bool]) -> Parents:
        return Parents(self.objs, self.ends, compress(self.at, mask), self.sequences)

    def of(self, positions: Iterable[int], indexes: dict[int, int], kids: list[int]) -> list[Any]:
        """The owners of the kept children at these indexes of ``at``; the index within its owner of
        each child of a sequence goes into ``indexes`` (id -> index; ``kids``: the children's ids)."""
        objs, ends, at, sequences = self.objs, self.ends, self.at, self.sequences
        owners = []
        for i, kid in zip(positions, kids):
            owner = bisect_right(ends, at[i])
            owners.append(objs[owner])
            if sequences and any(lo <= owner < hi for lo, hi in sequences):
                indexes.setdefault(kid, at[i] - (ends[owner - 1] if owner else 0))
        return owners


def _positions(values: Iterable[int]) -> array[int]:
    """Positions as one machine int each (an array passed in is shared, not copied)."""
    return values if isinstance(values, array) else array("q", values)
