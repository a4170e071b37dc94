"""Benchmark the bytes given back on the stale-memory traps: ``%freeall`` against the tutorial's Fix 1.

Fix 1 is ``gc.collect(); torch.cuda.empty_cache()``; on cpu that is ``gc.collect()``. Each method
gets a fresh set of traps, built as cells in a real IPython shell:

stale (should be given back):
- output cache: a tensor shown as a cell's value (``Out[N]``, ``_N``, ``_``), then deleted;
- traceback: a function's large local, kept by the exception IPython stored (``sys.last_*``);
- cycle: a tensor in an unreachable reference cycle (automatic gc paused, as between collections);
user-held (must stay):
- alias: ``model2 = model; del model``; optimizer state after ``del model``; activations a
  forward hook appended to a list; an exception the user kept in a variable; a plain variable.

Bytes are counted exactly, with weak references to every trap tensor (the benchmark keeps no
strong one); the process's resident set before and after is reported beside them.

Run: ``python benchmarks/bench_cleanup.py``; the bench runner calls ``run()``.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
REFS_MODULE = "_oom_bench_refs"
METHODS = ("gc.collect()", "%freeall --device cpu")

# (name, holder kind, must stay, cells). Every cell registers its tensors' weakrefs in REFS[name].
TRAPS: tuple[tuple[str, str, bool, tuple[str, ...]], ...] = (
    ("output cache (Out[N], _N, _)", "stale", False, (
        "x = torch.ones(16 * MiB // 4)",
        "x",
        "refs.REFS['output cache (Out[N], _N, _)'] = [weakref.ref(x)]; del x",
    )),
    ("traceback (a failed function's local)", "stale", False, (
        "def load():\n"
        "    weights = torch.zeros(32 * MiB // 4)\n"
        "    refs.REFS['traceback (a failed function\\'s local)'] = [weakref.ref(weights)]\n"
        "    raise RuntimeError('load failed')\n"
        "load()",
    )),
    ("reference cycle", "stale", False, (
        "class Node: pass\n"
        "a, b = Node(), Node()\n"
        "a.peer, b.peer = b, a\n"
        "a.hidden = torch.zeros(8 * MiB // 4)\n"
        "refs.REFS['reference cycle'] = [weakref.ref(a.hidden)]\n"
        "del a, b",
    )),
    ("alias (model2 = model; del model)", "user", True, (
        "model = torch.nn.Linear(1024, 2048); model2 = model\n"
        "refs.REFS['alias (model2 = model; del model)'] = [weakref.ref(model.weight), weakref.ref(model.bias)]\n"
        "del model",
    )),
    ("optimizer state after del model", "user", True, (
        "net = torch.nn.Linear(1024, 1024)\n"
        "opt = torch.optim.Adam(net.parameters())\n"
        "net(torch.ones(4, 1024)).sum().backward(); opt.step()\n"
        "refs.REFS['optimizer state after del model'] = [weakref.ref(t) for s in opt.state.values() for t in s.values()]"
        " + [weakref.ref(p) for p in net.parameters()]\n"
        "del net",
    )),
    ("forward-hook activations in a list", "user", True, (
        "probe = torch.nn.Linear(256, 4096)\n"
        "acts = []\n"
        "handle = probe.register_forward_hook(lambda mod, inp, out: acts.append(out.detach()))\n"
        "with torch.no_grad():\n"
        "    probe(torch.ones(256, 256))\n"
        "refs.REFS['forward-hook activations in a list'] = [weakref.ref(acts[0])]",
    )),
    ("exception kept in a variable", "user", True, (
        "def fail():\n"
        "    buffer = torch.zeros(4 * MiB // 4)\n"
        "    refs.REFS['exception kept in a variable'] = [weakref.ref(buffer)]\n"
        "    raise ValueError('kept')\n"
        "try:\n"
        "    fail()\n"
        "except ValueError as exc:\n"
        "    err = exc",
    )),
    ("plain variable", "user", True, (
        "keep = torch.ones(4 * MiB // 4)\n"
        "refs.REFS['plain variable'] = [weakref.ref(keep)]",
    )),
)


def _shell() -> Any:
    from IPython.testing.globalipapp import start_ipython

    return start_ipython()


def _reset(ip: Any) -> None:
    """A fresh namespace and history, as after a kernel restart (the test suite's fixture does the same)."""
    ip.run_line_magic("reset", "-f")
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, attr):
            delattr(sys, attr)
    ip.last_execution_result = None
    gc.collect()


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _set_traps(ip: Any, refs: types.ModuleType) -> None:
    refs.REFS.clear()
    ip.run_cell(f"import gc, sys, weakref, torch; import {REFS_MODULE} as refs; MiB = {MiB}", store_history=True)
    for _name, _kind, _stays, cells in TRAPS:
        for cell in cells:
            ip.run_cell(cell, store_history=True)


