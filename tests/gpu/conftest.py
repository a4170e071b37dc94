"""The GPU suite's skip rule, its row recorder and its CUDA fixtures.

Skip rule: every test under tests/gpu carries the ``gpu`` marker and is skipped, with the reason,
when a fresh interpreter says CUDA is unusable (``support.probe_cuda``); the check runs in a
subprocess, so this process never initialises CUDA (or imports torch) for it, and runs once, when
the first of the suite's tests is set up (not at collection, which every xdist worker repeats).

Rows: each check records (check, expected, measured, passed) through the ``checks`` fixture; the
rows go to the JSON-lines file named by ``OOM_MAGIC_GPU_ROWS`` (set by scripts/gpu_check.py,
which prints the table and writes the JSON), one line per row as it is recorded, so a crash
keeps what came before it.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.gpu.support import ALLOC_CONF_VARS, OUT_ENV, ROWS_ENV, allocator_facts, probe_cuda

HERE = Path(__file__).resolve().parent
_probe: dict[str, Any] | None = None


def _cuda_probe() -> dict[str, Any]:
    global _probe
    if _probe is None:
        _probe = probe_cuda()
    return _probe


def _in_suite(item: pytest.Item) -> bool:
    try:
        return Path(str(item.fspath)).resolve().is_relative_to(HERE)
    except (OSError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the suite's tests ``gpu`` and put them in one xdist group: they read one device's memory,
    so no two may run side by side."""
    for item in items:
        if _in_suite(item):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.xdist_group("gpu"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip the suite's tests, saying why, when CUDA is unusable here.

    Asked at setup, not at collection: every xdist worker collects the whole suite, and the probe
    (a fresh interpreter importing torch) costs seconds; only the worker that runs the group asks.
    """
    if not _in_suite(item):
        return
    probe = _cuda_probe()
    if not probe.get("available"):  # a skip mark, read by pytest's own setup hook next: reported as before
        item.add_marker(pytest.mark.skip(reason=f"no CUDA GPU: {probe.get('reason')} "
                                                "(this suite runs with `make gpu-check` on a machine with an NVIDIA GPU)"))


# -- the rows ----------------------------------------------------------------------------------


class _Sink:
    """Appends JSON lines to the runner's rows file (when the runner named one)."""

    def __init__(self) -> None:
        path = os.environ.get(ROWS_ENV)
        self.path = Path(path) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


_sink = _Sink()


class Checks:
    """One test's rows: each compares what we measured with the ground truth, within a tolerance.

    Recording never raises, so one test records all its rows; ``verify()`` then fails the test
    with every row that did not pass.
    """

    def __init__(self, item: int, test: str) -> None:
        self.item = item
        self.test = test
        self.rows: list[dict[str, Any]] = []
        self.verified = False

    def row(self, check: str, expected: Any, measured: Any, passed: bool | None, *, unit: str | None = None,
            tolerance: Any = None, note: str | None = None) -> bool:
        """Record one row as given (``passed=None``: could not be checked here, shown as SKIP)."""
        record = {"type": "row", "item": self.item, "check": check, "expected": expected, "measured": measured,
                  "unit": unit, "tolerance": tolerance, "passed": None if passed is None else bool(passed),
                  "note": note, "test": self.test}
        self.rows.append(record)
        _sink.write(record)
        return bool(passed)

    def skip(self, check: str, why: str) -> bool:
        """A row this machine cannot check (no ground truth here), with the reason; never a failure."""
        return self.row(check, None, None, None, note=why)

    def equal(self, check: str, expected: Any, measured: Any, *, tol: int | float = 0, unit: str | None = "bytes",
              note: str | None = None) -> bool:
        """Numbers within ``tol`` of each other (other values: equal); None never passes."""
        if isinstance(expected, (int, float)) and isinstance(measured, (int, float)) \
                and not isinstance(expected, bool) and not isinstance(measured, bool):
            passed = abs(measured - expected) <= tol
        else:
            passed = expected is not None and measured == expected
        return self.row(check, expected, measured, passed, unit=unit, tolerance=tol or None, note=note)

    def at_most(self, check: str, limit: int | float, measured: int | float | None, *, unit: str | None = "bytes",
                note: str | None = None) -> bool:
        """``measured <= limit``."""
        passed = measured is not None and measured <= limit
        return self.row(check, f"≤ {limit}" if unit is None else {"at_most": limit}, measured, passed,
                        unit=unit, note=note)

    def at_least(self, check: str, limit: int | float, measured: int | float | None, *, unit: str | None = "bytes",
                 note: str | None = None) -> bool:
        """``measured >= limit``."""
        passed = measured is not None and measured >= limit
        return self.row(check, f"≥ {limit}" if unit is None else {"at_least": limit}, measured, passed,
                        unit=unit, note=note)

    def true(self, check: str, measured: Any, *, expected: Any = True, note: str | None = None) -> bool:
        """A fact that must hold (``measured == expected``, default True)."""
        return self.row(check, expected, measured, measured == expected, note=note)

    def failures(self) -> list[dict[str, Any]]:
        """The rows that did not pass."""
        return [r for r in self.rows if r["passed"] is False]

    def verify(self) -> None:
        """Fail the test, listing every row that did not pass."""
        self.verified = True
        bad = self.failures()
        if bad:
            lines = [f"{len(bad)} of {len(self.rows)} checks failed:"]
            lines += [f"  {r['check']}: expected {r['expected']!r}, measured {r['measured']!r}"
                      + (f" (tolerance {r['tolerance']})" if r["tolerance"] else "")
                      + (f" — {r['note']}" if r["note"] else "") for r in bad]
            pytest.fail("\n".join(lines), pytrace=False)


@pytest.fixture
def checks(request: pytest.FixtureRequest) -> Iterator[Checks]:
    """Rows for this test, numbered by the module's ``ITEM`` (the issue's check number)."""
    recorder = Checks(int(getattr(request.module, "ITEM", 0)), request.node.nodeid)
    yield recorder
    if not recorder.verified and recorder.failures():
        recorder.verify()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Tell the runner each test's outcome (a test can fail before it records a row)."""
    if report.when != "call" and report.passed:
        return
    if report.when == "teardown" and report.skipped:
        return
    message = None
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    elif report.failed:
        message = _short(report.longreprtext)
    _sink.write({"type": "test", "test": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "duration": round(report.duration, 3), "message": message})


def _short(text: str, limit: int = 600) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.lstrip().startswith("E ")]
    picked = "\n".join((errors or lines)[-8:])
    return picked[-limit:]


