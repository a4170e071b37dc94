"""Time the heap engine on every heap shape of issue 12 against the floor, the naive scan and memlab.

One fresh process per heap (``heaps.build_shape``: ~800k gc objects, 1k or 100k tensors placed in
that shape's data). In it, round-robin, automatic gc off for all:

- floor: ``gc.get_objects()``;
- naive: ``[o for o in gc.get_objects() if torch.is_tensor(o)]`` plus a storage read per tensor;
- memlab: pytorch_memlab's ``MemReporter().report()`` (printed table to /dev/null), when importable;
- cold: the first ``oom_magic.snapshot("cpu")`` of the process (a walk, nothing remembered): one sample
  a process, so two more fresh processes time only it and their floor, and the row gives the median
  of the three ratios;
- steady: later snapshots, the data unchanged (remembered paths re-checked, walks only for the rest);
- hook: the after-cell hook on a cell that changed memory (its two callbacks, timed as IPython runs them
  in a real shell holding the heap, ``hook_budget_ms`` at its default 50): the device reading, a full
  scan when one fits, else the quick view, whose walk gets what the budget leaves after the widget
  and the naming past the walk (``ScanCost``, learnt over the cells before), and the widget. Five
  cells; the median of the last three.

Each snapshot's name for the spot-checked tensor is compared with the path a user would type.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# (shape, tensors): the 1k-tensor heaps for every shape, 100k tensors for a few.
PLAN = tuple((shape, 1_000) for shape in
             ("slots", "attrs", "dataclass", "namedtuple", "nested_dicts", "tree", "sets", "deque", "numpy",
              "pandas", "model_adamw", "kv_cache", "module_list", "class_attrs", "user_module", "garbage",
              "linked_list", "researcher", "finetuner", "data_scientist")) + (("garbage", 200),) + \
       tuple((shape, 100_000) for shape in ("slots", "nested_dicts", "kv_cache"))
# A first scan is one sample per process (its floor the best of three after it): the median of this many.
FIRST_SAMPLES = 3


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def _built(shape: str, tensors: int) -> dict[str, Any]:
    """Build one heap in this process, collected and with automatic gc off: what a measurement needs."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import heaps
    import torch

    import oom_magic
    from oom_magic.heap.roots import collect_roots

    # memlab is imported before the heap is built (its imports add ~90k objects), so the first scan,
    # the floor and every contender see one heap of the stated size.
    try:
        with contextlib.redirect_stderr(open(os.devnull, "w")), contextlib.redirect_stdout(open(os.devnull, "w")):
            from pytorch_memlab import MemReporter  # noqa: F401
    except Exception as exc:
        memlab_error: str | None = f"{type(exc).__name__}: {exc}"
    else:
        memlab_error = None
    namespace: dict[str, Any] = {}
    started = time.perf_counter()
    spot_path, spot = heaps.build_shape(shape, tensors, namespace)
    build = time.perf_counter() - started
    gc.collect()
    gc.disable()
    late = namespace.pop("__late__", None)
    if late is not None:  # what the collection above must not free (the garbage shape)
        spot_path, spot = late()
    spot_key = torch._C._storage_address(spot)
    del spot

    def snap() -> Any:
        return oom_magic.snapshot("cpu", roots=collect_roots(namespace=namespace))

    def spot_name(s: Any) -> str | None:
        return next((r.holder_path for r in s.storages if r.key == spot_key), None)

    return {"namespace": namespace, "spot_path": spot_path, "build": build, "objects": len(gc.get_objects()),
            "snap": snap, "spot_name": spot_name, "torch": torch, "memlab_error": memlab_error}


def _floor() -> float:
    return _timed(lambda: len(gc.get_objects()))[0]


