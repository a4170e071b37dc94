"""Deep chains (linked lists, ladders) are walked one object at a time and named by their depth.

Needs no torch (``make test-pythons`` runs it on each Python): tracked lists stand in for tensors.
A chain's parents are read back for a whole segment at once, and its depths and runs are memoised
every few dozen links, so the names are checked against a namer that climbs each path alone,
whatever order the paths are asked in.
"""
from __future__ import annotations

import gc
import random
import sys
from itertools import pairwise

from oom_magic.heap.names import Namer
from oom_magic.heap.path_text import render
from oom_magic.heap.reads import links_named
from oom_magic.heap.resolve import resolve
from oom_magic.heap.walk import Root, Walk
from oom_magic.records.snapshot import USER


class Link:
    def __init__(self, value: object, following: object) -> None:
        self.value = value
        self.next = following


class Fork:
    """A ladder rung: its left side holds the rest of the ladder or a marker, its right a short branch."""

    def __init__(self) -> None:
        self.left: object = None
        self.right: object = None


def _linked_list(length: int, every: int) -> tuple[Link, list[list[int]]]:
    markers: list[list[int]] = []
    head = None
    for i in range(length - 1, -1, -1):
        value: object = i
        if i % every == every - 1:
            value = [i]  # a tracked object the walk is asked for, as a tensor would be
            markers.append(value)
        head = Link(value, head)
    assert head is not None
    markers.reverse()  # made from the tail: head side first
    return head, markers


def _broken_list(length: int, every: int, at: int) -> tuple[Link, list[list[int]]]:
    """A linked list whose node ``at`` holds the rest under ``.after``, not ``.next``."""
    head, markers = _linked_list(length, every)
    node = head
    for _ in range(at):
        node = node.next
    node.after, node.next = node.next, None  # type: ignore[attr-defined]
    return head, markers


def _ladder(rungs: int) -> tuple[Fork, list[list[int]]]:
    """Rungs whose .left leads on (alternating with a list step) and whose .right holds a short branch:
    levels two or three objects wide, so a segment holds objects that are no marker's ancestor."""
    markers: list[list[int]] = []
    top = node = Fork()
    for i in range(rungs):
        branch = Fork()
        branch.left = [i] if i % 97 == 0 else i
        if i % 97 == 0:
            markers.append(branch.left)
        node.right = branch
        following = Fork()
        node.left = [following] if i % 3 == 0 else following
        node = following
    node.left = [rungs]
    markers.append(node.left)
    return top, markers


def _walk(roots: dict[str, object], markers: list[list[int]]) -> Walk:
    walk = Walk([roots, markers], wanted={id(m): i for i, m in enumerate(markers)})
    walk.start(USER, list(roots.items()))
    walk.run()
    assert walk.storages_left == 0, "a marker was not reached"
    return walk


def _named(walk: Walk, ids: list[int]) -> dict[int, str]:
    namer = Namer(walk, None)
    try:
        namer.prepare(ids)
        found = {}
        for i in ids:
            root, steps = namer.steps(i)
            assert root is not None
            found[i] = render(root, steps, lambda _: None)
        return found
    finally:
        namer.clear()


def test_a_linked_list_is_named_the_same_whatever_order_its_paths_are_asked_in():
    head, markers = _linked_list(3000, 100)
    walk = _walk({"head": head}, markers)
    try:
        ids = [id(m) for m in markers]
        alone = {i: _named(walk, [i])[i] for i in ids}
        namer = Namer(walk, None)
        namer.prepare(ids)
        for marker in markers:  # what the next scan re-reads (.next as many times) reaches the same list
            assert resolve(head, namer.steps(id(marker))[1]) is marker
        namer.clear()
        # Index i of the list is i .next down, on every Python (3.10: each is two links, the node's
        # __dict__ and its key).
        assert alone[id(markers[0])] == "head(.next ×99).value"
        assert alone[id(markers[-1])] == "head(.next ×2,999).value"
        assert set(alone.values()) == {f"head(.next ×{k:,}).value" for k in range(99, 3000, 100)}
        for order in (ids, ids[::-1], random.Random(3).sample(ids, len(ids))):
            assert _named(walk, order) == alone
        # Every parent read back for a chain is a real holder of its child, up to the root.
        parents = walk.parents_of(ids)
        for i in ids:
            node = i
            while type(parents[node]) is not Root:
                assert node in map(id, gc.get_referents(parents[node]))
                node = id(parents[node])
    finally:
        walk.release()


def test_a_chain_of_mixed_links_says_how_many_it_leaves_out_whatever_the_order():
    top, markers = _ladder(900)
    walk = _walk({"top": top}, markers)
    try:
        ids = [id(m) for m in markers]
        alone = {i: _named(walk, [i])[i] for i in ids}
        deepest = alone[id(markers[-1])]
        assert deepest.startswith("top.left[0].left.left.left[0]") and " more… " in deepest
        assert deepest.endswith(".left")
        assert alone[id(markers[0])] == "top.right.left"
        for order in (ids[::-1], random.Random(5).sample(ids, len(ids))):
            assert _named(walk, order) == alone
    finally:
        walk.release()


