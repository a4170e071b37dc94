"""Check 5 — fragmentation is diagnosed as such, and %%guardload turns on expandable segments.

Part one (this process, classic allocator): interleaved allocations and frees leave eight 64 MiB
holes inside one segment (512 MiB reserved but unallocated) and a cap stops new segments; a
128 MiB request — smaller than the holes' sum, larger than any hole — fails for real. Ground
truth: the allocator's ``memory_snapshot`` (the holes) and its OOM observer (the figures at the
failure). "Holes larger than the request" is read as: their sum is larger; no single hole is,
or the allocator would have used it.

Part two (fresh interpreters, real IPython): ``%%guardload`` run before CUDA initializes sets
``expandable_segments:True``, and the allocator itself then reports expandable segments (each
segment's ``is_expandable`` in ``torch.cuda.memory._snapshot()``, and its ``allocator_settings``
where this torch reports them); ``--no-expandable`` is the control.
"""
from __future__ import annotations

import pytest

from tests.gpu.support import MiB, guard_cell, make_holes, print_tolerance, run_fresh

ITEM = 5
pytestmark = pytest.mark.gpu


def test_fragmentation_is_diagnosed(gpu_ip, cuda, oom_observer, checks):
    torch = cuda
    facts = make_holes(gpu_ip, torch)
    if facts["expandable"]:
        pytest.skip("expandable segments are on in this process (PYTORCH_CUDA_ALLOC_CONF): run the suite "
                    "through `make gpu-check`, which clears it")
    holes = [b["size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
             if b["state"] == "inactive" and b["size"] == 64 * MiB]
    checks.equal("ground truth: eight 64 MiB holes inside one segment", 8, len(holes), unit=None)
    checks.equal("ground truth: the largest free block is one hole", 64 * MiB, facts["largest_free_block"])
    _, report, error = guard_cell(gpu_ip, "--device cuda:0",
                                  "extra = torch.empty(128 << 20, dtype=torch.uint8, device='cuda')")
    event = oom_observer.last()
    checks.true("a real torch.OutOfMemoryError", type(error).__name__, expected="OutOfMemoryError")
    checks.true("the guard's report is available", report is not None)
    checks.true("ground truth: the allocator's OOM observer saw the failure", bool(event),
                note=None if event else f"observer events: {oom_observer.events}")
    if report is not None and event:
        oom = report.oom
        cache = event["reserved"] - event["allocated"]
        checks.equal("parsed request == allocator's request (128 MiB)", event["requested"],
                     oom.requested if oom else None, tol=print_tolerance(event["requested"]))
        checks.equal("parsed reserved-unallocated == reserved − allocated at failure", cache,
                     oom.reserved_unallocated if oom else None, tol=print_tolerance(cache))
        checks.at_least("reserved-unallocated is larger than the request", event["requested"], cache)
        diagnosis = report.diagnosis
        checks.true("diagnosis: fragmentation first", diagnosis.top.kind if diagnosis and diagnosis.top else None,
                    expected="fragmentation", note=f"causes: {diagnosis.kinds if diagnosis else None}")
        cause = diagnosis.cause("fragmentation") if diagnosis else None
        checks.equal("its largest free block == the allocator's at the failure", event.get("largest_free_block"),
                     cause.figure("largest_free_block") if cause else None)
        advice = cause.text() if cause else ""
        checks.true("the advice names expandable_segments", "expandable_segments" in advice)
    gpu_ip.run_cell("del pieces")
    checks.verify()


CHILD = r'''
FLAGS = {flags!r}
names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
facts = {{"errors": []}}
ip = start_shell()
for source in ("%load_ext oom_magic", "import torch"):
    error = cell(ip, source)
    if error:
        facts["errors"].append(error)
import torch
facts["initialized_before"] = bool(torch.cuda.is_initialized())
result = ip.run_cell("%%guardload --device cuda:0 " + FLAGS + "\nx = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')")
error = result.error_in_exec or result.error_before_exec
if error is not None:
    facts["errors"].append(f"{{type(error).__name__}}: {{error}}")
report = result.result if type(result.result).__name__ == "GuardReport" else None
facts["action"] = report.allocator.action if report is not None else None
facts["env"] = {{n: os.environ.get(n) for n in names}}
snap = torch.cuda.memory._snapshot()
segments = snap["segments"] if isinstance(snap, dict) else snap
facts["segments"] = len(segments)
facts["is_expandable"] = [s.get("is_expandable") for s in segments]
settings = snap.get("allocator_settings") if isinstance(snap, dict) else None
facts["allocator_settings"] = {{k: v for k, v in (settings or {{}}).items() if not isinstance(v, dict)}} or None
try:
    facts["accelerator_settings"] = torch._C._accelerator_getAllocatorSettings()
except Exception as exc:
    facts["accelerator_settings"] = None
emit(facts)
'''


def _conf_says_expandable(env: dict) -> bool:
    return any("expandable_segments:True" in (v or "") for v in env.values())


def test_guardload_turns_on_expandable_segments_in_a_fresh_kernel(checks):
    on = run_fresh(CHILD.format(flags=""), timeout=300)
    off = run_fresh(CHILD.format(flags="--no-expandable"), timeout=300)
    checks.true("cells ran without error", on["errors"] + off["errors"], expected=[])
    checks.true("fresh kernel: CUDA not initialized before %%guardload", on["initialized_before"], expected=False)
    checks.true("%%guardload set expandable_segments:True (PYTORCH_*_ALLOC_CONF)", _conf_says_expandable(on["env"]),
                note=f"action {on['action']!r}, env {on['env']}")
    flags = on["is_expandable"]
    checks.true("the allocator reports its segments expandable (segment is_expandable)",
                bool(flags) and all(flag is True for flag in flags), note=f"segments: {flags}")
    settings = on["allocator_settings"] or {}
    if "expandable_segments" in settings:
        checks.true("the allocator's settings report expandable_segments", settings["expandable_segments"])
    checks.true("control: --no-expandable leaves the variable unset", _conf_says_expandable(off["env"]),
                expected=False)
    checks.true("control: without it the segments are not expandable",
                bool(off["is_expandable"]) and not any(off["is_expandable"]), note=f"segments: {off['is_expandable']}")
    checks.verify()
