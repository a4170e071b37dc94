"""Check 6 — the stale-memory traps with CUDA tensors: %freeall gives stale memory back to the
allocator and leaves user-held memory where it is.

The six traps of tests/heap/test_stale_traps.py, with CUDA tensors of tens of MiB. Ground truth:
``torch.cuda.memory_allocated()`` before the trap (the baseline), a weak reference to the
stale tensor, and the user's values compared with copies taken before %freeall. Tolerance for
"back to baseline": 1 MiB (allocator block rounding); every trap's memory is 32 MiB or more, so
it cannot hide a leak.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.gpu.support import MiB, settle

ITEM = 6
pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Trap:
    name: str
    cells: tuple[str, ...]
    kind: str  # the holder kind %gpumem must report: output-cache | traceback | garbage | user
    size: int  # bytes the trap holds
    freed: bool  # stale (given back) or user-held (stays)
    holder: str | None = None  # user traps: the path whose bytes %gpumem must report
    intact: str | None = None  # user traps: an expression that must stay True after %freeall
    exact: bool = True  # False: ``size`` is a lower bound (the optimizer also reaches the gradients)


TRAPS = [
    Trap("output cache after del", (
        "x = torch.ones(4096, 4096, device='cuda')",  # 64 MiB
        "x",
        "w = weakref.ref(x); del x"), "output-cache", 64 * MiB, True),
    Trap("failed function's local in the traceback", (
        "def load():\n"
        "    global w\n"
        "    weights = torch.zeros(8192, 4096, device='cuda')\n"  # 128 MiB
        "    w = weakref.ref(weights)\n"
        "    raise RuntimeError('load failed')\n"
        "load()",), "traceback", 128 * MiB, True),
    Trap("reference cycle", (
        "gc.disable()\n"
        "class Node: pass\n"
        "a, b = Node(), Node()\n"
        "a.peer, b.peer = b, a\n"
        "a.t = torch.zeros(2048, 4096, device='cuda')\n"  # 32 MiB
        "w = weakref.ref(a.t)\n"
        "del a, b",), "garbage", 32 * MiB, True),
    Trap("alias keeps the model alive", (
        "model = torch.nn.Linear(4096, 4096, device='cuda'); m2 = model\n"
        "before = m2.weight.detach().clone(); del model",),
        "user", (4096 * 4096 + 4096) * 4, False, holder="m2",
        intact="bool(torch.equal(m2.weight, before)) and 'model' not in dir()"),
    Trap("optimizer state after del model", (
        "model = torch.nn.Linear(2048, 2048, device='cuda')\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.ones(4, 2048, device='cuda')).sum().backward(); opt.step()\n"
        "state_before = opt.state[model.weight]['exp_avg'].clone()\n"
        "del model",), "user", 3 * (2048 * 2048 + 2048) * 4, False, holder="opt",
        intact="bool(torch.equal(opt.state[opt.param_groups[0]['params'][0]]['exp_avg'], state_before))",
        exact=False),
    Trap("forward-hook activations", (
        "model = torch.nn.Linear(128, 8192, device='cuda')\n"
        "acts = []\n"
        "handle = model.register_forward_hook(lambda mod, inp, out: acts.append(out.detach()))\n"
        "with torch.no_grad():\n"
        "    model(torch.ones(1024, 128, device='cuda'))\n"
        "w = weakref.ref(acts[0])",), "user", 1024 * 8192 * 4, False, holder="acts[0]",
        intact="w() is not None and acts[0].shape == (1024, 8192)"),
]


@pytest.mark.parametrize("trap", TRAPS, ids=[t.name.replace(" ", "-") for t in TRAPS])
def test_trap_on_cuda(gpu_ip, cuda, checks, trap):
    torch = cuda
    settle(torch)
    baseline = torch.cuda.memory_allocated(0)
    try:
        for source in trap.cells:
            gpu_ip.run_cell(source, store_history=True)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(0) - baseline
        snap = gpu_ip.run_line_magic("gpumem", "-o --device cuda:0 --all")
        label = f"[{trap.name}]"
        if trap.freed:
            checks.equal(f"{label} %gpumem: {trap.kind} bytes", trap.size, snap.kind_bytes(trap.kind))
            checks.equal(f"{label} %gpumem: stale bytes", trap.size, snap.stale_bytes)
        elif trap.exact:
            checks.equal(f"{label} %gpumem: bytes held by `{trap.holder}`", trap.size, snap.held_by(trap.holder))
        else:
            checks.at_least(f"{label} %gpumem: bytes held by `{trap.holder}` (weights, exp_avg, exp_avg_sq)",
                            trap.size, snap.held_by(trap.holder))
        before_free = torch.cuda.memory_allocated(0)
        report = gpu_ip.run_line_magic("freeall", "--device cuda:0")
        after = torch.cuda.memory_allocated(0)
        if trap.freed:
            checks.equal(f"{label} %freeall gave back the {trap.kind} bytes", trap.size, report.kind_bytes(trap.kind))
            checks.equal(f"{label} memory_allocated() back to its baseline", baseline, after, tol=MiB,
                         note=f"the trap held {held} bytes")
            checks.true(f"{label} the stale tensor is gone (weakref dead)", gpu_ip.user_ns["w"]() is None)
            checks.equal(f"{label} the report's after-reading == memory_allocated()", after, report.after.allocated)
        else:
            checks.equal(f"{label} %freeall freed nothing", 0, report.freed_bytes)
            checks.equal(f"{label} memory_allocated() unchanged: user-held memory stays", before_free, after)
            value = gpu_ip.run_cell(trap.intact).result
            checks.true(f"{label} the user's values are intact", value)
    finally:
        gpu_ip.run_cell("gc.enable()")
    checks.verify()