def test_a_run_broken_partway_is_not_shown_as_one():
    """A list whose middle node holds the rest under another attribute: no single run covers the middle."""
    head, markers = _broken_list(2000, 500, 1000)
    walk = _walk({"head": head}, markers)
    try:
        ids = [id(m) for m in markers]
        alone = {i: _named(walk, [i])[i] for i in ids}
        assert alone[id(markers[0])] == "head(.next ×499).value"
        deep = alone[id(markers[-1])]
        assert "(.next ×1,999)" not in deep and " more… " in deep
        for order in (ids[::-1], random.Random(7).sample(ids, len(ids))):
            assert _named(walk, order) == alone
    finally:
        walk.release()


def test_memoised_depths_and_runs_are_those_of_a_climb_from_each_object_alone():
    """Every node's depth, anchor and run of ``.next``, asked in a shuffled order (each answer then
    comes partly from the memos others left), equal those of a plain climb from that node."""
    head, markers = _broken_list(1500, 300, 700)
    walk = _walk({"head": head}, markers)
    try:
        nodes = [id(head)]
        at = head
        while True:
            at = getattr(at, "next", None) or getattr(at, "after", None)
            if at is None:
                break
            nodes.append(id(at))
        namer = Namer(walk, None)
        namer.prepare([id(m) for m in markers])
        parent = namer.parent_of

        def climbed(i: int) -> list[int]:  # i and its ancestors below the root object, deepest first
            path = []
            while type(parent[i]) is not Root:
                path.append(i)
                i = id(parent[i])
            return path

        def run(i: int) -> int:
            length = 0
            while type(parent[i]) is not Root and getattr(parent[i], "next", None) is not None \
                    and id(parent[i].next) == i:
                length += 1
                i = id(parent[i])
            return length

        for i in random.Random(11).sample(nodes, len(nodes)):
            path = climbed(i)
            anchor = path[len(path) - 24] if len(path) >= 24 else -1
            assert namer._depth_of(i)[:2] == (len(path), anchor)
            assert namer._run_length(i, "next") == run(i)
        namer.clear()
    finally:
        walk.release()


class SlotLink:
    __slots__ = ("next", "value")

    def __init__(self, value: object, following: object) -> None:
        self.value = value
        self.next = following


class ComputedLink:
    """A node whose ``next`` is a property (reading it would run code): it holds the rest elsewhere."""

    def __init__(self, following: object) -> None:
        self._following = following
        self.value = None

    @property
    def next(self) -> object:
        raise AssertionError("a property was read")


def test_a_run_read_a_class_at_a_time_spans_classes_and_ends_at_a_node_whose_next_is_a_property():
    """A list of plain nodes, then slotted ones: the run of ``.next`` crosses the change of class (each
    class's owners read in one pass). A node whose ``next`` is a property ends a run, never read."""
    marker = [0]
    tail: object = SlotLink(marker, None)
    for _ in range(299):
        tail = SlotLink(0, tail)
    for _ in range(300):
        tail = Link(0, tail)
    inner = [1]
    head: object = ComputedLink(Link(inner, None))
    for _ in range(300):
        head = Link(0, head)
    walk = _walk({"plain": tail, "computed": head}, [marker, inner])
    try:
        names = _named(walk, [id(marker), id(inner)])
        assert names[id(marker)] == "plain(.next ×599).value"
        assert names[id(inner)] == "computed(.next ×300)._following.value"
    finally:
        walk.release()


def _mixed_list(blocks: int, block: int) -> tuple[object, list[int]]:
    """Blocks of plain nodes whose ``__dict__`` was made (each ``.next`` two links on 3.10-3.12: the
    dict, then its key), slotted nodes (one link) and plain ones (one link on 3.11+), head first."""
    marker = [0]
    node: object = SlotLink(marker, None)
    for b in range(blocks):
        for _ in range(block):
            node = SlotLink(0, node) if b % 3 == 1 else Link(0, node)
            if b % 3 == 0:
                vars(node)  # its attributes now live in a dict of its own
    return node, marker


