"""Garbage found once is re-verified on the next scan, not searched for again, and never trusted blindly.

Tensors only unreachable reference cycles hold are named ``garbage`` through ``%gpumem -o`` in a
real shell, the next scan without a single ``gc.get_referrers`` pass; a cycle a variable reaches
again is the user's, and a collected one is forgotten.
"""
from __future__ import annotations

import gc

import pytest

from oom_magic.heap import garbage as garbage_module
from oom_magic.heap.holders import forget_paths
from tests.heap import count_climbs

CYCLES = """
import gc, torch
class Node:
    pass
def orphan(n):
    node = Node()
    node.self = node
    node.state = {'hidden': torch.ones(n)}
gc.disable()
for n in range(100, 120):
    orphan(n)
"""


@pytest.fixture
def cycles(ip):
    enabled = gc.isenabled()
    assert ip.run_cell(CYCLES, store_history=True).success
    yield
    (gc.enable if enabled else gc.disable)()
    gc.collect()


def _garbage(snap) -> int:
    return sum(r.bytes for r in snap.storages if r.holder_kind == "garbage")


def test_garbage_is_reverified_without_climbing_the_heap(ip, cycles, monkeypatch):
    forget_paths()
    first = ip.run_line_magic("gpumem", "-o --device cpu --all")
    want = sum(n * 4 for n in range(100, 120))
    assert _garbage(first) == want

    climbs = count_climbs(monkeypatch)
    again = ip.run_line_magic("gpumem", "-o --device cpu --all")
    assert _garbage(again) == want and climbs == []


def test_a_cycle_a_variable_reaches_again_is_the_users(ip, cycles):
    forget_paths()
    assert _garbage(ip.run_line_magic("gpumem", "-o --device cpu --all")) == sum(n * 4 for n in range(100, 120))
    # Resurrect one cycle (only the collector's list still reaches it) into a variable.
    node = next(o for o in gc.get_objects() if type(o).__name__ == "Node" and o.state["hidden"].numel() == 107)
    ip.user_ns["kept"] = node
    del node
    snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
    user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
    assert user["kept.state['hidden']"] == 107 * 4
    assert _garbage(snap) == sum(n * 4 for n in range(100, 120) if n != 107)


def test_collected_garbage_is_forgotten(ip, cycles):
    forget_paths()
    ip.run_line_magic("gpumem", "-o --device cpu --all")
    assert garbage_module._LAST
    gc.collect()
    snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
    assert _garbage(snap) == 0 and garbage_module._LAST == []
