"""scripts/gpu_check.py on a CPU machine: its table, its JSON, its exit codes, and the row recorder.

The rows below are shaped like the ones the GPU suite records (tests/gpu/conftest.py's
``Checks``); no GPU is needed. Runs that would reach a GPU are pointed at a FAKE probe result
through OOM_MAGIC_GPU_PROBE (labelled where used), so the outcome is the same on any machine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import conftest as gpu_conftest
from tests.gpu.support import PROBE_ENV, ROWS_ENV, probe_cuda

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30


def _load_runner():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def row(item, check, expected, measured, passed, unit="bytes", tolerance=None, test="tests/gpu/test_0x.py::t"):
    return {"type": "row", "item": item, "check": check, "expected": expected, "measured": measured, "unit": unit,
            "tolerance": tolerance, "passed": passed, "note": None, "test": test}


ROWS = [
    row(2, "allocated == torch.cuda.memory_allocated()", 268435456 + 4000256, 268435456 + 4000256, True),
    row(3, "memory_allocated() back to baseline", 34 * MiB, 34 * MiB + 512, True, tolerance=MiB),
    row(3, "preflight predicted will-not-fit", ["will-not-fit"], ["fits"], False, unit=None),
    row(1, "torch.cuda.is_initialized() after %gpumem", False, False, True, unit=None),
    row(3, "the load stayed under the cap", {"at_most": 2 * GiB}, int(1.5 * GiB), True),
    row(5, "its largest free block == the allocator's", 64 * MiB, None, False),
    row(2, "free == NVML free", 100 * GiB, 100 * GiB + 512, False),
]


def test_table_has_one_line_per_row_sorted_by_check_number():
    table = runner.format_table(ROWS)
    lines = table.splitlines()
    assert lines[0].split() == ["#", "check", "expected", "measured", "result"]
    assert set(lines[1]) <= {"-", " "}
    body = lines[2:]
    assert len(body) == len(ROWS)
    assert [line.split()[0] for line in body] == ["1", "2", "2", "3", "3", "3", "5"]
    by_check = {line.split("  ")[1].strip(): line for line in body}
    assert "259.81 MiB" in by_check["allocated == torch.cuda.memory_allocated()"]
    assert by_check["allocated == torch.cuda.memory_allocated()"].rstrip().endswith("PASS")
    assert "34.00 MiB ± 1.00 MiB" in by_check["memory_allocated() back to baseline"]
    assert "[will-not-fit]" in by_check["preflight predicted will-not-fit"]
    assert by_check["preflight predicted will-not-fit"].rstrip().endswith("FAIL")
    assert "≤ 2.00 GiB" in by_check["the load stayed under the cap"]
    assert "n/a" in by_check["its largest free block == the allocator's"]
    # The same rounded figure on both sides: the exact difference is shown.
    assert "100.00 GiB (+512 B)" in by_check["free == NVML free"]


def test_notes_are_listed_for_rows_that_did_not_pass():
    rows = [dict(ROWS[0], note="fine"), dict(ROWS[2], note="preflight need 2992 MB"),
            dict(ROWS[5], passed=None, note="NVML does not list this pid")]
    notes = runner.format_notes(rows).splitlines()
    assert notes == ["  [3] preflight predicted will-not-fit: preflight need 2992 MB",
                     "  [5] its largest free block == the allocator's: NVML does not list this pid"]


def test_long_values_are_clipped_to_the_width():
    long = row(4, "x" * 300, "a" * 100, "b" * 100, True, unit=None)
    table = runner.format_table([long], width=120)
    assert all(len(line) <= 130 for line in table.splitlines())
    assert "…" in table


def test_values_are_formatted_like_oom_magic():
    from oom_magic.render.units import format_bytes

    for n in (0, 1, 1023, 1024, 1536, 5 * MiB + 7, 3 * GiB, 2 << 40, -4096):
        assert runner.format_bytes(n) == format_bytes(n)
    assert runner.format_value(None, "bytes") == "n/a"
    assert runner.format_value(True, "bytes") == "True"
    assert runner.format_value({"at_least": GiB}, "bytes") == "≥ 1.00 GiB"
    assert runner.format_value({"tracked": MiB, "allocated": 2 * MiB}, "bytes") == "tracked=1.00 MiB, allocated=2.00 MiB"
    assert runner.format_value([1, "a"], None) == "[1, a]"
    assert runner.result_word({"passed": None}) == "SKIP"


def test_report_json_counts_rows_tests_and_checks(tmp_path):
    (tmp_path / "timeline.png").write_bytes(b"png")
    tests = [
        {"type": "test", "test": "tests/gpu/test_02_readings.py::t", "when": "call", "outcome": "failed",
         "duration": 1.0, "message": "E  1 of 2 checks failed"},
        {"type": "test", "test": "tests/gpu/test_01_no_cost.py::t", "when": "call", "outcome": "passed",
         "duration": 2.0, "message": None},
    ]
    probe = {"available": True, "device_name": "NVIDIA H200", "torch": "2.11.0"}  # FAKE probe result
    report = runner.build_report("failed", reason=None, probe=probe, rows=ROWS, tests=tests, seconds=12.34,
                                 out_dir=tmp_path)
    assert report["status"] == "failed" and report["summary"]["status"] == "failed"
    assert report["summary"]["rows"] == {"rows": 7, "passed": 4, "failed": 3, "skipped": 0}
    assert report["summary"]["tests"] == {"failed": 1, "passed": 1}
    assert report["checks"]["1"]["status"] == "passed"
    assert report["checks"]["3"] == {"what": runner.CHECKS[3], "status": "failed", "rows": 3}
    assert report["checks"]["6"]["status"] == "not run"
    assert report["machine"]["device_name"] == "NVIDIA H200"
    assert report["artifacts"] == ["timeline.png"]
    path = runner.write_report(report, tmp_path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report, default=str))
    assert runner.headline(report).startswith("gpu-check FAILED: 4 passed, 3 failed, 0 skipped checks")


def test_tests_that_fail_without_a_failing_row_become_rows():
    tests = [
        {"type": "test", "test": "tests/gpu/test_04_other_processes.py::test_a", "when": "call",
         "outcome": "failed", "duration": 1, "message": "AssertionError: the holder did not start"},
        {"type": "test", "test": "tests/gpu/test_07_widget.py::test_b", "when": "setup", "outcome": "failed",
         "duration": 1, "message": "fixture broke"},
        {"type": "test", "test": "tests/gpu/test_04_other_processes.py::test_c", "when": "setup",
         "outcome": "skipped", "duration": 0, "message": "jupyter_client is not installed"},
        {"type": "test", "test": "tests/gpu/test_0x.py::t", "when": "call", "outcome": "failed",
         "duration": 1, "message": "1 of 7 checks failed"},
    ]
    extra = runner.unrecorded_failures(ROWS, tests)
    by_check = {r["check"]: r for r in extra}
    assert set(by_check) == {"test_a (failed)", "test_b (error)", "test_c (skipped)"}
    assert by_check["test_a (failed)"]["item"] == 4 and by_check["test_a (failed)"]["passed"] is False
    assert by_check["test_a (failed)"]["measured"] == "AssertionError: the holder did not start"
    assert by_check["test_b (error)"]["item"] == 7
    assert by_check["test_c (skipped)"]["passed"] is None
    assert "SKIP" in runner.format_table(extra)


def test_recorder_rows_reach_the_runner(tmp_path, monkeypatch):
    rows_file = tmp_path / "rows.jsonl"
    monkeypatch.setenv(ROWS_ENV, str(rows_file))
    monkeypatch.setattr(gpu_conftest, "_sink", gpu_conftest._Sink())
    checks = gpu_conftest.Checks(6, "tests/gpu/test_06_stale.py::test_trap")
    assert checks.equal("back to baseline", 10 * MiB, 10 * MiB + 100, tol=MiB)
    assert not checks.equal("bytes held", 64 * MiB, None)
    assert checks.at_least("covers the tensor", GiB, GiB + 5)
    assert not checks.at_most("under the cap", 2 * GiB, 3 * GiB)
    assert checks.true("weakref dead", True)
    assert not checks.true("not initialized", True, expected=False)
    with pytest.raises(pytest.fail.Exception, match="3 of 6 checks failed") as failed:
        checks.verify()
    assert "bytes held: expected 67108864, measured None" in str(failed.value)
    rows, tests = runner.load_records(rows_file)
    assert [r["passed"] for r in rows] == [True, False, True, False, True, False]
    assert tests == [] and all(r["item"] == 6 for r in rows)
    table = runner.format_table(rows)
    assert "10.00 MiB ± 1.00 MiB" in table and "≥ 1.00 GiB" in table and "≤ 2.00 GiB" in table
    with rows_file.open("a") as f:
        f.write('{"type": "row", "item"')  # a run killed mid-write leaves a torn line
    assert len(runner.load_records(rows_file)[0]) == 6


@pytest.mark.skipif(os.environ.get(PROBE_ENV) is not None, reason="a probe result is forced")
def test_probe_says_why_there_is_no_cuda():
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    probe = probe_cuda()
    assert probe["available"] is False
    assert probe["reason"] and ("CPU-only build" in probe["reason"] or "is_available() is False" in probe["reason"])
    assert probe["torch"] == torch.__version__


def _run(args, env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=str(REPO), env=env, timeout=300)


def test_without_a_gpu_it_says_so_writes_skipped_json_and_exits_0(tmp_path):
    fake = {"available": False, "reason": "torch 9.9 is a CPU-only build (torch.version.cuda is None)"}  # FAKE probe
    done = _run([], {PROBE_ENV: json.dumps(fake)}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "gpu-check SKIPPED: no CUDA GPU is present: torch 9.9 is a CPU-only build" in done.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["status"] == "skipped" and report["summary"]["status"] == "skipped"
    assert report["reason"].startswith("no CUDA GPU is present")
    assert report["rows"] == [] and {c["status"] for c in report["checks"].values()} == {"not run"}
    assert set(report["checks"]) == {str(n) for n in runner.CHECKS}


def test_missing_packages_is_an_error_naming_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(PROBE_ENV, json.dumps({"available": True, "device_name": "FAKE GPU"}))  # FAKE probe
    monkeypatch.setitem(runner.REQUIRED, "no_such_module_for_gpu_check", "no-such-dist")
    assert runner.main(["--out", str(tmp_path)]) == 2
    assert "missing Python packages: no-such-dist" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["status"] == "error" and "no-such-dist" in report["reason"]


def test_a_run_that_records_no_check_is_an_error(tmp_path):
    fake = {"available": True, "device_name": "FAKE GPU", "total_memory": 0}  # FAKE probe: no test is selected
    done = _run(["-k", "no_test_is_called_this"], {PROBE_ENV: json.dumps(fake)}, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["status"] == "error" and report["pytest_exit"] == 5
    assert report["reason"] == "pytest exited 5 (see pytest.log)"
    assert (tmp_path / "pytest.log").exists() and "pytest.log" in report["artifacts"]


def test_an_interpreter_without_torch_is_an_error_not_a_skip(tmp_path, monkeypatch, capsys):
    # FAKE: pretend torch is not importable (a venv made from another venv loses its packages).
    monkeypatch.setattr(runner, "missing_modules", lambda names: [n for n in names if n == "torch"])
    assert runner.main(["--out", str(tmp_path)]) == 2
    assert "torch cannot be imported by" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["status"] == "error" and report["reason"].startswith("torch cannot be imported")
