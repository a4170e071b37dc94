"""Records (instances of classes written in Python) are walked with no list each, on every Python.

Needs no torch: ``make test-pythons`` runs it on each Python that pyproject admits, since what it
relies on is CPython's own traversal of a class statement's instances (``subtype_traverse`` visits
the class last). Tracked lists stand in for tensors: the walk looks for objects by id.
"""
from __future__ import annotations

import functools
import gc

from oom_magic.heap import kinds
from oom_magic.heap.walk import Root, Walk
from oom_magic.records.snapshot import USER


class Node:
    """Instances of one class whose referents differ in number and in what they hold."""


class Failure(Exception):
    """A record whose traversal does not end with its class (BaseException's own comes after)."""


class Half:
    __slots__ = ("a", "b")


class Quad:
    __slots__ = ("a", "b", "c", "d")


def marker() -> list[int]:
    return [0]  # a tracked object the walk is asked to reach, as a tensor would be


def _walked(heap: dict[str, object], markers: list[object]) -> tuple[Walk, dict[int, object]]:
    """The walk of ``heap`` until every marker is reached (release it), and the parents of the markers
    up to the roots, each checked to be a real referent of the parent given for it."""
    walk = Walk([heap, markers], wanted={id(m): i for i, m in enumerate(markers)})
    walk.start(USER, list(heap.items()))
    walk.run()
    assert walk.storages_left == 0, "a marker was not reached"
    parents = walk.parents_of(map(id, markers))
    for child, parent in parents.items():
        if type(parent) is not Root:
            held = parent.values() if type(parent) is dict else gc.get_referents(parent)
            assert child in map(id, held), type(parent)
    return walk, parents


def node(*values: object, kind: bool = False) -> Node:
    n = Node()
    if kind:
        n.kind = Node  # the class itself as an attribute: found twice in that record's referents
    for i, v in enumerate(values):
        setattr(n, f"f{i}", v)
    return n


def test_records_read_in_one_call_are_split_by_their_class_or_read_one_by_one():
    """Uniform records are read in one ``gc.get_referents`` call, where the class found once per record
    at its end proves the split; where that proof fails (ragged records, a record holding its own class,
    unset slots, classes mixed, an exception, a C class) each is read alone. Every marker is reached
    with the parent that holds it, and each class still counts as reached."""
    markers: list[object] = []

    def made() -> list[int]:
        markers.append(m := marker())
        return m

    uniform = [node(made(), i) for i in range(500)]
    ragged = [node(*(made() for _ in range(1 + i % 3))) for i in range(300)]
    selfish = [node(made()) if i % 2 else node(made(), made(), kind=True) for i in range(100)]
    halves = []
    for i in range(200):
        h = Half()
        h.a = made()
        if i % 2:
            h.b = made()
        halves.append(h)
    mixed = [node(made()) if i % 2 else Failure(made()) for i in range(100)]
    partials = [functools.partial(print, made()) for _ in range(100)]  # a C heap type: its class first
    heap = {"uniform": uniform, "ragged": ragged, "selfish": selfish, "halves": halves, "mixed": mixed,
            "partials": partials}
    assert len(markers) == 500 + 600 + 150 + 300 + 100 + 100
    walk, parents = _walked(heap, markers)
    try:
        for record in (uniform[7], ragged[5], selfish[1]):
            holder = parents[id(record.f0)]
            if type(holder) is dict:  # Python 3.10 keeps attributes in a dict of their own
                holder = parents[id(holder)]
            assert holder is record
        assert parents[id(halves[3].b)] is halves[3]
        assert parents[id(partials[4].args[0])] is partials[4].args  # through its args tuple
        assert walk.seen(id(Node)) and walk.seen(id(Half))  # a class is reached through its instances
        assert walk._cats[id(type(partials[0]))] == kinds.GENERIC and walk._cats[id(Node)] == kinds.RECORD
    finally:
        walk.release()


def test_a_split_that_only_looks_right_is_refused():
    """Empty records, each followed by one holding its class in its second slot:
    [Quad | m1, Quad, m2, m3, Quad] has the class at every third place, as three referents each would,
    but three times for two records: split by thirds, each m1 would be the empty record's."""
    quads = [Quad() for _ in range(16)]  # more than a level walked one object at a time
    fulls = quads[1::2]
    for full in fulls:
        full.a, full.b, full.c, full.d = marker(), Quad, marker(), marker()
    markers = [m for f in fulls for m in (f.a, f.c, f.d)]
    walk, parents = _walked({"quads": quads}, markers)
    try:
        assert all(parents[id(m)] is f for f in fulls for m in (f.a, f.c, f.d))
    finally:
        walk.release()


def test_a_class_whose_traversal_does_not_end_with_it_is_walked_as_any_object():
    """The class is taken off each record's referents only where it is each one's last: otherwise the
    referents are put back as read and the class is walked as any other object from then on."""
    records = [node(marker()) for _ in range(3)]
    walk = Walk([])
    try:
        lists = [gc.get_referents(r)[::-1] for r in records]  # the class first, as functools.partial has it
        before = [list(x) for x in lists]
        walk._cats[id(Node)] = kinds.RECORD
        walk._drop_classes(records, lists, [id(Node)])
        assert lists == before and walk._cats[id(Node)] == kinds.GENERIC
        assert not walk.seen(id(Node))
    finally:
        walk.release()


def test_only_a_class_statement_s_classes_are_records():
    assert kinds.classify(Node, None) == kinds.RECORD and kinds.classify(Half, None) == kinds.RECORD
    assert kinds.classify(Failure, None) == kinds.GENERIC  # BaseException's traversal comes after
    assert kinds.classify(functools.partial, None) == kinds.GENERIC  # an immutable C heap type
    assert kinds.classify(type("Sub", (functools.partial,), {}), None) == kinds.GENERIC
