"""Measure what the after-cell hook adds to a cell: 1,000 trivial cells with and without the extension.

A real IPython shell runs the same trivial cell (``x = 1``) 1,000 times without the extension,
then with it loaded (auto display ``changes``, torch imported, so the hook does its cpu reading:
the resident set and the tensor-holding variables of the namespace). Rounds alternate
without/with so drift hits both; the median round of each counts. The hook's own cost is also
timed by calling its two callbacks directly. Nothing changes memory in these cells, so this is
the "nothing changed" path: no heap scan, no widget. Timings are printed, never asserted.

Run: ``.venv/bin/python benchmarks/bench_hook.py [cells] [rounds]``.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRIVIAL_CELL = "x = 1"


def _shell() -> Any:
    from IPython.testing.globalipapp import start_ipython

    return start_ipython()


def _per_cell_ms(ip: Any, cells: int) -> float:
    started = time.perf_counter()
    for _ in range(cells):
        ip.run_cell(TRIVIAL_CELL, store_history=True)
    return (time.perf_counter() - started) * 1000 / cells


def _hook_ms(ip: Any, calls: int) -> float:
    """The two callbacks alone, as IPython calls them around one cell."""
    watch = ip.magics_manager.registry["OomMagics"].cell_watch
    result = ip.run_cell(TRIVIAL_CELL, store_history=True)
    pre, post = watch.pre_run_cell, watch.post_run_cell
    started = time.perf_counter()
    for _ in range(calls):
        pre(result.info)
        post(result)
    return (time.perf_counter() - started) * 1000 / calls


def run(cells: int = 1000, rounds: int = 5) -> dict[str, Any]:
    """Per-cell milliseconds with and without the extension, their difference and ratio."""
    ip = _shell()
    ip.run_cell("import torch", store_history=True)
    if "OomMagics" in ip.magics_manager.registry:
        ip.run_line_magic("unload_ext", "oom_magic")
    _per_cell_ms(ip, 200)  # warm up the shell and its history database
    without, with_ext = [], []
    widgets = 0
    hook = []
    for _ in range(rounds):
        without.append(_per_cell_ms(ip, cells))
        ip.run_line_magic("load_ext", "oom_magic")
        watch = ip.magics_manager.registry["OomMagics"].cell_watch
        assert ip.magics_manager.registry["OomMagics"].auto_display == "changes"
        with_ext.append(_per_cell_ms(ip, cells))
        hook.append(_hook_ms(ip, cells))
        widgets += len(watch.live)
        enabled = watch.enabled
        ip.run_line_magic("unload_ext", "oom_magic")
        if not enabled:
            raise RuntimeError("the hook turned itself off during the benchmark")
    base, loaded = statistics.median(without), statistics.median(with_ext)
    return {
        "cells": cells,
        "rounds": rounds,
        "device": "cpu",
        "namespace_entries": len(ip.user_ns),
        "without_ms": round(base, 4),
        "with_ms": round(loaded, 4),
        "added_ms": round(loaded - base, 4),
        "ratio": round(loaded / base, 3),
        "hook_only_ms": round(statistics.median(hook), 4),
        "widgets_shown": widgets,
        "budget_ms": 0.5,
    }


def main(argv: list[str]) -> None:
    cells = int(argv[1]) if len(argv) > 1 else 1000
    rounds = int(argv[2]) if len(argv) > 2 else 5
    result = run(cells, rounds)
    print(f"after-cell hook, {result['cells']} trivial cells × {result['rounds']} rounds, torch imported "
          f"({result['device']}, {result['namespace_entries']} namespace entries at the end)")
    print(f"  without the extension   {result['without_ms']:.4f} ms per cell")
    print(f"  with it (auto changes)  {result['with_ms']:.4f} ms per cell")
    print(f"  added                   {result['added_ms']:.4f} ms per cell  (ratio {result['ratio']:.3f}; "
          f"budget {result['budget_ms']} ms)")
    print(f"  the two callbacks alone {result['hook_only_ms']:.4f} ms per cell")
    print(f"  widgets shown           {result['widgets_shown']} (nothing changed, so none expected)")


if __name__ == "__main__":
    main(sys.argv)