def measure_first(shape: str, tensors: int) -> dict[str, Any]:
    """Only the first scan and the floor (the best of three after it), in a fresh process: the first
    scan is one sample per process, so ``run`` takes the median over FIRST_SAMPLES processes."""
    heap = _built(shape, tensors)
    cold, first = _timed(heap["snap"])
    named = heap["spot_name"](first)
    del first
    floor = min(_floor() for _ in range(3))
    return {"cold_ms": cold * 1000, "floor_ms": floor * 1000, "cold_x": cold / floor, "cold_name": named,
            "spot": heap["spot_path"]}


def measure(shape: str, tensors: int, repeat: int = 3) -> dict[str, Any]:
    """Build one heap in this process and time every contender on it (call in a fresh process)."""
    heap = _built(shape, tensors)
    namespace, snap, spot_name, torch = heap["namespace"], heap["snap"], heap["spot_name"], heap["torch"]
    spot_path, build, objects = heap["spot_path"], heap["build"], heap["objects"]
    cold, first = _timed(snap)
    cold_name, cold_complete = spot_name(first), first.attribution_complete
    del first
    contenders: dict[str, Callable[[], Any]] = {
        "floor": lambda: len(gc.get_objects()),
        "naive": lambda: len({t.untyped_storage()._cdata for t in gc.get_objects() if torch.is_tensor(t)}),
        "steady": snap,
    }
    memlab_error = heap["memlab_error"]
    if memlab_error is None:
        contenders["memlab"] = _memlab
    times: dict[str, list[float]] = {name: [] for name in contenders}
    steady_name = None
    for _ in range(repeat):
        for name, fn in contenders.items():
            seconds, value = _timed(fn)
            times[name].append(seconds)
            if name == "steady":
                steady_name = spot_name(value)
            del value
    hook, hook_name, hook_walk_ms = _hook(namespace, spot_name)
    best = {name: min(ts) for name, ts in times.items()}
    floor = best["floor"]
    return {
        "shape": shape, "tensors": tensors, "objects": objects, "build_s": round(build, 1),
        "floor_ms": floor * 1000, "cold_ms": cold * 1000, "hook_ms": hook * 1000, "hook_walk_ms": hook_walk_ms,
        "best_ms": {k: v * 1000 for k, v in best.items()}, "all_ms": {k: [t * 1000 for t in v] for k, v in times.items()},
        "x_floor": {k: v / floor for k, v in best.items()} | {"cold": cold / floor},
        "spot": spot_path, "cold_name": cold_name, "steady_name": steady_name, "hook_name": hook_name,
        "cold_complete": cold_complete, "memlab_error": memlab_error,
    }


