"""Check 9 — ``%%guardload --target``: a load that fits this GPU but not the target really runs out here.

The target is a card of 2GiB as nvidia-smi would show it: 2048 − 768 MiB (driver) − 500 MiB (CUDA
context) = 780 MiB usable. A Llama-shaped model of ~245M parameters, built from a config and saved
locally as bf16 safetensors, needs ~0.91 GiB in fp32 and ~0.46 GiB in bf16. Under ``--target 2GiB``
the fp32 load raises a real torch.OutOfMemoryError; the bf16 load fits; the same fp32 load without
``--target`` fits this device. The user's own fraction (0.9) is back after every run.

Ground truth: ``torch.cuda.get_per_process_memory_fraction`` (torch 2.9+) before and after,
``torch.cuda.memory_allocated`` before the cell, the allocator's own account of the failure (the
OOM observer: its limit is the cap the allocator enforced) and
``torch.cuda.get_device_properties(0).total_memory``.
"""
from __future__ import annotations

import pytest

from tests.gpu.support import MiB, build_causal_lm, guard_cell, settle

ITEM = 9
pytestmark = pytest.mark.gpu

TARGET = "2GiB"
USER_FRACTION = 0.9
SHAPE = dict(hidden=1024, intermediate=2816, layers=14, heads=16, vocab=32000)  # ~245M parameters


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from oom_magic.fit.targets import parse_target

    path = tmp_path_factory.mktemp("models") / "llama-245m-bf16"
    info = build_causal_lm(path, dtype="bfloat16", **SHAPE)
    usable = parse_target(TARGET).usable
    assert 4 * info["parameters"] > usable + 64 * MiB and 2 * info["parameters"] < usable - 160 * MiB, info
    return path, info


def _fraction(torch) -> float | None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return None if getter is None else float(getter(0))


def test_a_load_too_big_for_the_target_runs_out_under_the_cap(gpu_ip, cuda, oom_observer, checks, model_dir):
    from oom_magic.fit.targets import memory_fraction_for, parse_target

    torch = cuda
    path, info = model_dir
    target = parse_target(TARGET)
    device_total = int(torch.cuda.get_device_properties(0).total_memory)
    gpu_ip.user_ns["path"] = str(path)
    assert gpu_ip.run_cell("from transformers import AutoModelForCausalLM").error_in_exec is None
    settle(torch)
    torch.cuda.set_per_process_memory_fraction(USER_FRACTION, 0)
    has_getter = _fraction(torch) is not None
    held = torch.cuda.memory_allocated(0)

    # 1. fp32 under --target: more than the target's 780 MiB, far less than this device.
    oom_observer.arm()
    _, report, error = guard_cell(
        gpu_ip, f"--device cuda:0 --target {TARGET}",
        "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map='cuda:0')")
    event = oom_observer.last()
    checks.true("fp32 load under --target: a real torch.OutOfMemoryError", type(error).__name__,
                expected="OutOfMemoryError")
    checks.true("the failed load left no `model` variable", "model" in gpu_ip.user_ns, expected=False)
    rehearsal = report.rehearsal if report is not None else None
    checks.true("the cell ran capped", rehearsal is not None and rehearsal.cap is not None)
    if rehearsal is not None and rehearsal.cap is not None:
        checks.equal("held before the cell == memory_allocated()", held, rehearsal.held_before, tol=MiB)
        checks.equal("device total == get_device_properties().total_memory", device_total, rehearsal.device_total)
        expected = memory_fraction_for(target.usable, device_total, rehearsal.held_before)
        checks.equal("fraction == memory_fraction_for(usable, total, held)", expected, rehearsal.cap.fraction,
                     unit=None)
        checks.equal("the cap == held + the target's usable", rehearsal.held_before + target.usable,
                     rehearsal.limit, tol=1, note="the allocator truncates fraction × total")
        if event:
            checks.equal("ground truth: the allocator's limit at the failure == the cap", rehearsal.limit,
                         event.get("limit"), tol=1)
        checks.true("the previous fraction was put back", rehearsal.restored)
        if has_getter:
            checks.equal("previous fraction as read before the cell", USER_FRACTION, rehearsal.cap.previous,
                         tol=1e-9, unit=None)
    if report is not None:
        checks.true("the short error is phrased for the target", str(error).startswith("out of memory as on a 2GiB GPU"))
        verdicts = [c.verdict for c in report.preflight.checks] if report.preflight else []
        checks.true("preflight against the target: will-not-fit", verdicts, expected=["will-not-fit"])
    if has_getter:
        checks.equal("fraction after the failed run == the user's", USER_FRACTION, _fraction(torch), tol=1e-9,
                     unit=None)
    else:
        checks.skip("fraction after the failed run", "torch < 2.9 has no get_per_process_memory_fraction")

    # 2. bf16 under --target fits the target.
    _, report, error = guard_cell(
        gpu_ip, f"--device cuda:0 --target {TARGET}",
        "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map='cuda:0')")
    checks.true("bf16 load under --target succeeds", None if error is None else f"{type(error).__name__}: {error}",
                expected=None)
    if report is not None:
        checks.true("bf16 report: ok, capped, restored", (report.outcome, report.rehearsal.cap is not None,
                                                          report.rehearsal.restored), expected=("ok", True, True))
    if has_getter:
        checks.equal("fraction after the successful run == the user's", USER_FRACTION, _fraction(torch), tol=1e-9,
                     unit=None)
    gpu_ip.run_cell("del model")
    settle(torch)

    # 3. Control: the same fp32 load without --target fits this device.
    _, report, error = guard_cell(
        gpu_ip, "--device cuda:0",
        "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map='cuda:0')")
    checks.true("control: the fp32 load without --target succeeds here",
                None if error is None else f"{type(error).__name__}: {error}", expected=None)
    gpu_ip.run_cell("del model")
    settle(torch)
    checks.verify()
