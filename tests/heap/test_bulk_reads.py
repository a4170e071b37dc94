"""The engine's bulk passes give what their one-object-at-a-time forms give, on real objects.

The walk reads a slice's children with one list per slice and finds each child's parent back
from positions (``children.Parents``); grouping reads the heap pass's tensors in C-level passes; a steady
scan re-reads many remembered paths a step at a time over all of them (``resolve_columns``);
records are made without a frozen ``__setattr__`` per field. Each is held here to the plain form.
"""
from __future__ import annotations

import collections
import dataclasses
import gc

import numpy as np
import pytest
import torch

from oom_magic.heap import storages as heap_storages
from oom_magic.heap.holders import Holder
from oom_magic.heap.reads import MISSING
from oom_magic.heap.remembered import RememberedPaths
from oom_magic.heap.resolve import column_form, resolve, resolve_columns
from oom_magic.heap.names import Namer
from oom_magic.heap.walk import Walk
from oom_magic.records.snapshot import USER, StorageRecord, storage_records


class Token:
    __slots__ = ("id", "text", "vector")

    def __init__(self, i: int, vector: object) -> None:
        self.id, self.text, self.vector = i, f"t{i}", vector


class Row:
    def __init__(self, i: int, embedding: object) -> None:
        self.id, self.embedding = i, embedding


Pair = collections.namedtuple("Pair", "id tensor")


def _heap() -> dict[str, object]:
    """Every kind the walk expands in bulk: slot records, dict instances, dicts, lists, tuples, sets,
    a deque, a numpy object array, and objects held twice (visited, not once)."""
    shared = torch.ones(3)
    tokens = [Token(i, torch.ones(2) if i % 7 == 0 else [i, i + 1]) for i in range(300)]
    return {
        "tokens": tokens,
        "rows": [Row(i, torch.ones(1) if i % 5 == 0 else None) for i in range(200)],
        "cache": {f"layer_{i}": (torch.ones(2), torch.ones(2)) for i in range(50)},
        "pairs": {(i, f"s{i}") for i in range(40)} | {(99, "t")},
        "queue": collections.deque({"obs": torch.ones(1), "step": i} for i in range(30)),
        "column": np.array([torch.ones(1), None, shared], dtype=object),
        "twice": [shared, shared, tokens[7]],
        "table": [Pair(i, torch.ones(1)) for i in range(20)],  # a namedtuple: read as a tuple
        "maxima": torch.max(torch.ones(3, 2), 0),  # torch.return_types.max, a struct sequence
    }


def _children(obj: object) -> list[int]:
    if type(obj) is dict:
        return list(map(id, obj.values()))
    if type(obj) is np.ndarray:
        return list(map(id, obj.ravel().tolist()))
    if isinstance(obj, tuple):  # a namedtuple or struct sequence is read as its items
        return list(map(id, tuple.__iter__(obj)))
    return list(map(id, gc.get_referents(obj)))


def test_every_object_the_walk_reaches_has_the_parent_that_holds_it():
    heap = _heap()
    walk, reached, parents = _walked(heap)
    try:
        assert len(reached) >= 43 + 40 + 100 + 30 + 2 + 20 + 2
        assert len(parents) > len(reached)  # with every ancestor up to the roots
        assert id(heap["column"][0]) in parents  # an untracked object array's item
    finally:
        walk.release()


def _walked(heap: dict[str, object]) -> tuple[Walk, list[int], dict[int, object]]:
    """The walk of ``heap`` (release it), the ids of the tensors it reached and their parents up to
    the roots, each checked to be a real referent of the parent given for it."""
    # Held here as a scan holds them (so each is looked up, not taken as held once): read back whole chains.
    tensors = [o for o in gc.get_objects() if type(o) is torch.Tensor]
    walk = Walk([heap, tensors])
    walk.start(USER, list(heap.items()))
    walk.run()
    reached = [id(t) for t in tensors if walk.reached(id(t))]
    parents = walk.parents_of(reached)
    for child, parent in parents.items():
        if type(parent).__name__ != "Root":
            assert child in _children(parent), type(parent)
    return walk, reached, parents


