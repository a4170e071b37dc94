"""Benchmark ``oom_magic.snapshot(device="cpu")`` against the floor and the scans users reach for instead.

Contenders, timed on the same heap in the same process, round-robin, best of N, automatic gc off
(the same for all; our garbage test never collects):

- floor: bare ``gc.get_objects()``, what any gc-based scan pays first;
- naive: ``[o for o in gc.get_objects() if torch.is_tensor(o)]``, the forum snippet;
- memlab: pytorch_memlab's ``MemReporter().report()``, its printed table sent to /dev/null;
- ours: ``oom_magic.snapshot(device="cpu")``: device reading, heap pass, grouping into storages,
  holder walk from the user namespace (``__main__``), garbage test, records;
- ours, before: the same call with ``tracker.py``/``holders.py`` from the commit before the
  optimisation (only when the runner passes ``--before DIR``);
- and our pieces alone: the device reading, the heap pass (``find_tensors``) and the holder walk.

Each heap is built in a fresh process (benchmarks/heaps.py), so heaps never share an interpreter.

Run one heap: ``python benchmarks/bench_scan.py 800k 1000 [--garbage young|old] [--library-tensor]``;
the bench runner calls ``run()``, which runs every heap and returns one dict.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# (heap label, tensors, repetitions): best of N; fewer at 3M objects to stay inside make bench's 10 minutes.
DEFAULT_PLAN: tuple[tuple[str, int, int], ...] = (
    ("200k", 1_000, 5), ("200k", 100_000, 3),
    ("800k", 1_000, 5), ("800k", 100_000, 2),
    ("3M", 1_000, 2), ("3M", 100_000, 2),
)
# Variants at 800k objects / 1,000 tensors: stale memory in a cycle, and a tensor a library holds.
VARIANTS: tuple[tuple[str, int, int, dict[str, Any]], ...] = (
    ("800k", 1_000, 2, {"garbage": "young"}),
    ("800k", 1_000, 2, {"garbage": "old"}),
    ("800k", 1_000, 2, {"library_tensor": True}),
)


def _best(fn: Callable[[], Any], results: list[float]) -> Any:
    started = time.perf_counter()
    value = fn()
    results.append(time.perf_counter() - started)
    return value


def _memlab_report() -> int:
    from pytorch_memlab import MemReporter

    reporter = MemReporter()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        reporter.report()
    return sum(len(stats) for stats in reporter.device_tensor_stat.values())


def measure_heap(label: str, tensors: int, repeat: int, *, garbage: str | None = None,
                 library_tensor: bool = False, before: str | None = None, parts: bool = True) -> dict[str, Any]:
    """Build one heap in this process and time every contender on it (call in a fresh process)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    import warnings

    warnings.simplefilter("ignore")  # pynvml's deprecation notice, transformers' init notes
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from heaps import LIBRARY_MODULE, build_heap

    # Every contender's imports first, so the heap's size is final before anything is timed.
    memlab_error = None
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            import pytorch_memlab  # noqa: F401  (prints a CUDA notice on import)
    except Exception as exc:  # not installed, or broken against this torch
        memlab_error = f"{type(exc).__name__}: {exc}"
    import oom_magic
    from oom_magic.device.reading import read_device
    from oom_magic.heap.holders import attribute
    from oom_magic.heap.roots import collect_roots
    from oom_magic.heap.tracker import find_tensors, tensor_types

    snapshot_before = None
    if before is not None:
        sys.path.insert(0, before)
        snapshot_before = importlib.import_module("oom_magic_before").snapshot
    gc.disable()
    namespace = sys.modules["__main__"].__dict__
    info = build_heap(label, tensors, namespace, garbage=garbage)
    import torch

    if library_tensor:
        # A library keeps a tensor in a module global (a RoPE cache, a constant table): 'other'.
        sys.modules[LIBRARY_MODULE].ROPE_CACHE = {"cos": torch.ones(512, 128)}
    contenders: dict[str, Callable[[], Any]] = {
        "floor": lambda: len(gc.get_objects()),
        "naive": lambda: len([o for o in gc.get_objects() if torch.is_tensor(o)]),
        "ours": lambda: oom_magic.snapshot(device="cpu"),
    }
    if memlab_error is None:
        try:
            _memlab_report()
            contenders["memlab"] = _memlab_report
        except Exception as exc:  # broken against this torch
            memlab_error = f"{type(exc).__name__}: {exc}"
    if snapshot_before is not None:
        contenders["ours_before"] = lambda: snapshot_before(device="cpu")

    def heap_pass() -> Any:
        live = find_tensors(torch, "cpu")
        live.release()

    def walk_only() -> Any:
        live = find_tensors(torch, "cpu")
        try:
            started = time.perf_counter()
            attribution = attribute(live, collect_roots(), torch, tensor_types(torch))
            walk_times.append(time.perf_counter() - started)
            return attribution.nodes_walked, attribution.complete
        finally:
            live.release()

    times: dict[str, list[float]] = {name: [] for name in contenders}
    times.update(device_read=[], heap_pass=[])
    walk_times: list[float] = []
    answers: dict[str, Any] = {}
    # pytorch_memlab leaves ~2 cyclic tuples per tensor behind each report; with automatic gc off they
    # would pile up and grow the heap under the next contender. Collect the youngest generation
    # after it, untimed (the heap itself sits in the oldest; a "young" garbage cycle must stay).
    tidy = (lambda: None) if garbage == "young" else (lambda: gc.collect(0))
    if repeat >= 3:
        for fn in contenders.values():  # warm: first-call imports and caches are not what we time
            fn()
            tidy()
    objects = len(gc.get_objects())
    for _ in range(repeat):
        for name, fn in contenders.items():
            answers[name] = _best(fn, times[name])
            tidy()
        if parts or "walk" not in answers:
            _best(lambda: read_device("cpu"), times["device_read"])
            _best(heap_pass, times["heap_pass"])
            answers["walk"] = walk_only()
    times["holder_walk"] = walk_times
    snap = answers["ours"]
    result: dict[str, Any] = {
        "heap": label, "tensors_target": tensors, "repeat": repeat,
        "garbage": garbage, "library_tensor": library_tensor,
        "objects": objects, "objects_built": info.objects, "tensors": info.tensors, "storages": info.storages,
        "model": info.model, "user_objects": info.user_objects, "library_objects": info.library_objects,
        "build_s": round(info.build_seconds, 2),
        "best_ms": {name: round(min(ts) * 1e3, 3) for name, ts in times.items() if ts},
        "all_ms": {name: [round(t * 1e3, 3) for t in ts] for name, ts in times.items()},
        "found": {
            "naive_tensors": answers["naive"],
            "memlab_tensors": answers.get("memlab"),
            "ours_storages": len(snap.storages),
            "ours_tracked_bytes": snap.tracked_bytes,
            "ours_bytes_by_kind": dict(snap.bytes_by_kind),
            "ours_heap_passed": snap.heap_passed,
            "ours_objects_walked": snap.objects_walked,
            "ours_attribution_complete": snap.attribution_complete,
            "ours_notes": list(snap.notes),
            "walk_nodes": answers["walk"][0],
        },
        "memlab_error": memlab_error,
    }
    if "ours_before" in answers:
        old = answers["ours_before"]
        result["found"]["before_same_holders"] = (
            sorted((r.key, r.holder_kind, r.holder_path) for r in old.storages)
            == sorted((r.key, r.holder_kind, r.holder_path) for r in snap.storages))
    return result