def _hook(namespace: dict[str, Any], spot_name: Callable[[Any], str | None],
          cells: int = 5) -> tuple[float, str | None, float | None]:
    """(seconds, spot name, walk ms or None for a full scan) of the after-cell hook on a cell that changed
    memory: its two callbacks, as IPython runs them around each cell, in a real shell holding the heap."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.user_ns.update(namespace)
    shell.run_line_magic("load_ext", "oom_magic")
    magics = shell.magics_manager.registry["OomMagics"]
    magics.hook_budget_ms = HOOK_BUDGET_MS
    watch = magics.cell_watch
    spent = [0.0]
    walks: list[float | None] = []

    def timed(event: str, callback: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            if event == "post_run_cell":
                walks.append(watch.scan_cost.quick_walk(watch.scan_cost.heap_blocks(), HOOK_BUDGET_MS / 1000))
            started = time.perf_counter()
            try:
                callback(*args)
            finally:
                spent[0] += time.perf_counter() - started
        return run

    for event, callback in watch.callbacks().items():
        shell.events.unregister(event, callback)
        shell.events.register(event, timed(event, callback))
    seconds, name = [], None
    for cell in range(cells):
        spent[0] = 0.0
        shell.run_cell(f"_hook_cell_{cell} = torch.ones(8 << 20)")  # 32 MiB: over the cpu change threshold
        seconds.append(spent[0])
        widget = watch.latest
        name = spot_name(widget.report.snapshot) if widget is not None else None
        del widget
    shell.run_line_magic("unload_ext", "oom_magic")
    walk = walks[-1] if walks else None
    return statistics.median(seconds[-3:]), name, None if walk is None else walk * 1000


def _memlab() -> int:
    from pytorch_memlab import MemReporter

    reporter = MemReporter()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        reporter.report()
    return sum(len(stats) for stats in reporter.device_tensor_stat.values())


def run(plan: tuple[tuple[str, int], ...] = PLAN, log: Callable[[str], None] = print,
        timeout: float = 240, first_samples: int = FIRST_SAMPLES) -> dict[str, Any]:
    """Every heap of ``plan``, each in its own process; a row per heap (or its error). The first scan,
    one sample per process, is the median over ``first_samples`` processes (the others time only it)."""
    rows = []
    for shape, tensors in plan:
        started = time.perf_counter()
        row = _in_fresh_process("measure", shape, tensors, timeout)
        if "error" not in row and first_samples > 1:
            more = [_in_fresh_process("measure_first", shape, tensors, timeout) for _ in range(first_samples - 1)]
            failed = next((m["error"] for m in more if "error" in m), None)
            if failed is not None:
                row = {"shape": shape, "tensors": tensors, "error": failed}
            else:
                samples = [row["x_floor"]["cold"]] + [m["cold_x"] for m in more]
                row["first_samples_x"] = samples
                row["x_floor"]["cold"] = statistics.median(samples)
                row["first_names_ok"] = all(m["cold_name"] == m["spot"] for m in more)
        rows.append(row)
        log(f"  {shape} / {tensors:,} tensors: " + (row.get("error") or _summary(row))
            + f" ({time.perf_counter() - started:.0f} s)")
    return {"rows": rows}


def _in_fresh_process(function: str, shape: str, tensors: int, timeout: float) -> dict[str, Any]:
    """``bench_shapes.<function>(shape, tensors)`` in a fresh interpreter: its result, or its error."""
    code = (f"import json, sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]\n"
            f"import bench_shapes\nprint('ROW ' + json.dumps(bench_shapes.{function}({shape!r}, {tensors})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"shape": shape, "tensors": tensors, "error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {"shape": shape, "tensors": tensors, "error": tail[0]}
    return json.loads(line[4:])


def _named(row: dict[str, Any]) -> bool:
    """Whether every scan of the row named the spot-checked tensor as the user would type it."""
    return row["cold_name"] == row["spot"] == row["steady_name"] and row.get("first_names_ok", True)


def _summary(row: dict[str, Any]) -> str:
    x = row["x_floor"]
    ok = "names ok" if _named(row) else (
        f"names: want {row['spot']}, cold {row['cold_name']}, steady {row['steady_name']}")
    memlab = f", memlab {x['memlab']:.1f}x" if "memlab" in x else ""
    return (f"floor {row['floor_ms']:.0f} ms, steady {x['steady']:.1f}x, cold {x['cold']:.1f}x, "
            f"naive {x['naive']:.1f}x{memlab}, hook {row['hook_ms']:.0f} ms; {ok}")


def markdown(result: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for these heaps."""
    header = ["heap shape", "tensors", "gc objects", "floor", "steady × floor", "cold × floor", "naive × floor",
              "memlab × floor", "hook (after a cell)", "spot-checked name (cold / steady)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result.get("rows", []):
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['tensors']:,} | | | | | | | | error: {row['error']} |")
            continue
        x = row["x_floor"]
        named = "✓" if _named(row) else \
            f"✗ want `{row['spot']}`: `{row['cold_name']}` / `{row['steady_name']}`"
        lines.append(f"| {row['shape']} | {row['tensors']:,} | {row['objects']:,} | {row['floor_ms']:.0f} ms | "
                     f"{x['steady']:.1f}× | {x['cold']:.1f}× | {x['naive']:.1f}× | "
                     f"{(format(x['memlab'], '.1f') + '×') if 'memlab' in x else 'n/a'} | {row['hook_ms']:.0f} ms | "
                     f"{named} `{row['spot']}` |")
    return lines