def test_owners_are_found_back_from_a_byte_per_child_across_wide_slices():
    """Slices of thousands of owners whose children are mostly atoms (each kept child's place is a byte
    in a mask tens of thousands long), owners of one size and of many sizes, lists read as sequences:
    every child named has the parent that holds it, and an item its index."""
    records = [Token(i, torch.ones(1) if i % 97 == 0 else (i, [i])) for i in range(20_000)]
    ragged = [{"k": i, "v": [i] * (i % 5), **({"t": torch.ones(1)} if i % 89 == 0 else {})} for i in range(9_000)]
    rows = [[i, f"s{i}", torch.ones(1)] if i % 83 == 0 else [i, f"s{i}", None] for i in range(9_000)]
    walk, reached, parents = _walked({"records": records, "ragged": ragged, "rows": rows})
    try:
        assert len(reached) == len(range(0, 20_000, 97)) + len(range(0, 9_000, 89)) + len(range(0, 9_000, 83))
        for i in range(0, 9_000, 83):  # a row's tensor: its index, read by the walk
            assert walk.indexes[id(rows[i][2])] == 2 and parents[id(rows[i][2])] is rows[i]
            assert walk.indexes[id(rows[i])] == i
    finally:
        walk.release()


def test_set_positions_finds_each_numbered_set_byte():
    import random

    from oom_magic.heap.children import set_positions

    rng = random.Random(24)
    for size in (1, 255, 256, 257, 4095, 4096, 4097, 40_000):
        for density in (0.02, 0.5, 1.0):
            mask = bytes(rng.random() < density for _ in range(size))
            every = [i for i, b in enumerate(mask) if b]
            for asked in (1, 7, len(every)):
                ranks = sorted(rng.sample(range(len(every)), min(asked, len(every))))
                assert set_positions(mask, ranks) == [every[r] for r in ranks], (size, density, asked)


def test_grouping_in_c_level_passes_equals_grouping_one_by_one(monkeypatch):
    base = torch.zeros(40, 10)
    empty = torch.empty(0)
    tensors = [base, base[3], base[5:9], torch.ones(7, dtype=torch.float16), empty, empty[0:0],
               torch.empty(4, device="meta"), torch.eye(5).to_sparse(), torch.ones(3).untyped_storage(),
               torch.nn.Parameter(torch.ones(2, 2))]
    types = heap_storages.tensor_types(torch)

    # Each its own storage: grouped as columns (no row each), a storage held alone after them.
    own = [torch.ones(3), torch.zeros(2, dtype=torch.float16), torch.nn.Parameter(torch.ones(5))]
    alone = torch.ones(6).untyped_storage()
    own_tensors = [*own, alone, *(t.untyped_storage() for t in own)]  # and the storage objects a read leaves

    def grouped(tensors=tensors):
        live = heap_storages.group_storages(list(tensors), types)
        try:
            return (live.storages, sorted(live.storage_of.values()), live.byteless, live.unreadable, live.sizes,
                    live.records())
        finally:
            live.release()

    in_bulk, own_in_bulk = grouped(), grouped(own_tensors)
    def one_by_one(dense, figures, reader, device, groups, claimed, kept, storage_of, device_names, counts, bulk):
        heap_storages._group_each(dense, reader, device, groups, claimed, kept, storage_of, device_names, counts)
        heap_storages._drop_placeholders(groups)

    monkeypatch.setattr(heap_storages, "_group_dense", one_by_one)
    assert grouped() == in_bulk and grouped(own_tensors) == own_in_bulk
    assert [r.key for r in own_in_bulk[-1]] == [*(t.untyped_storage()._cdata for t in own), alone._cdata]
    assert own_in_bulk[4] == {r.key: r.bytes for r in own_in_bulk[-1]} and own_in_bulk[4][alone._cdata] == 24
    storages, _, byteless, _, _, _ = in_bulk
    assert storages[base.untyped_storage()._cdata].tensor_count == 3
    assert storages[base.untyped_storage()._cdata].shape == (40, 10)
    assert byteless == 3  # the meta tensor and the two views of the empty storage