def _run_child(label: str, tensors: int, repeat: int, extra: dict[str, Any], before: str | None,
               timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        path = out.name
    cmd = [sys.executable, str(Path(__file__).resolve()), label, str(tensors), "--repeat", str(repeat),
           "--json", path]
    if extra.get("garbage"):
        cmd += ["--garbage", extra["garbage"]]
    if extra.get("library_tensor"):
        cmd.append("--library-tensor")
    if before:
        cmd += ["--before", before]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            return {"heap": label, "tensors_target": tensors, **extra,
                    "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
        result = json.loads(Path(path).read_text())
    except subprocess.TimeoutExpired:
        return {"heap": label, "tensors_target": tensors, **extra, "error": [f"timed out after {timeout:.0f} s"]}
    finally:
        Path(path).unlink(missing_ok=True)
    result["process_s"] = round(time.perf_counter() - started, 1)
    return result


def run(plan: tuple[tuple[str, int, int], ...] = DEFAULT_PLAN, variants=VARIANTS, before: str | None = None,
        timeout: float = 240.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every heap of the plan, then the variants, each in its own process; one dict for the runner."""
    heaps = []
    for label, tensors, repeat in plan:
        log(f"  scan: {label} objects / {tensors:,} tensors ...")
        heaps.append(_run_child(label, tensors, repeat, {}, before if label == "800k" else None, timeout))
    variant_results = []
    for label, tensors, repeat, extra in variants:
        log(f"  scan: {label} objects / {tensors:,} tensors, {extra} ...")
        variant_results.append(_run_child(label, tensors, repeat, extra, before, timeout))
    return {"heaps": heaps, "variants": variant_results}


def _summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"{result['heap']} / {result['tensors_target']}: ERROR {result['error']}"
    best = result["best_ms"]
    floor = best["floor"]
    parts = [f"{name} {ms:.1f} ms ({ms / floor:.2f}x)" for name, ms in best.items()]
    return (f"{result['objects']:,} objects, {result['tensors']:,} tensors: " + "; ".join(parts)
            + f"; walk {result['found']['walk_nodes']:,} nodes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heap", nargs="?", help="200k, 800k or 3M (omit to run the whole plan)")
    parser.add_argument("tensors", nargs="?", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--garbage", choices=("young", "old"))
    parser.add_argument("--library-tensor", action="store_true")
    parser.add_argument("--before", help="folder holding an oom_magic_before package to time as well")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.heap is None:
        result: dict[str, Any] = run(before=args.before)
        for item in result["heaps"] + result["variants"]:
            print(_summary(item))
    else:
        result = measure_heap(args.heap, args.tensors, args.repeat, garbage=args.garbage,
                              library_tensor=args.library_tensor, before=args.before)
        print(_summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
