"""How the walk keeps a slice's children: whether one owner alone holds each, and who that owner is.

An object whose reference count says one owner alone holds it can be reached no other way, so the
walk needs no visited entry for it (most of a heap); the count that says so depends on how the
children were read (``_once_counts``). A child's owner is not kept per child: ``Parents`` keeps
each owner's count of children and a byte per child saying whether it was kept, and works out the
owner, and for a sequence the child's index, only for the objects being named. A position per
child cost a first scan a tenth of its time even in a machine-int array (an int object each had
doubled what the scan holds while it runs).
"""
from __future__ import annotations

import gc
import operator
import sys
from array import array
from bisect import bisect_left, bisect_right
from itertools import accumulate, chain, compress, islice, repeat
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


def _once_followed() -> int:
    """The reference count of an object one owner alone holds, read as a followed chain reads it: in
    its owner's referents, looped over (``Walk._follow``)."""
    owner = [object()]
    for kid in gc.get_referents(owner):
        return sys.getrefcount(kid)
    raise AssertionError("a list's referents hold its item")


# Such an object is reached through that owner alone, so the walk needs no visited entry for it
# (most of a heap); free-threaded builds count references per thread: every object is looked up there.
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
ONCE_ITERATED = _once_counts(False) if _GIL else (-1, -1)
ONCE_LISTED = _once_counts(True) if _GIL else (-1, -1)
ONCE_FOLLOWED = _once_followed() if _GIL else -1


class Parents:
    """Who holds each kept child of one expanded slice, with no entry per child. Children come in
    chunks, one per group of owners read together (``add``): its owners, how many children each
    has, which of those children were kept (a byte each; None: all) and whether the owners are read
    as sequences (lists, tuples, namedtuples, sets, deques), whose child's index within its owner
    is its place there, never searched for. ``part`` and ``keep`` narrow the kept children as the
    walk marks them, sharing the chunks; an owner is worked out (``of``) only for the few children
    being named."""

    __slots__ = ("_chunks", "_ends", "_lo", "_picked")

    def __init__(self, chunks: list[_Chunk] | None = None, ends: array[int] | None = None, lo: int = 0,
                 picked: bytes | None = None) -> None:
        self._chunks = chunks if chunks is not None else []
        self._ends = ends if ends is not None else array("q")  # the kept children up to each chunk's end
        self._lo, self._picked = lo, picked  # from the ``lo``-th kept child on, those ``picked`` keeps

    def add(self, objs: list[Any], lens: Iterable[int], kept: bytes | None, count_kept: int,
            sequence: bool = False, first: int = 0) -> None:
        """A chunk: owners ``objs`` with ``lens`` children each, ``kept`` marking those kept (None: all,
        ``count_kept`` of them); ``first``: the first child's index within the first owner."""
        if count_kept:
            self._chunks.append(_Chunk(objs, lens, kept, sequence, first))
            self._ends.append((self._ends[-1] if self._ends else 0) + count_kept)

    def part(self, start: int) -> Parents:
        """The kept children from ``start`` on (of a Parents no ``keep`` narrowed), for a slice of them."""
        return Parents(self._chunks, self._ends, self._lo + start)

    def keep(self, mask: list[bool]) -> Parents:
        """The children ``mask`` keeps of these (``mask``: one flag per child of this one)."""
        if all(mask):
            return self
        if self._picked is not None:  # narrowed twice: the second mask applies to the first's kept ones
            flags = iter(mask)
            mask = [bool(p) and next(flags) for p in self._picked]
        return Parents(self._chunks, self._ends, self._lo, bytes(mask))

    def of(self, positions: Iterable[int], indexes: dict[int, int], kids: list[int]) -> list[Any]:
        """The owners of the children at these indexes (of this one's kept children, ascending); the index
        within its owner of each child of a sequence goes into ``indexes`` (id -> index; ``kids``: their ids)."""
        chunks, ends, lo = self._chunks, self._ends, self._lo
        ranks = list(positions)
        if self._picked is not None:
            ranks = set_positions(self._picked, ranks)
        owners: list[Any] = []
        at = 0
        while at < len(ranks):  # the children of one chunk at a time
            c = bisect_right(ends, lo + ranks[at])
            start = ends[c - 1] if c else 0
            stop = bisect_left(ranks, ends[c] - lo, at)
            chunk = chunks[c]
            mine = [lo + r - start for r in ranks[at:stop]]
            places, within = chunk.owners(set_positions(chunk.kept, mine) if chunk.kept is not None else mine)
            owners += map(chunk.objs.__getitem__, places)
            if chunk.sequence:
                for kid, index in zip(kids[at:stop], within):
                    indexes.setdefault(kid, index)
            at = stop
        return owners