def test_a_meta_or_sparse_tensor_past_the_first_chunk_sends_them_all_one_by_one(monkeypatch):
    # Read a chunk at a time: the chunk holding a meta and a sparse tensor is not the first.
    many = [torch.full((1,), float(i)) for i in range(heap_storages.CHUNK + 3)]
    odd = [torch.empty(2, device="meta"), torch.eye(3).to_sparse()]
    tensors = [*many, *odd, *(torch.ones(2) for _ in range(3))]
    types = heap_storages.tensor_types(torch)

    def grouped(tensors=tensors):
        live = heap_storages.group_storages(list(tensors), types)
        try:
            return live.storages, live.byteless, live.unreadable, live.sizes
        finally:
            live.release()

    by_chunks, dense_by_chunks = grouped(), grouped(many)
    monkeypatch.setattr(heap_storages, "CHUNK", len(tensors) + 1)  # one chunk: the same answer
    assert grouped() == by_chunks and grouped(many) == dense_by_chunks
    records, byteless, unreadable, sizes = by_chunks
    assert byteless == 1 and unreadable == 0 and len(records) == len(many) + 1 + 3
    assert records[heap_storages._Reader(torch).key(many[-1])].shape == (1,) and set(sizes) == set(records)


def test_a_device_asked_about_leaves_the_others_out():
    tensors = [torch.ones(4), torch.ones(4)[1:]]
    live = heap_storages.group_storages(list(tensors), heap_storages.tensor_types(torch), "cuda:0")
    assert live.storages == {} and live.tensors == [] and live.byteless == 0


def _paths() -> tuple[dict[str, object], list[tuple[str, tuple]]]:
    heap = _heap()
    paths = [("tokens", (("index", i), ("attr", "vector"))) for i in range(0, 300, 7)]
    paths += [("rows", (("index", i), ("",), ("key", "embedding"))) for i in range(0, 200, 5)]
    paths += [("cache", (("key", f"layer_{i}"), ("index", 1))) for i in range(50)]
    return heap, paths


def test_paths_re_read_together_reach_what_each_re_read_alone_reaches():
    heap, paths = _paths()
    groups: dict[tuple, list[tuple]] = {}
    for name, steps in paths:
        ops, arguments = column_form(steps)
        groups.setdefault((name, ops), []).append((steps, arguments))
    assert len(groups) == 3
    for (name, ops), members in groups.items():
        columns = [list(values) for values in zip(*(arguments for _, arguments in members))]
        together = resolve_columns(heap[name], ops, columns)
        alone = [resolve(heap[name], steps) for steps, _ in members]
        assert together is not None and all(a is b for a, b in zip(together, alone))
        assert all(type(t) is torch.Tensor for t in together)


@pytest.mark.parametrize("break_it", ["index past the end", "unset slot", "mixed types", "missing key"])
def test_paths_that_cannot_all_be_re_read_together_say_so(break_it: str):
    heap, _ = _paths()
    ops, _ = column_form((("index", 0), ("attr", "vector")))
    indexes = [0, 7, 14]
    if break_it == "index past the end":
        indexes.append(10_000)
    elif break_it == "unset slot":
        heap["tokens"].append(Token.__new__(Token))
        indexes.append(len(heap["tokens"]) - 1)
    elif break_it == "mixed types":
        heap["tokens"].append(Row(1, torch.ones(1)))
        indexes.append(len(heap["tokens"]) - 1)
    else:
        ops, _ = column_form((("key", "layer_0"), ("index", 1)))
        assert resolve_columns(heap["cache"], ops, [["layer_0", "no such layer"]]) is None
        return
    assert resolve_columns(heap["tokens"], ops, [indexes]) is None
    assert resolve(heap["tokens"], (("index", indexes[-1]), ("attr", "vector"))) is MISSING


