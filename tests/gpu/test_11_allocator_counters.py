"""Check 11 — a steady %gpumem on CUDA skips the heap pass when the allocator's counts have not moved.

The CUDA allocator counts every block it allocates and frees (``memory_stats()``'s
``allocation.all.allocated`` / ``allocation.all.freed``). When neither moved since the last scan,
the same storages are alive, so a scan re-checks the remembered paths of user-held storages
instead of passing over the heap (issue 24; unit-tested on the labelled fake allocator in
tests/heap/test_allocator_counters.py). Ground truth here: the real allocator's counters, a full
scan's holders, bytes and paths, and the scan's own ``heap_passed``.
"""
from __future__ import annotations

import pytest

from tests.gpu.support import MiB, settle

ITEM = 11
pytestmark = pytest.mark.gpu

_NO_PASS = "allocator's allocation and free counts have not moved"


def _counts(torch) -> tuple[int, int]:
    stats = torch.cuda.memory_stats(0)
    return int(stats["allocation.all.allocated"]), int(stats["allocation.all.freed"])


def _holders(snap) -> list[tuple[str, str | None, int]]:
    return sorted((r.holder_kind, r.holder_path, r.bytes) for r in snap.storages)


def test_a_steady_scan_with_unmoved_counters_makes_no_heap_pass(gpu_ip, cuda, checks):
    torch = cuda
    settle(torch)
    cell = ("weights = {'embed': torch.zeros(64 * 1024 * 1024, dtype=torch.uint8, device='cuda'),\n"
            "           'head': torch.ones(4 * 1024 * 1024, device='cuda')}\n"
            "layers = [torch.empty(8 * 1024 * 1024, dtype=torch.uint8, device='cuda') for _ in range(3)]")
    checks.true("the cell ran", gpu_ip.run_cell(cell, store_history=True).error_in_exec is None)
    torch.cuda.synchronize()
    full = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    counts = _counts(torch)
    steady = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    checks.true("ground truth: the allocator's counts did not move between the scans", _counts(torch),
                expected=counts)
    checks.true("the full scan passed over the heap", full.heap_passed)
    foreign = sorted({(r.holder_kind, r.holder_path) for r in full.storages if r.holder_kind != "user"})
    if foreign:  # an earlier test left a storage this shell's variables do not hold: the shortcut must scan
        checks.skip("the steady scan made no heap pass", f"not every storage is user-held here: {foreign[:3]}")
        checks.true("with a storage not user-held, the steady scan passes over the heap", steady.heap_passed)
    else:
        checks.true("the steady scan made no heap pass", not steady.heap_passed)
        checks.true("the steady scan says why", any(_NO_PASS in n for n in steady.notes))
    checks.true("the steady scan's holders, paths and bytes == the full scan's", _holders(steady),
                expected=_holders(full))
    checks.equal("bytes held by `weights`", 64 * MiB + 16 * MiB, steady.held_by("weights"))
    checks.row("seconds: full scan → steady scan", None, f"{full.scan_seconds:.4f} → {steady.scan_seconds:.4f}", None,
               note="informational: what the unmoved counters save")

    # A new block moves the counts: the next scan passes over the heap again and sees it.
    gpu_ip.run_cell("extra = torch.zeros(2 * 1024 * 1024, dtype=torch.uint8, device='cuda')", store_history=True)
    torch.cuda.synchronize()
    moved = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    checks.true("after an allocation the scan passes over the heap", moved.heap_passed)
    checks.equal("and finds the new tensor", 2 * MiB, moved.held_by("extra"))

    # A stale holder can change hands without an allocation: no shortcut while one is remembered.
    gpu_ip.run_cell("extra", store_history=True)  # shown: the output cache holds it too
    gpu_ip.run_cell("del extra", store_history=True)
    stale = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    again = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    checks.equal("the shown tensor is stale (output cache)", 2 * MiB, stale.stale_bytes)
    checks.true("with a stale storage remembered, the next scan still passes over the heap",
                again.heap_passed)
    gpu_ip.run_line_magic("freeall", "--device cuda:0")
    gpu_ip.run_cell("del weights, layers", store_history=True)
    checks.verify()
