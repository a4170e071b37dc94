"""Measure what %%guardload adds to a cell that loads nothing big, on heaps of ~400k gc objects.

A real IPython shell holds one heap shape from ``heaps.build_shape`` (400k objects, 1k tensors);
the same small cell (``x = torch.ones(10)``) runs plain and under ``%%guardload --device cpu``,
alternating, and the median of each counts. The guard's cleanup, fit check and before/after scans
are what the difference measures (issue 12's target: ≤ 300 ms at 400k objects). Printed, never
asserted.

Run: ``.venv/bin/python benchmarks/bench_guard.py [shape ...]``.
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.heaps import build_shape  # noqa: E402

CELL = "x = torch.ones(10)"
OBJECTS = 400_000
SHAPES = ("slots", "sets", "kv_cache", "model_adamw")


def _cell_ms(ip: Any, code: str, guarded: bool) -> float:
    started = time.perf_counter()
    if guarded:
        with open("/dev/null", "w") as sink, _stdout(sink):
            ip.run_cell_magic("guardload", "--device cpu --quiet", code)
    else:
        ip.run_cell(code, store_history=True)
    return (time.perf_counter() - started) * 1000


class _stdout:
    def __init__(self, sink: Any) -> None:
        self.sink, self.saved = sink, None

    def __enter__(self) -> None:
        self.saved, sys.stdout = sys.stdout, self.sink

    def __exit__(self, *exc: Any) -> None:
        sys.stdout = self.saved


def run(shapes: tuple[str, ...] = SHAPES, rounds: int = 7) -> dict[str, Any]:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_cell("import torch", store_history=True)
    ip.run_line_magic("load_ext", "oom_magic")
    ip.run_line_magic("gpumem", "--auto off")  # the after-cell widget has its own benchmark
    results: dict[str, Any] = {}
    for shape in shapes:
        namespace: dict[str, Any] = {}
        build_shape(shape, 1_000, namespace, objects=OBJECTS)
        ip.user_ns.update(namespace)
        objects = len(gc.get_objects())
        plain, guarded = [], []
        for _ in range(rounds):
            plain.append(_cell_ms(ip, CELL, guarded=False))
            guarded.append(_cell_ms(ip, CELL, guarded=True))
        results[shape] = {"objects": objects, "plain_ms": statistics.median(plain),
                          "guarded_ms": statistics.median(guarded),
                          "added_ms": statistics.median(guarded) - statistics.median(plain)}
        print(f"{shape:12s} {objects:>9,} objects  plain {results[shape]['plain_ms']:7.1f} ms  "
              f"guarded {results[shape]['guarded_ms']:7.1f} ms  added {results[shape]['added_ms']:7.1f} ms",
              flush=True)
        for key in namespace:
            ip.user_ns.pop(key, None)
        namespace.clear()
        ip.run_line_magic("reset", "-f out")
        gc.collect()
    return results


if __name__ == "__main__":
    print(json.dumps(run(tuple(sys.argv[1:]) or SHAPES), indent=1))
