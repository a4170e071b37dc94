"""Run the GPU validation suite (tests/gpu) and report every check against its ground truth.

    make gpu-check                      # or: python scripts/gpu_check.py [-k EXPR] [--timeout S]

On a machine with an NVIDIA GPU: runs ``pytest tests/gpu`` in a subprocess (so a crash in CUDA
code still leaves a report), collects the rows the suite records (check, expected, measured,
pass/fail), prints them as a table and writes ``gpu-check.json`` beside the suite's plots into
``$OOM_MAGIC_GPU_OUT`` (default ``gpu-check-out/``).

Without a usable CUDA GPU it runs nothing, says why, writes ``gpu-check.json`` with
``"status": "skipped"`` and exits 0: the command is safe to run anywhere, and the JSON says
plainly that nothing was checked.

Exit status: 0 every check passed (or skipped: no GPU), 1 a check or test failed, 2 the suite
could not run (missing packages, a crash, the time limit).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "gpu"
DEFAULT_OUT = "gpu-check-out"
DEFAULT_TIMEOUT = 450  # seconds for the whole suite: the budget is 8 minutes, probe and report included

# The eight checks, for the summary (and for the skipped report: what was not checked).
CHECKS = {
    1: "no cost: %load_ext, %gpumem and idle hooks create no CUDA context",
    2: "readings equal torch.cuda.memory_allocated/reserved and NVML",
    3: "a real OOM while loading under a 2 GiB cap: parsed, given back, retried",
    4: "other processes listed with pid and bytes; Jupyter kernels flagged",
    5: "fragmentation diagnosed; expandable_segments in effect after %%guardload",
    6: "stale-memory traps on CUDA: %freeall restores the baseline, user memory stays",
    7: "the widget's figures equal the allocator's and NVML's",
    8: "--snapshot writes a snapshot PyTorch's tooling loads; largest free block agrees",
    9: "--target caps a real load at the deployment GPU's usable memory, and the user's fraction comes back",
    10: "fit_check's job sizing against a real generate (weights, KV cache, peak) and a real AdamW step",
    11: "a steady %gpumem with unmoved allocator counts makes no heap pass, names unchanged",
    12: "%%guardload sizes the job its cell runs; the room it reports after the load is the real cache's",
}

# Module -> pip name; the suite needs these (what the GPU machine brings, plus oom-magic's own).
REQUIRED = {"torch": "torch", "pytest": "pytest", "IPython": "ipython", "traitlets": "traitlets",
            "ipywidgets": "ipywidgets", "psutil": "psutil", "pynvml": "nvidia-ml-py",
            "transformers": "transformers", "safetensors": "safetensors", "matplotlib": "matplotlib"}
OPTIONAL = {"jupyter_client": "jupyter_client", "ipykernel": "ipykernel"}  # check 4's second kernel


def _support() -> Any:
    """tests/gpu/support.py (the CUDA probe), loaded by path: no package import, no torch."""
    spec = importlib.util.spec_from_file_location("_gpu_support", SUITE / "support.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def missing_modules(names: Iterable[str]) -> list[str]:
    """The modules of ``names`` this interpreter cannot import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


# -- reading what the suite recorded --------------------------------------------------------------


def load_records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, test outcomes) from the suite's JSON-lines file; a torn last line is skipped."""
    rows: list[dict[str, Any]] = []
    tests: list[dict[str, Any]] = []
    if not path.exists():
        return rows, tests
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "row":
            rows.append(record)
        elif record.get("type") == "test":
            tests.append(record)
    return rows, tests