def test_a_run_whose_links_are_one_or_two_apiece_counts_attributes_whatever_the_order():
    """A run of ``.next`` where some nodes keep it in their own ``__dict__`` (two links) and others in a
    slot or inline (one) says how many ``.next`` it is, not how many links; each path asked alone or
    after others (memos of mixed runs) reads the same."""
    heads, markers = [], []
    for blocks in (4, 7, 9):
        head, marker = _mixed_list(blocks, 70)
        heads.append(head)
        markers.append(marker)
    walk = _walk({f"head{i}": head for i, head in enumerate(heads)}, markers)
    try:
        ids = [id(m) for m in markers]
        alone = {i: _named(walk, [i])[i] for i in ids}
        assert [alone[i] for i in ids] == [f"head{i}(.next ×{blocks * 70:,}).value" for i, blocks in enumerate((4, 7, 9))]
        for order in (ids[::-1], random.Random(13).sample(ids, len(ids))):
            assert _named(walk, order) == alone
        namer = Namer(walk, None)
        namer.prepare(ids)
        for head, marker in zip(heads, markers):
            assert resolve(head, namer.steps(id(marker))[1]) is marker
        namer.clear()
    finally:
        walk.release()


class NextFirst:
    """A node that holds the rest of its list before its value: a marker it holds comes second."""

    def __init__(self, value: object, following: object) -> None:
        self.next = following
        self.value = value


def _next_first(length: int, every: int) -> tuple[NextFirst, list[list[int]]]:
    markers: list[list[int]] = []
    head: object = None
    for i in range(length - 1, -1, -1):
        value: object = [i] if i % every == every - 1 else i
        if type(value) is list:
            markers.append(value)
        head = NextFirst(value, head)
    assert isinstance(head, NextFirst)
    markers.reverse()
    return head, markers


def test_a_climb_takes_a_chain_a_segment_at_a_time_as_a_climb_link_by_link_would():
    """Each object the walk indexed on a chain (a segment's last, a wanted marker met on one) climbs a
    segment in one step: the same ids and parents as a climb through every parent, and the same
    depths and names, whichever of a node's new objects (its value or the rest) comes first."""
    for head, markers in (_linked_list(3000, 250), _next_first(3000, 250)):
        walk = _walk({"head": head}, markers)
        try:
            ids = [id(m) for m in markers]
            parents = walk.parents_of(ids)
            indexed = list(walk._chain_at)
            taken = 0
            for obj_id in indexed:
                found = walk.chain_above(obj_id)
                assert found is not None
                climbed, owners, above = found
                node = obj_id
                for i, o in zip(climbed, owners):  # link by link through the parents read back
                    assert i == node and parents[node] is o
                    node = id(o)
                assert node == above
                taken += len(climbed) > 1
            # 3.10 keeps a node's attributes in a dict of its own: no chain of plain objects there.
            assert taken >= len(markers) or sys.version_info < (3, 11)
            alone = {i: _named(walk, [i])[i] for i in ids}
            assert alone[ids[0]] == "head(.next ×249).value"
            assert alone[ids[-1]] == "head(.next ×2,999).value"
            assert _named(walk, ids[::-1]) == alone
        finally:
            walk.release()


def test_reading_a_run_up_to_a_known_one_never_counts_past_it():
    """``links_named(..., end)`` stops at ``end`` even where the owners' class changes after it and a
    link beyond it is no ``.name``: the run above ``end`` is known already, and counted once."""
    nodes: list[object] = [Link(0, None) for _ in range(5)] + [SlotLink(0, None) for _ in range(5)]
    for node, following in pairwise(nodes):
        node.next = following  # type: ignore[attr-defined]
    owners, children = nodes[:-1], [id(n) for n in nodes[1:]]
    assert links_named(owners, children, "next") == 9
    assert links_named(owners, children, "next", 2, 7) == 5
    children[4] = id(children)  # owners[4].next is not the next child: a break after end
    assert links_named(owners, children, "next", 0, 3) == 3
    assert links_named(owners, children, "next") == 4


def test_a_chain_held_elsewhere_too_or_closed_into_a_ring_walks_each_node_once():
    """A node its owner alone holds is reached no other way, so a followed chain keeps no visited entry for
    it; a node held elsewhere too (a list of shortcuts into the chain) and the head a ring closes back to
    are looked up: each object is walked once, the ring ends, and each marker gets its shortest path."""
    head, markers = _linked_list(3000, 100)
    nodes = [head]
    while nodes[-1].next is not None:
        nodes.append(nodes[-1].next)
    nodes[-1].next = head  # the tail leads back to the head
    starts = (500, 1500, 2500)
    shortcuts = [nodes[s] for s in starts]
    del nodes
    walk = _walk({"ring": head, "shortcuts": shortcuts}, markers)
    try:
        walked = [i for ids, _, _ in walk._segments for i in ids]
        assert len(walked) == len(set(walked))  # no object reached twice, the ring's head included
        assert id(head) not in walked and all(id(node) in walked for node in shortcuts)
        names = _named(walk, [id(m) for m in markers])
        expected = {}
        for at, marker in zip(range(99, 3000, 100), markers):
            j = sum(s <= at for s in starts) - 1
            expected[id(marker)] = (f"ring(.next ×{at:,}).value" if j < 0
                                    else f"shortcuts[{j}](.next ×{at - starts[j]:,}).value")
        assert names == expected
    finally:
        walk.release()