def test_remembered_paths_join_their_column_as_they_come():
    _, paths = _paths()
    added, rebuilt = RememberedPaths(1_000), RememberedPaths(1_000)
    added.columns()  # built empty, then grown path by path
    for key, (name, steps) in enumerate(paths):
        holder = Holder(USER, f"{name}#{key}", name)
        added.remember(key, name, steps, holder)
        rebuilt.remember(key, name, steps, holder)
    assert added.columns() == rebuilt.columns()
    columns, singles = added.columns()
    assert len(columns) == 3 and singles == []
    added.remember(0, "tokens", (("index", 0), ("cell",)), Holder(USER, "changed", "tokens"))
    columns, singles = added.columns()  # a changed path: rebuilt, and one by one now
    assert singles == [0] and 0 not in columns[("tokens", (("index", None), ("attr", "vector")))].keys


def test_records_made_in_bulk_are_the_dataclass_records():
    made, other = storage_records([1, 2], ["cpu"] * 2, [16] * 2, ["float32"] * 2, [(4,)] * 2, [2] * 2, [99, 0])
    plain = StorageRecord(1, "cpu", 16, "float32", (4,), 2, address=99)
    assert made == plain and hash(made) == hash(plain) and repr(made) == repr(plain)
    assert other == StorageRecord(2, "cpu", 16, "float32", (4,), 2)
    given = storage_records([1, 2], ["cpu"] * 2, [16] * 2, ["float32"] * 2, [(4,)] * 2, [2] * 2, [99, 0],
                            holders={1: Holder(USER, "x[1]", "x"), 3: Holder(USER, "gone", "gone")})
    held = dataclasses.replace(plain, holder_kind=USER, holder_path="x[1]")
    assert given == [held, other] and hash(given[0]) == hash(held) and given[1].holder_path is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.bytes = 3  # type: ignore[misc]
    assert set(made.__dict__) == {f.name for f in dataclasses.fields(StorageRecord)}


def test_an_item_of_a_huge_list_is_named_by_the_index_the_walk_read():
    big: list[object] = [[i] for i in range(50_000)]  # past the walk's slice: read in parts
    big[30_001] = torch.ones(3)
    rows = [Pair(i, torch.ones(1)) for i in range(5)]
    tensors = [big[30_001], rows[3].tensor]
    walk = Walk([tensors])
    try:
        walk.start(USER, [("big", big), ("rows", rows)])
        walk.run()
        parents = walk.parents_of(list(map(id, tensors)))
        assert parents[id(tensors[0])] is big and walk.indexes[id(tensors[0])] == 30_001
        assert parents[id(tensors[1])] is rows[3] and walk.indexes[id(tensors[1])] == 1
        assert Namer(walk, None).steps(id(tensors[0]))[1] == (("index", 30_001),)
        assert Namer(walk, None).steps(id(tensors[1]))[1] == (("index", 3), ("index", 1))
        walk.indexes[id(tensors[0])] = 5  # an index that no longer holds it: checked, then searched for
        assert Namer(walk, None).steps(id(tensors[0]))[1] == (("index", 30_001),)
    finally:
        walk.release()


def test_a_value_under_two_keys_is_named_by_the_first_in_a_small_dict_and_a_big_one():
    """A small dict is searched for the one child asked about, a big one once for every child being
    named: both give the first key holding it, and a dict holding it as no value names no key."""
    shared, other = torch.ones(2), torch.ones(3)
    small = {"a": 1, "first": shared, "second": shared}
    big = {f"k{i}": i for i in range(100)} | {"first": other, "again": other, "more": shared}
    heap = {"small": small, "big": big}
    walk = Walk([heap])
    try:
        walk.start(USER, list(heap.items()))
        walk.run()
        namer = Namer(walk, None)
        assert namer.steps(id(shared)) == (walk.roots[id(small)], (("key", "first"),))
        assert namer.steps(id(other)) == (walk.roots[id(big)], (("key", "first"),))
        assert namer.links.reverse_map(small, small, id(other)) == {}
    finally:
        walk.release()