def test_outcomes(tests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One outcome per test: the worst of its phases (setup/call/teardown)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    result: dict[str, dict[str, Any]] = {}
    for record in tests:
        current = result.get(record["test"])
        outcome = record["outcome"]
        if record.get("when") != "call" and outcome == "failed":
            outcome = "error"  # a fixture or teardown failed, not the check itself
        entry = dict(record, outcome=outcome)
        if current is None or rank.get(outcome, 3) >= rank.get(current["outcome"], 3):
            result[record["test"]] = entry
    return result


def unrecorded_failures(rows: list[dict[str, Any]], tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for tests that failed or were skipped without a failing row of their own to show it."""
    failing_tests = {r["test"] for r in rows if not r["passed"]}
    extra = []
    for test, record in sorted(test_outcomes(tests).items()):
        if record["outcome"] in ("failed", "error") and test not in failing_tests:
            extra.append({"type": "row", "item": _item_of(test), "check": f"{_short_test(test)} ({record['outcome']})",
                          "expected": "runs to the end", "measured": record.get("message") or record["outcome"],
                          "unit": None, "tolerance": None, "passed": False, "note": None, "test": test})
        elif record["outcome"] == "skipped":
            extra.append({"type": "row", "item": _item_of(test), "check": f"{_short_test(test)} (skipped)",
                          "expected": "runs", "measured": record.get("message") or "skipped", "unit": None,
                          "tolerance": None, "passed": None, "note": None, "test": test})
    return extra


def _item_of(test: str) -> int | None:
    name = test.split("::")[0].rsplit("/", 1)[-1]
    digits = name.removeprefix("test_")[:2]
    return int(digits) if digits.isdigit() else None


def _short_test(test: str) -> str:
    return test.split("::", 1)[-1]


# -- formatting -------------------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """Bytes for people (powers of 1024), as oom-magic's render.units prints them."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_value(value: Any, unit: str | None) -> str:
    """One expected or measured value as the table shows it."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, dict):
        if set(value) == {"at_most"}:
            return "≤ " + format_value(value["at_most"], unit)
        if set(value) == {"at_least"}:
            return "≥ " + format_value(value["at_least"], unit)
        return ", ".join(f"{k}={format_value(v, unit)}" for k, v in value.items())
    if isinstance(value, int) and unit == "bytes":
        return format_bytes(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v, None) for v in value) + "]"
    return str(value)


def format_expected(row: dict[str, Any]) -> str:
    """The expected value with its tolerance (``1.00 GiB ± 1.00 MiB``)."""
    text = format_value(row.get("expected"), row.get("unit"))
    tolerance = row.get("tolerance")
    if tolerance:
        text += " ± " + format_value(tolerance, row.get("unit"))
    return text


def format_measured(row: dict[str, Any]) -> str:
    """The measured value; exact bytes are added where the rounded figure would hide a difference."""
    unit = row.get("unit")
    expected, measured = row.get("expected"), row.get("measured")
    text = format_value(measured, unit)
    if (unit == "bytes" and isinstance(measured, int) and isinstance(expected, int) and not isinstance(measured, bool)
            and measured != expected and text == format_value(expected, unit)):
        text += f" ({measured - expected:+d} B)"
    return text


def result_word(row: dict[str, Any]) -> str:
    """PASS, FAIL or SKIP."""
    return "SKIP" if row.get("passed") is None else ("PASS" if row["passed"] else "FAIL")


def _clip(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(rows: list[dict[str, Any]], *, width: int = 160) -> str:
    """The summary table: check | expected | measured | result, grouped by the issue's item number."""
    head = ("#", "check", "expected", "measured", "result")
    lines: list[tuple[str, str, str, str, str]] = []
    for row in sorted(rows, key=lambda r: (r.get("item") or 99)):
        lines.append((str(row.get("item") or "?"), row["check"], format_expected(row), format_measured(row),
                      result_word(row)))
    limits = [2, max(30, width - 2 - 28 - 28 - 6 - 8), 28, 28, 6]
    cells = [tuple(_clip(c, limit) for c, limit in zip(line, limits)) for line in [head, *lines]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    out = []
    for n, c in enumerate(cells):
        out.append("  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_notes(rows: list[dict[str, Any]], *, width: int = 160) -> str:
    """The notes of the rows that did not pass (why, or what the figure means), one line each."""
    lines = [f"[{r.get('item') or '?'}] {r['check']}: {r['note']}" for r in rows
             if r.get("note") and r.get("passed") is not True]
    return "\n".join("  " + _clip(line, width - 2) for line in lines)


def summarize(rows: list[dict[str, Any]], tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of rows and tests by outcome, and the overall status (passed/failed)."""
    outcomes = test_outcomes(tests)
    counts = {"rows": len(rows), "passed": sum(1 for r in rows if r.get("passed") is True),
              "failed": sum(1 for r in rows if r.get("passed") is False),
              "skipped": sum(1 for r in rows if r.get("passed") is None)}
    test_counts: dict[str, int] = {}
    for record in outcomes.values():
        test_counts[record["outcome"]] = test_counts.get(record["outcome"], 0) + 1
    bad = counts["failed"] or test_counts.get("failed") or test_counts.get("error")
    status = "failed" if bad else ("passed" if counts["passed"] else "empty")
    return {"status": status, "rows": counts, "tests": test_counts}


def build_report(status: str, *, reason: str | None, probe: dict[str, Any], rows: list[dict[str, Any]],
                 tests: list[dict[str, Any]], seconds: float, out_dir: Path, pytest_exit: int | None = None,
                 log_tail: str | None = None) -> dict[str, Any]:
    """The JSON document gpu-check.json holds."""
    summary = summarize(rows, tests)
    summary["status"] = status  # the run's verdict, which may differ from the rows' (skipped, error)
    items = {}
    for number, what in CHECKS.items():
        mine = [r for r in rows if r.get("item") == number]
        state = ("not run" if not mine else "failed" if any(r.get("passed") is False for r in mine)
                 else "skipped" if all(r.get("passed") is None for r in mine) else "passed")
        items[str(number)] = {"what": what, "status": state, "rows": len(mine)}
    artifacts = sorted(p.name for p in out_dir.iterdir() if p.is_file() and p.name != "gpu-check.json") \
        if out_dir.exists() else []
    return {
        "status": status,
        "reason": reason,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), **probe},
        "summary": summary,
        "checks": items,
        "rows": rows,
        "tests": sorted(test_outcomes(tests).values(), key=lambda t: t["test"]),
        "pytest_exit": pytest_exit,
        "log_tail": log_tail,
        "artifacts": artifacts,
    }


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Write gpu-check.json into ``out_dir``; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu-check.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def headline(report: dict[str, Any]) -> str:
    """One closing line: status, counts, time, where the JSON is."""
    s = report["summary"]["rows"]
    tests = report["summary"]["tests"]
    test_text = ", ".join(f"{n} {k}" for k, n in sorted(tests.items())) or "no tests"
    return (f"gpu-check {report['status'].upper()}: {s['passed']} passed, {s['failed']} failed, "
            f"{s['skipped']} skipped checks ({test_text}) in {report['seconds']:.0f} s")


# -- running ------------------------------------------------------------------------------------------


def run_suite(out_dir: Path, probe: dict[str, Any], timeout: float, extra: list[str]) -> tuple[int | None, str, Path]:
    """Run pytest on tests/gpu in a subprocess; (exit code or None on timeout, log tail, rows file)."""
    support = _support()
    rows_file = out_dir / "rows.jsonl"
    rows_file.unlink(missing_ok=True)
    env = dict(os.environ)
    for name in support.ALLOC_CONF_VARS:  # the suite sets the allocator up itself
        env.pop(name, None)
    env[support.ROWS_ENV] = str(rows_file.resolve())
    env[support.OUT_ENV] = str(out_dir.resolve())
    env[support.PROBE_ENV] = json.dumps(probe)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "pytest", str(SUITE.relative_to(REPO)), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "-rfEs", *extra]
    log = out_dir / "pytest.log"
    with log.open("w", encoding="utf-8") as handle:
        try:
            done = subprocess.run(command, cwd=str(REPO), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
    return code, tail, rows_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OOM_MAGIC_GPU_OUT") or DEFAULT_OUT,
                        help="folder for gpu-check.json, the log and the plots (default $OOM_MAGIC_GPU_OUT "
                             f"or {DEFAULT_OUT}/)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds the suite may run before it is stopped (default {DEFAULT_TIMEOUT})")
    parser.add_argument("-k", dest="keyword", default=None, help="run only the tests pytest -k selects")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out_dir = Path(args.out)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    if missing_modules(["torch"]):
        # Not "no GPU": this interpreter lacks torch (a venv made from another venv loses its packages).
        reason = f"torch cannot be imported by {sys.executable}: run this script with the Python that has torch"
        report = build_report("error", reason=reason, probe={}, rows=[], tests=[],
                              seconds=time.monotonic() - started, out_dir=out_dir)
        path = write_report(report, out_dir)
        print(f"gpu-check ERROR: {reason}\nwrote {path}")
        return 2
    probe = _support().probe_cuda()
    if not probe.get("available"):
        reason = f"no CUDA GPU is present: {probe.get('reason')}"
        report = build_report("skipped", reason=reason, probe=probe, rows=[], tests=[],
                              seconds=time.monotonic() - started, out_dir=out_dir)
        path = write_report(report, out_dir)
        print(f"gpu-check SKIPPED: {reason}.")
        print("Nothing was checked; run `make gpu-check` on a machine with an NVIDIA GPU.")
        print(f"wrote {path}")
        return 0

    missing = missing_modules(REQUIRED)
    if missing:
        names = " ".join(REQUIRED[m] for m in missing)
        reason = f"missing Python packages: {names} (install them, e.g. pip install {names})"
        report = build_report("error", reason=reason, probe=probe, rows=[], tests=[],
                              seconds=time.monotonic() - started, out_dir=out_dir)
        path = write_report(report, out_dir)
        print(f"gpu-check ERROR: {reason}\nwrote {path}")
        return 2
    optional = [OPTIONAL[m] for m in missing_modules(OPTIONAL)]
    print(f"gpu-check on {probe.get('device_name')} ({format_bytes(int(probe.get('total_memory') or 0))}), "
          f"torch {probe.get('torch')}, CUDA {probe.get('cuda_build')}, driver {probe.get('driver')}"
          + (f"; without {', '.join(optional)} (check 4's kernel test will skip)" if optional else ""), flush=True)

    extra = ["-k", args.keyword] if args.keyword else []
    code, tail, rows_file = run_suite(out_dir, probe, args.timeout, extra)
    rows, tests = load_records(rows_file)
    rows = rows + unrecorded_failures(rows, tests)
    status = summarize(rows, tests)["status"]
    reason = None
    if code is None:
        status, reason = "error", f"the suite ran past {args.timeout:.0f} s and was stopped"
    elif code not in (0, 1) and status != "failed":
        status, reason = "error", f"pytest exited {code} (see pytest.log)"
    elif status == "empty":
        status, reason = "error", "the suite recorded no checks (see pytest.log)"
    report = build_report(status, reason=reason, probe=probe, rows=rows, tests=tests,
                          seconds=time.monotonic() - started, out_dir=out_dir, pytest_exit=code,
                          log_tail=tail if status != "passed" else None)
    path = write_report(report, out_dir)
    print(format_table(rows))
    notes = format_notes(rows)
    if notes:
        print("\nnotes on the rows that did not pass:\n" + notes)
    print()
    if reason:
        print(f"note: {reason}")
    print(headline(report))
    print(f"wrote {path}" + (f" and {', '.join(report['artifacts'])}" if report["artifacts"] else ""))
    return {"passed": 0, "failed": 1}.get(status, 2)


if __name__ == "__main__":
    sys.exit(main())
