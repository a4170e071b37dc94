"""Check 8 — ``%%guardload --snapshot PATH`` writes a snapshot PyTorch's own tooling loads, and
its largest free block agrees with the fragmentation diagnosis.

Same failing layout as check 5 (eight 64 MiB holes, a cap, a 128 MiB request). Ground truth: the
allocator's OOM observer (the largest inactive block in ``memory_snapshot()`` at the failure, and
the request). The file is read with ``pickle`` as ``torch.cuda.memory._dump_snapshot`` writes it,
and summarised with ``torch.cuda._memory_viz.segsum`` (the memory viewer's own code); a PNG of
the segments' blocks goes to the output folder.
"""
from __future__ import annotations

import pickle

import pytest

from tests.gpu.support import MiB, allocator_facts, guard_cell, make_holes

ITEM = 8
pytestmark = pytest.mark.gpu


def _plot_segments(segments: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    large = sorted((s for s in segments if s["total_size"] >= 64 * MiB), key=lambda s: -s["total_size"])[:6]
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * max(len(large), 1)))
    colors = {"active_allocated": "#4c78a8", "active_pending_free": "#f2cf5b", "inactive": "#e45756"}
    for row, segment in enumerate(large):
        start = 0
        for block in segment["blocks"]:
            ax.barh(row, block["size"] / MiB, left=start / MiB, color=colors.get(block["state"], "#888"),
                    edgecolor="white")
            start += block["size"]
    ax.set_yticks(range(len(large)), [f"segment {i}" for i in range(len(large))])
    ax.set_xlabel("MiB (blue: allocated, red: free hole)")
    ax.set_title("allocator segments at the out-of-memory error (from the --snapshot file)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def test_snapshot_file_loads_and_agrees_with_diagnosis(gpu_ip, cuda, oom_observer, checks, out_dir):
    torch = cuda
    facts = make_holes(gpu_ip, torch)
    if facts["expandable"]:
        pytest.skip("expandable segments are on in this process: run the suite through `make gpu-check`")
    target = out_dir / "oom-snapshot.pickle"
    target.unlink(missing_ok=True)
    _, report, error = guard_cell(gpu_ip, f'--device cuda:0 --snapshot "{target}"',
                                  "extra = torch.empty(128 << 20, dtype=torch.uint8, device='cuda')")
    event = oom_observer.last()
    checks.true("a real torch.OutOfMemoryError", type(error).__name__, expected="OutOfMemoryError")
    checks.true("ground truth: the allocator's OOM observer saw the failure", bool(event),
                note=None if event else f"observer events: {oom_observer.events}")
    written = report.last.snapshot_file if report is not None else None
    checks.true("the snapshot was written where --snapshot said", written, expected=str(target))
    data = None
    if target.exists():
        with target.open("rb") as f:
            data = pickle.load(f)
    checks.true("it unpickles to PyTorch's snapshot dict (segments, device_traces)",
                isinstance(data, dict) and "segments" in data and "device_traces" in data)
    if isinstance(data, dict) and "segments" in data:
        from torch.cuda import _memory_viz

        summary = _memory_viz.segsum(data)
        (out_dir / "oom-snapshot-segsum.txt").write_text(summary)
        checks.true("torch.cuda._memory_viz.segsum reads it", bool(summary.strip()))
        _plot_segments(data["segments"], out_dir / "fragmentation.png")
        in_file = allocator_facts(data["segments"])["largest_free_block"]
        checks.equal("its largest free block == the allocator's at the failure", event.get("largest_free_block"),
                     in_file)
        cause = report.diagnosis.cause("fragmentation") if report is not None and report.diagnosis else None
        checks.equal("== the fragmentation diagnosis' largest free block", in_file,
                     cause.figure("largest_free_block") if cause else None)
        ooms = [e for trace in data.get("device_traces", ()) for e in trace if e.get("action") == "oom"]
        checks.equal("the recorded history holds the OOM with the request's size", event.get("requested"),
                     ooms[-1].get("size") if ooms else None)
    gpu_ip.run_cell("del pieces")
    checks.verify()