class _Chunk:
    """One group of owners read together: the owner of one of their children, and its index within it."""

    __slots__ = ("_starts", "_step", "first", "kept", "lens", "objs", "sequence")

    def __init__(self, objs: list[Any], lens: Iterable[int], kept: bytes | None, sequence: bool,
                 first: int) -> None:
        self.objs, self.kept, self.sequence, self.first = objs, kept, sequence, first
        lens = list(lens)
        try:
            self.lens: bytes | array[int] = bytes(lens)  # a byte per owner where each has < 256 children
        except ValueError:
            self.lens = array("q", lens)
        # Owners of one size (records of one class, dicts of one shape): the owner is a division away.
        self._step = lens[0] if len(lens) > 1 and lens[0] and self.lens.count(lens[0]) == len(lens) else 0
        self._starts: list[int] | None = None

    def owners(self, positions: list[int]) -> tuple[list[int], list[int]]:
        """For the children at these positions: their owners' places in ``objs``, and each child's index
        within its owner (C-level passes, none per child in Python)."""
        if len(self.lens) == 1:
            return [0] * len(positions), [p + self.first for p in positions]
        if self._step:
            step = self._step
            return [p // step for p in positions], [p % step for p in positions]
        if self._starts is None:  # where each owner's children start: made only for the chunks being named
            self._starts = [0, *accumulate(self.lens)]
        places = [bisect_right(self._starts, p) - 1 for p in positions]
        return places, list(map(operator.sub, positions, map(self._starts.__getitem__, places)))


_BLOCK, _PART = 256, 64
_BATCH = 64  # blocks counted per C-level pass, as far as the ranks asked reach


def set_positions(mask: bytes, ranks: list[int]) -> list[int]:
    """Where the set bytes of ``mask`` numbered ``ranks`` (ascending, from 0) are: the set bytes of each
    block counted in C, a batch of blocks at a time and only as far as the ranks reach, then within the
    block holding a rank those of each part, and that part alone listed (every set byte listed at once
    where many are asked for). A few children named out of a slice of thousands cost microseconds,
    where listing every set position cost a millisecond a slice."""
    size = len(mask)
    if len(ranks) * 64 > size:
        every = list(compress(range(size), mask))
        return list(map(every.__getitem__, ranks))
    before = [0]  # before[b]: the set bytes ahead of block b, for the blocks counted so far
    found: list[int] = []
    for rank in ranks:
        while before[-1] <= rank:  # count on: the rank lies past the blocks counted
            lo = (len(before) - 1) * _BLOCK
            hi = min(lo + _BATCH * _BLOCK, size)
            counts = map(mask.count, repeat(1), range(lo, hi, _BLOCK), range(lo + _BLOCK, hi + _BLOCK, _BLOCK))
            before += islice(accumulate(counts, initial=before[-1]), 1, None)
        block = bisect_right(before, rank) - 1
        part, seen = block * _BLOCK, before[block]
        while seen + (in_part := mask.count(1, part, part + _PART)) <= rank:
            seen += in_part
            part += _PART
        found.append(next(islice(compress(range(part, part + _PART), mask[part:part + _PART]), rank - seen, None)))
    return found