# -- CUDA in this process ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def out_dir() -> Path:
    """Where plots and dumps go: $OOM_MAGIC_GPU_OUT, default gpu-check-out/."""
    path = Path(os.environ.get(OUT_ENV) or "gpu-check-out")
    path.mkdir(parents=True, exist_ok=True)
    return path


class OomObserver:
    """The allocator's own account of each out-of-memory error, taken inside the allocator.

    Registered once through ``torch._C._cuda_attach_out_of_memory_observer`` (there is no detach);
    while armed it keeps, per OOM: the rounded request, the limit (the fraction cap, else the
    device total), the free bytes CUDA reported, and ``memory_allocated``/``memory_reserved`` and
    the largest free block read right then (the allocator has released its lock by that point).
    """

    def __init__(self) -> None:
        self.events: list[dict[str, int]] = []
        self.armed = False

    def __call__(self, device: int, requested: int, limit: int, device_free: int) -> None:
        if not self.armed:
            return
        # Called from inside the allocator: nothing may escape into C++.
        try:
            torch = sys.modules["torch"]
            event = {"device": int(device), "requested": int(requested), "limit": int(limit),
                     "device_free": int(device_free), "allocated": int(torch.cuda.memory_allocated(device)),
                     "reserved": int(torch.cuda.memory_reserved(device))}
            event["largest_free_block"] = allocator_facts(torch.cuda.memory_snapshot())["largest_free_block"]
        except Exception as exc:
            event = {"error": f"{type(exc).__name__}: {exc}"}
        self.events.append(event)

    def last(self) -> dict[str, int]:
        """The latest out-of-memory event with its figures, or {} when none was seen."""
        good = [e for e in self.events if "error" not in e]
        return good[-1] if good else {}

    def arm(self) -> None:
        """Start keeping events (and forget earlier ones)."""
        self.events.clear()
        self.armed = True

    def disarm(self) -> None:
        """Stop keeping events."""
        self.armed = False


_observer = OomObserver()


@pytest.fixture(scope="session")
def cuda(out_dir: Path) -> Any:
    """torch with CUDA initialised here, without expandable segments, and warmed up.

    Initialising first, before any ``%%guardload`` runs in this process, keeps the guard from
    switching this process's allocator to expandable segments (checks 3, 5 and 8 depend on the
    classic layout; check 5 tests the switch in fresh processes). The warm-up creates cuBLAS's
    handle and workspace, which PyTorch keeps allocated, before any check takes a baseline.
    """
    for name in ALLOC_CONF_VARS:
        os.environ.pop(name, None)
    import torch

    torch.cuda.init()
    a = torch.ones(64, 64, device="cuda", requires_grad=True)
    (a @ a).sum().backward()
    torch.nn.functional.linear(torch.ones(8, 64, device="cuda"), a.detach()).sum().item()
    del a
    torch.cuda.synchronize()
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:  # without it (an old torch) the checks that need it say so
        attach(_observer)
    gc.collect()
    torch.cuda.empty_cache()
    return torch


@pytest.fixture
def oom_observer(cuda: Any) -> Iterator[OomObserver]:
    """The allocator's OOM observer, armed for this test."""
    _observer.arm()
    yield _observer
    _observer.disarm()


@pytest.fixture
def gpu_ip(ip: Any, cuda: Any) -> Iterator[Any]:
    """The real IPython shell with the extension loaded and torch imported; CUDA state restored after."""
    result = ip.run_cell("import torch, gc, sys, weakref", store_history=True)
    assert result.error_in_exec is None
    yield ip
    torch = cuda
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    gc.collect()
    torch.cuda.empty_cache()

