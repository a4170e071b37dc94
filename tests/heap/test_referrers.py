"""What refers to many objects at once is found in one heap pass, the same as ``gc.get_referrers`` finds it.

Past ``referrers.FEW`` targets the heap is read in chunks through ``gc.get_referents``; the objects
and their order must be ``gc.get_referrers``' own. A search can look among one generation alone,
and the garbage search, over more cycles than that, names every one of them.
"""
from __future__ import annotations

import gc

import pytest

from oom_magic.heap import holders, referrers
from oom_magic.heap.holders import forget_paths


class Box:
    pass


def _holders(count: int) -> tuple[list[Box], list[object], set[int]]:
    targets = [Box() for _ in range(count)]
    holders = [{"item": t} if i % 2 else [t] for i, t in enumerate(targets)]  # dicts and lists alike
    return targets, holders, {id(h) for h in holders}


@pytest.mark.parametrize("count", [5, referrers.FEW + 50])
def test_the_same_referrers_in_the_same_order_as_gc_get_referrers(count):
    targets, _kept, ours = _holders(count)  # _kept: the holders stay alive
    found = [id(o) for o in referrers.referrers_of(targets) if id(o) in ours]
    expected = [id(o) for o in gc.get_referrers(*targets) if id(o) in ours]
    assert found == expected and len(found) == count


def test_a_search_in_one_generation_finds_only_that_generations_referrers():
    enabled = gc.isenabled()
    gc.disable()
    try:
        targets, _kept, ours = _holders(referrers.FEW + 50)
        gc.collect(0)  # the holders survive into generation 1
        young = [[t] for t in targets[:10]]  # made after: generation 0
        in_young = {id(o) for o in referrers.referrers_of(targets, 0)}
        in_old = {id(o) for o in referrers.referrers_of(targets, 1)}
    finally:
        (gc.enable if enabled else gc.disable)()
    assert {id(y) for y in young} <= in_young and not in_young & ours
    assert ours <= in_old and not in_old & {id(y) for y in young}


MANY_CYCLES = f"""
import gc, torch
class Node:
    pass
def orphan(n):
    node = Node()
    node.self = node
    node.state = {{'hidden': torch.ones(n)}}
gc.disable()
for n in range(100, {100 + referrers.FEW + 50}):
    orphan(n)
"""


def test_more_cycles_than_a_few_are_all_named_garbage(ip):
    enabled = gc.isenabled()
    try:
        assert ip.run_cell(MANY_CYCLES, store_history=True).success
        forget_paths()
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        garbage = sorted(r.bytes for r in snap.storages if r.holder_kind == "garbage")
        assert garbage == [n * 4 for n in range(100, 100 + referrers.FEW + 50)]
        assert {r.holder_path for r in snap.storages if r.holder_kind == "garbage"} == {"unreachable reference cycle"}
    finally:
        (gc.enable if enabled else gc.disable)()
        gc.collect()


LIBRARY = """
import torch
FLAT = torch.ones(40)
NESTED = {'k': torch.ones(41)}
DEEP = [[torch.ones(42)]]
"""


def test_library_held_tensors_chains_climb_together_one_pass_a_hop(tmp_path, monkeypatch):
    """Three tensors a library's globals hold, 1 to 3 hops deep, no garbage search before (nothing
    known): each named by its own chain, the chains climbing side by side (one heap pass a hop,
    not one a tensor and hop)."""
    import sys

    import torch

    from oom_magic.heap.roots import Roots
    from oom_magic.heap.tracker import find_tensors, tensor_types

    library = tmp_path / "elsewhere"
    library.mkdir()
    (library / "libchains.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.delitem(sys.modules, "libchains", raising=False)
    libchains = __import__("libchains")
    forget_paths()
    calls: list[int] = []
    real = holders.referrers_of
    monkeypatch.setattr(holders, "referrers_of", lambda targets: calls.append(len(targets)) or real(targets))
    live = find_tensors(torch, "cpu")
    try:
        found = holders.attribute(live, Roots(), torch, tensor_types(torch), find_garbage=False).holders
    finally:
        live.release()
    key = torch._C._storage_address
    assert found[key(libchains.FLAT)].path == "libchains.FLAT"
    assert found[key(libchains.NESTED["k"])].path == "libchains.NESTED['k']"
    assert found[key(libchains.DEEP[0][0])].path == "libchains.DEEP[0][0]"
    # Every chain at once, one pass a hop (at most five): one a tensor and hop would be six for these alone.
    assert calls[0] >= 3 and len(calls) <= 5


def test_chains_climb_through_what_the_garbage_search_already_found(ip, tmp_path, monkeypatch):
    """The library's objects old (moved to the oldest generation): the garbage search reads their
    referrers from the whole heap, and the chains climb through those, with no heap pass of their own."""
    library = tmp_path / "elsewhere"
    library.mkdir()
    (library / "liboldchains.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.delitem(__import__("sys").modules, "liboldchains", raising=False)
    assert ip.run_cell("import torch\nimport liboldchains", store_history=True).success
    gc.collect()  # every survivor moves to the oldest generation
    forget_paths()
    calls: list[int] = []
    real = holders.referrers_of
    monkeypatch.setattr(holders, "referrers_of", lambda targets: calls.append(len(targets)) or real(targets))
    snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
    other = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "other"}
    assert other["liboldchains.FLAT"] == 160
    assert other["liboldchains.NESTED['k']"] == 164
    assert other["liboldchains.DEEP[0][0]"] == 168
    assert calls == []