# Issue 24's goals, as (steady, first) ratios to the floor: every shape at 1k tensors, 100k apart;
# the linked list's goal is one figure for a scan.
GOALS = {1_000: (5.0, 10.0), 100_000: (15.0, 40.0)}
SHAPE_GOALS = {"linked_list": (10.0, 10.0)}
HOOK_BUDGET_MS = 50  # OomMagics.hook_budget_ms's default: the after-cell hook's scan and widget


def _walk(row: dict[str, Any]) -> str:
    walk = row.get("hook_walk_ms")
    return "full scan" if walk is None else f"walk {walk:.0f} ms"


def _spread(row: dict[str, Any]) -> str:
    samples = row.get("first_samples_x")
    return f" ({min(samples):.1f}–{max(samples):.1f})" if samples else ""


def _goal(row: dict[str, Any]) -> tuple[float, float]:
    return SHAPE_GOALS.get(row["shape"], GOALS.get(row["tensors"], GOALS[1_000]))


def shapes_markdown(result: dict[str, Any], machine: str = "") -> str:
    """benchmarks/SHAPES.md: a row per heap shape, measured in one run, ratios to the floor, goals met or not."""
    header = ["heap shape", "tensors", "gc objects", "floor", "steady × floor", "first × floor", "goal (steady / first)",
              "met", "memlab × floor", "naive × floor", "hook (walk)", "name (first / steady)"]
    lines = ["# The heap engine on every heap shape", "",
             "Written by `make bench` (`benchmarks/run.py`, or `python benchmarks/bench_shapes.py --write`): one",
             "process per heap, every contender timed side by side in it, so the ratios (not the seconds) are",
             "what compares. The floor is `gc.get_objects()`; *first* is the first `snapshot()` of the process",
             f"(a walk, nothing remembered): one sample a process, so the median of {FIRST_SAMPLES} fresh processes'",
             "ratios (their range in brackets); *steady* the best of the later ones with the data unchanged;",
             "memlab is pytorch_memlab's `MemReporter().report()`, imported before the heap is built so that",
             "every contender sees one heap of the stated size. The hook is the after-cell hook on a cell that",
             "changed memory, its two callbacks in a real IPython shell: reading the device, the scan it plans",
             f"within {HOOK_BUDGET_MS} ms (`hook_budget_ms`; the quick view's walk in brackets), naming and the",
             "widget; the median of the last three of five cells.", ""]
    if machine:
        lines += [machine, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result.get("rows", []):
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['tensors']:,} | " + " | " * 9 + f"error: {row['error']} |")
            continue
        x = row["x_floor"]
        steady_goal, first_goal = _goal(row)
        met = "✓" if x["steady"] <= steady_goal and x["cold"] <= first_goal else (
            "steady ✓, first ✗" if x["steady"] <= steady_goal else "✗")
        named = "✓" if _named(row) else f"✗ `{row['cold_name']}` / `{row['steady_name']}`"
        memlab = (format(x["memlab"], ".1f") + "×") if "memlab" in x else "n/a"
        lines.append(f"| {row['shape']} | {row['tensors']:,} | {row['objects']:,} | {row['floor_ms']:.0f} ms | "
                     f"{x['steady']:.1f}× | {x['cold']:.1f}×{_spread(row)} | "
                     f"≤ {steady_goal:g}× / ≤ {first_goal:g}× | {met} | "
                     f"{memlab} | {x['naive']:.1f}× | {row['hook_ms']:.0f} ms ({_walk(row)}) | {named} `{row['spot']}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--write"]
    if args:
        plan = tuple((a.split(":")[0], int(a.split(":")[1]) if ":" in a else 1_000) for a in args)
    else:
        plan = PLAN
    result = run(plan)
    print("\n".join(markdown(result)))
    if "--write" in sys.argv:
        (HERE / "SHAPES.md").write_text(shapes_markdown(result))
