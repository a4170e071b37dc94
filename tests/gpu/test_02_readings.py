"""Check 2 — readings: %gpumem's figures equal PyTorch's allocator and NVML's at the same moment.

Ground truth: ``torch.cuda.memory_allocated/memory_reserved/max_memory_allocated`` and NVML
through pynvml (total/free of the device, this pid's used bytes), read right before and right
after the snapshot; the storages are tensors of known sizes. Tracked storage bytes must be within
1% of ``memory_allocated()``, and memory only the autograd graph holds must show as untracked.
"""
from __future__ import annotations

import os

import pytest

from oom_magic.render.segments import memory_segments
from oom_magic.render.units import format_bytes
from tests.gpu.support import MiB, nvml_memory, nvml_processes, settle

ITEM = 2
pytestmark = pytest.mark.gpu


def ok(ip, source: str):
    result = ip.run_cell(source, store_history=True)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    return result.result


def truth(torch) -> dict:
    """Allocator and NVML figures now."""
    return {"allocated": int(torch.cuda.memory_allocated(0)), "reserved": int(torch.cuda.memory_reserved(0)),
            "peak": int(torch.cuda.max_memory_allocated(0)), "nvml": nvml_memory(torch),
            "process": nvml_processes().get(os.getpid())}


def test_reading_equals_allocator_and_nvml(gpu_ip, cuda, checks):
    torch = cuda
    settle(torch)
    empty = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    ok(gpu_ip, "a = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')\n"
               "b = torch.ones(1000, 1000, device='cuda')\n"
               "c = torch.zeros(3, 5, device='cuda')\n"
               "v = a[:10]")
    torch.cuda.synchronize()
    before = truth(torch)
    snap = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
    after = truth(torch)
    r = snap.reading
    checks.true("%gpumem reads cuda:0", snap.device, expected="cuda:0")
    checks.equal("allocated == torch.cuda.memory_allocated()", after["allocated"], r.allocated,
                 note=None if before["allocated"] == after["allocated"] else "allocator moved during the scan")
    checks.equal("reserved == torch.cuda.memory_reserved()", after["reserved"], r.reserved)
    checks.equal("peak_allocated == torch.cuda.max_memory_allocated()", after["peak"], r.peak_allocated)
    checks.equal("total == NVML total", after["nvml"]["total"], r.total)
    drift = abs(after["nvml"]["free"] - before["nvml"]["free"])
    checks.equal("free == NVML free", after["nvml"]["free"], r.free, tol=drift,
                 note="tolerance: what NVML's free moved while the snapshot ran")
    if after["process"] is None:
        checks.skip("this process's device bytes == NVML usedGpuMemory for this pid",
                    "NVML does not list this pid here (another pid namespace): no ground truth")
    else:
        checks.equal("this process's device bytes == NVML usedGpuMemory for this pid", after["process"],
                     r.process_used, tol=abs(after["process"] - (before["process"] or 0)))
        checks.equal("context/non-PyTorch == NVML process bytes − reserved",
                     after["process"] - after["reserved"], r.context)
    # Known storages: a (and its view v, counted once), b, c.
    checks.equal("bytes held by `a` and its view `v`", 256 * MiB, snap.held_by("a") + snap.held_by("v"))
    checks.equal("bytes held by `b`", 1000 * 1000 * 4, snap.held_by("b"))
    checks.equal("bytes held by `c`", 3 * 5 * 4, snap.held_by("c"))
    shared = [(s.bytes, s.tensor_count) for s in snap.storages if s.holder_path in ("a", "v")]
    checks.true("`a` and `v` are one storage with two tensors", shared, expected=[(256 * MiB, 2)])
    added = (r.allocated or 0) - (empty.reading.allocated or 0)
    checks.equal("tracked bytes of the new tensors within 1% of the memory_allocated() they added", added,
                 snap.tracked_bytes - empty.tracked_bytes, tol=added // 100)
    allocated = r.allocated or 0
    remainder = allocated - snap.tracked_bytes
    checks.equal("untracked == allocated − tracked", remainder, snap.untracked_bytes)
    segment = next((s.bytes for s in memory_segments(snap) if s.key == "untracked"), None)
    shown = abs(remainder) <= allocated // 100 or (segment == remainder and "untracked" in str(snap))
    checks.row("tracked within 1% of allocated, or the remainder shown as untracked",
               "within 1% or shown", {"tracked": snap.tracked_bytes, "allocated": allocated, "untracked_shown": segment},
               shown, note="cuBLAS workspaces and other C++-held memory count as untracked")
    checks.verify()


def test_autograd_graph_memory_shows_as_untracked(gpu_ip, cuda, checks):
    torch = cuda
    settle(torch)
    ok(gpu_ip, "w = torch.randn(4096, 4096, device='cuda', requires_grad=True)")
    first = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0")
    allocated_before = torch.cuda.memory_allocated(0)
    # sin() saves its input (w * 2, 64 MiB) for backward: only the autograd graph holds it.
    ok(gpu_ip, "y = (w * 2).sin().sum()")
    torch.cuda.synchronize()
    graph = torch.cuda.memory_allocated(0) - allocated_before - 512  # y itself: one 512-byte block
    second = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0")
    checks.equal("ground truth: the graph holds the saved activation", 4096 * 4096 * 4, graph, tol=64 * 1024)
    # PyTorch keeps a saved tensor's Python object alive with it (PyObject preservation: seen on torch
    # 2.11 CUDA and 2.13 cpu), so the heap scan finds it, held outside Python ("other"); a build that
    # drops the object leaves the bytes untracked. Either way the graph's bytes are shown, not lost.
    grown_other = second.kind_bytes("other") - first.kind_bytes("other")
    grown_untracked = (second.untracked_bytes or 0) - (first.untracked_bytes or 0)
    checks.equal("other tensors + untracked grew by what only the graph holds", graph, grown_other + grown_untracked,
                 tol=64 * 1024, note=f"tolerance: allocator rounding of the small outputs; other +{grown_other} B, "
                                     f"untracked +{grown_untracked} B")
    segment = next((s for s in memory_segments(second) if s.key == "untracked"), None)
    checks.equal("the bar's untracked segment == untracked_bytes", second.untracked_bytes,
                 segment.bytes if segment else None)
    text = str(second)
    checks.true("the %gpumem text shows the untracked figure",
                "untracked" in text and format_bytes(second.untracked_bytes) in text)
    ok(gpu_ip, "y.backward(); del y, w")
    checks.verify()
