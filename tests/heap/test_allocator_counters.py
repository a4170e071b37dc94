"""On CUDA, when the allocator's allocation and free counts have not moved since the last scan, the
same storages are alive: a steady scan re-checks their remembered paths with no heap pass.

The counters come from the FAKE ``torch.cuda`` (tests/fakes/fake_torch_cuda.py: no GPU here),
which counts a block per ``allocate``/``free`` as the real allocator's
``allocation.all.allocated``/``freed`` do. The paths are re-checked on real CPU tensors: the
re-check does not depend on the device, only on the counters gating it.
"""
from __future__ import annotations

import gc

import pytest
import torch

from oom_magic.heap import snapshot as snapshot_module
from oom_magic.heap.holders import forget_paths
from oom_magic.heap.roots import collect_roots
from tests.fakes.fake_torch_cuda import FakeTorchCuda


def test_the_counters_are_read_only_where_a_context_exists(monkeypatch):
    cuda = FakeTorchCuda(initialized=False).install(monkeypatch, torch)  # FAKE allocator
    assert snapshot_module._allocation_counters(torch, "cuda:0") is None
    assert cuda.calls_to("init") == []  # never creates a context to ask
    cuda.initialized = True
    assert snapshot_module._allocation_counters(torch, "cuda:0") == (0, 0)
    cuda.allocate(1 << 20)
    cuda.allocate(1 << 10)
    cuda.free(1 << 10)
    assert snapshot_module._allocation_counters(torch, "cuda:0") == (2, 1)
    assert snapshot_module._allocation_counters(torch, "cpu") is None


@pytest.fixture
def held(monkeypatch):
    namespace = {"x": torch.ones(10), "batch": {"ids": [torch.ones(20)]}}
    forget_paths()
    monkeypatch.setattr(snapshot_module, "_ALLOCATOR_SEEN", {})
    first = snapshot_module.snapshot("cpu", roots=collect_roots(namespace=namespace))
    assert {r.holder_path for r in first.storages if r.holder_kind == "user"} >= {"x", "batch['ids'][0]"}
    mine = tuple(r for r in first.storages if r.holder_path in ("x", "batch['ids'][0]"))
    snapshot_module._ALLOCATOR_SEEN["cuda:0"] = ((7, 3), mine)  # as a scan of cuda:0 leaves it
    return namespace, mine


def test_unchanged_counters_recheck_paths_without_a_heap_pass(held, monkeypatch):
    namespace, mine = held
    passes = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a: passes.append(1) or real(*a))
    again = snapshot_module._unchanged_since_last("cuda:0", (7, 3), collect_roots(namespace=namespace), torch)
    assert again == mine and passes == []


def test_moved_counters_or_a_changed_path_mean_a_heap_pass(held):
    namespace, _ = held
    roots = collect_roots(namespace=namespace)
    assert snapshot_module._unchanged_since_last("cuda:0", (8, 3), roots, torch) is None  # a block allocated
    assert snapshot_module._unchanged_since_last("cuda:0", (7, 4), roots, torch) is None  # a block freed
    namespace["x"] = torch.ones(10)  # the variable now reaches another storage
    assert snapshot_module._unchanged_since_last("cuda:0", (7, 3), collect_roots(namespace=namespace), torch) is None


def test_a_stale_or_library_holder_last_time_means_a_heap_pass(held):
    namespace, mine = held
    from dataclasses import replace

    snapshot_module._ALLOCATOR_SEEN["cuda:0"] = ((7, 3), (replace(mine[0], holder_kind="output-cache"),) + mine[1:])
    assert snapshot_module._unchanged_since_last("cuda:0", (7, 3), collect_roots(namespace=namespace), torch) is None