def _alive_bytes(refs: types.ModuleType) -> dict[str, int]:
    alive: dict[str, int] = {}
    for name, weak in refs.REFS.items():
        seen: set[int] = set()
        total = 0
        for ref in weak:
            tensor = ref()
            if tensor is not None and tensor.untyped_storage()._cdata not in seen:
                seen.add(tensor.untyped_storage()._cdata)
                total += tensor.untyped_storage().nbytes()
            del tensor
        alive[name] = total
    return alive


def _one_method(ip: Any, refs: types.ModuleType, method: str) -> dict[str, Any]:
    _reset(ip)
    gc.disable()  # the cycle must still be there when the method runs, for both methods alike
    try:
        _set_traps(ip, refs)
        before = _alive_bytes(refs)
        missing = [name for name, *_ in TRAPS if name not in before or before[name] == 0]
        if missing:
            raise RuntimeError(f"trap setup failed for {missing}")
        rss_before = _rss()
        started = time.perf_counter()
        report = None
        if method == "gc.collect()":
            gc.collect()
        else:
            report = ip.run_line_magic("freeall", "--device cpu")
        seconds = time.perf_counter() - started
        after = _alive_bytes(refs)
        rss_after = _rss()
    finally:
        gc.enable()
    return {
        "method": method,
        "seconds": round(seconds, 4),
        "before": before,
        "after": after,
        "rss_given_back": rss_before - rss_after,
        "report_freed_bytes": getattr(report, "freed_bytes", None),
    }


def measure(method: str) -> dict[str, Any]:
    """One method on fresh traps in this process's IPython shell."""
    refs = types.ModuleType(REFS_MODULE)
    refs.REFS = {}
    sys.modules[REFS_MODULE] = refs
    ip = _shell()
    ip.run_line_magic("load_ext", "oom_magic")
    return _one_method(ip, refs, method)


def run(methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """Each method on fresh traps in its own process (a failed cell leaves references behind that a
    later method would find); bytes given back per trap, totals, and the share of stale bytes."""
    import subprocess
    import tempfile

    results = []
    for method in methods:
        with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
            path = Path(out.name)
        try:
            proc = subprocess.run([sys.executable, "-W", "ignore", str(Path(__file__).resolve()), "--method", method,
                                   "--json", str(path)], capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{method}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
            results.append(json.loads(path.read_text()))
        finally:
            path.unlink(missing_ok=True)
    rows = []
    for name, kind, stays, _cells in TRAPS:
        row: dict[str, Any] = {"trap": name, "kind": kind, "must_stay": stays, "bytes": results[0]["before"][name]}
        for m in results:
            row[m["method"]] = m["before"][name] - m["after"][name]
        rows.append(row)
    totals: dict[str, Any] = {}
    for m in results:
        stale = sum(r["bytes"] for r in rows if not r["must_stay"])
        freed_stale = sum(r[m["method"]] for r in rows if not r["must_stay"])
        freed_user = sum(r[m["method"]] for r in rows if r["must_stay"])
        totals[m["method"]] = {
            "stale_bytes": stale, "stale_given_back": freed_stale,
            "stale_share": round(freed_stale / stale, 4) if stale else None,
            "user_bytes_freed": freed_user, "seconds": m["seconds"],
            "rss_given_back": m["rss_given_back"], "report_freed_bytes": m["report_freed_bytes"],
        }
    return {"traps": rows, "totals": totals}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, help="measure one method in this process")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(args.method) if args.method else run()
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
