"""The stale-memory traps, run as cells in a real IPython shell: stale memory is freed, user memory stays."""
from __future__ import annotations

import gc

import pytest
from IPython.core.error import UsageError

MiB = 1 << 20


def run(ip, src: str):
    result = ip.run_cell(src, store_history=True)
    return result


def ok(ip, src: str):
    result = run(ip, src)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    return result.result


@pytest.fixture
def shell(fresh_heap, ip):
    """The shell with torch imported, and a heap of its own: what earlier test modules left alive is
    frozen out of the collector's view (conftest's fresh_heap, set up before the shell and undone
    after its reset), so each scan and each collection here walks this test's objects only, as in
    a fresh kernel (in a long run they walked every module's leftovers: ~29 s for one test)."""
    ok(ip, "import gc, sys, weakref, torch")
    yield ip
    gc.enable()


def freeall(ip, line: str = "--device cpu"):
    return ip.run_line_magic("freeall", line)


def gpumem(ip, line: str = "--device cpu --all"):
    return ip.run_line_magic("gpumem", f"-o {line}")


def test_trap1_output_cache_after_del(shell):
    ok(shell, "x = torch.ones(1024, 1024)")
    ok(shell, "x")  # shown as the cell's last expression: Out[N] holds it
    ok(shell, "w = weakref.ref(x); del x")
    snap = gpumem(shell)
    groups = snap.holders("output-cache")
    assert groups and groups[0].bytes == 4 * MiB
    assert snap.stale_bytes == 4 * MiB and snap.kind_bytes("output-cache") == 4 * MiB
    report = freeall(shell)
    assert report.kind_bytes("output-cache") == 4 * MiB
    assert shell.user_ns["w"]() is None
    assert gpumem(shell).stale_bytes == 0


def test_trap2_failed_function_local_in_traceback(shell):
    run(shell, """
def load():
    global w
    weights = torch.zeros(2048, 1024)
    w = weakref.ref(weights)
    raise RuntimeError("load failed")
load()
""")
    assert shell.user_ns["w"]() is not None
    snap = gpumem(shell)
    traceback_groups = snap.holders("traceback")
    assert [g.bytes for g in traceback_groups] == [8 * MiB]
    assert "frame load → local weights" in traceback_groups[0].path
    report = freeall(shell)
    assert report.kind_bytes("traceback") == 8 * MiB
    assert any("%debug" in n for n in report.notes)
    assert shell.user_ns["w"]() is None


def test_an_exception_shown_and_raised_again_is_freed_in_one_freeall(shell):
    """Both the output cache (the exception shown as a cell's value) and the stored traceback (raised
    again) reach the failed function's local; the first holder found is the output cache. One
    %freeall gives back both the shown tensor and the local (found by a hypothesis run)."""
    run(shell, """
def fail():
    local_tensor = torch.full((1024, 1024), 7.0)
    global w
    w = weakref.ref(local_tensor)
    raise ValueError("failed with a local tensor")
try:
    fail()
except Exception as caught:
    e = caught
""")
    ok(shell, "torch.ones(256, 1024)")  # Out[N]: 1 MiB
    ok(shell, "e")  # the exception shown: the output cache reaches the local through it
    run(shell, "raise e")  # and the stored traceback too
    ok(shell, "del e")
    assert gpumem(shell).stale_bytes == 5 * MiB
    report = freeall(shell)
    assert report.freed_bytes == 5 * MiB
    assert report.kind_bytes("output-cache") == 1 * MiB and report.kind_bytes("traceback") == 4 * MiB
    assert any("%debug" in n for n in report.notes)
    assert shell.user_ns["w"]() is None
    assert freeall(shell).freed_bytes == 0 and gpumem(shell).stale_bytes == 0


def test_trap3_reference_cycle(shell):
    ok(shell, """
gc.disable()
class Node: pass
a, b = Node(), Node()
a.peer, b.peer = b, a
a.t = torch.zeros(512, 1024)
w = weakref.ref(a.t)
del a, b
""")
    snap = gpumem(shell)
    assert snap.kind_bytes("garbage") == 2 * MiB
    assert shell.user_ns["w"]() is not None  # the snapshot itself freed nothing
    report = freeall(shell)
    assert report.kind_bytes("garbage") == 2 * MiB
    assert shell.user_ns["w"]() is None


def test_trap4_alias_keeps_model_alive(shell):
    ok(shell, "model = torch.nn.Linear(256, 1024); m2 = model; before = m2.weight.clone(); del model")
    report = freeall(shell)
    assert report.freed_bytes == 0
    assert "m2" in shell.user_ns and "model" not in shell.user_ns
    assert ok(shell, "bool(torch.equal(m2.weight, before))") is True
    snap = gpumem(shell)
    assert snap.held_by("m2") == (256 * 1024 + 1024) * 4
    assert {g.path for g in snap.holders("user")} >= {"m2.weight", "m2.bias"}


def test_trap5_optimizer_state_after_del_model(shell):
    ok(shell, """
model = torch.nn.Linear(256, 512)
opt = torch.optim.Adam(model.parameters())
model(torch.ones(4, 256)).sum().backward(); opt.step()
exp_avg = weakref.ref(opt.state[model.weight]['exp_avg'])
state_before = opt.state[model.weight]['exp_avg'].clone()
del model
""")
    freeall(shell)
    assert shell.user_ns["exp_avg"]() is not None
    assert ok(shell, "bool(torch.equal(opt.state[opt.param_groups[0]['params'][0]]['exp_avg'], state_before))")
    snap = gpumem(shell)
    paths = {g.path for g in snap.holders("user")}
    assert any(p.startswith("opt.state[") and p.endswith("['exp_avg']") for p in paths), paths
    assert snap.kind_bytes("user") >= 3 * (256 * 512 * 4)  # weights, exp_avg, exp_avg_sq


def test_trap6_forward_hook_activations(shell):
    ok(shell, """
model = torch.nn.Linear(128, 2048)
acts = []
handle = model.register_forward_hook(lambda mod, inp, out: acts.append(out.detach()))
with torch.no_grad():
    model(torch.ones(64, 128))
w = weakref.ref(acts[0])
""")
    freeall(shell)
    assert shell.user_ns["w"]() is not None
    snap = gpumem(shell)
    assert snap.held_by("acts[0]") == 64 * 2048 * 4
    assert ("acts[0]", "user") in {(g.path, g.kind) for g in snap.holders()}


def test_named_delete_reports_what_still_holds(shell):
    ok(shell, "import torch; model = torch.nn.Linear(512, 1024); model2 = model; solo = torch.ones(256, 1024)")
    report = freeall(shell, "model solo --device cpu")
    assert report.deleted == ("model", "solo")
    assert "model" not in shell.user_ns and "solo" not in shell.user_ns and "model2" in shell.user_ns
    assert report.freed_bytes == 1 * MiB  # solo only: the model lives on in model2
    [held] = report.still_held
    assert held.name == "model" and held.bytes == (512 * 1024 + 1024) * 4
    assert held.holders == ("model2",)
    assert held.sentence().startswith("`model` deleted; its 2.00 MiB are still held by `model2`")


def test_named_delete_drops_output_cache_references(shell):
    ok(shell, "big = torch.ones(1024, 1024)")
    ok(shell, "big")
    ok(shell, "w = weakref.ref(big)")
    report = freeall(shell, "big --device cpu")
    assert report.freed_bytes == 4 * MiB and shell.user_ns["w"]() is None


def test_dry_run_changes_nothing(shell):
    ok(shell, "x = torch.ones(1024, 256)")
    ok(shell, "x")
    ok(shell, "w = weakref.ref(x); del x; keep = torch.ones(10)")
    names = set(shell.user_ns)
    report = freeall(shell, "keep --dry-run --device cpu")
    assert report.dry_run and report.freed_bytes == 1 * MiB + 40
    assert report.kind_bytes("output-cache") == 1 * MiB and report.kind_bytes("user") == 40
    assert set(shell.user_ns) == names and shell.user_ns["w"]() is not None


def test_unknown_name_is_usage_error_and_deletes_nothing(shell):
    ok(shell, "a = torch.ones(4); b = 2")
    with pytest.raises(UsageError, match="no variable named 'nope'.*nothing was deleted"):
        freeall(shell, "a nope --device cpu")
    assert "a" in shell.user_ns


def test_user_held_exception_is_user_memory(shell):
    ok(shell, """
def load():
    weights = torch.zeros(256, 1024)
    raise RuntimeError("x")
try:
    load()
except RuntimeError as e:
    err = e
""")
    snap = gpumem(shell)
    paths = [g.path for g in snap.holders("user")]
    assert "err → frame load → local weights" in paths
    freeall(shell)
    assert ok(shell, "err.__traceback__.tb_next.tb_frame.f_locals['weights'].shape") == (256, 1024)


def test_a_variable_holding_the_shell_does_not_make_outputs_user_held(shell):
    ok(shell, "ip = get_ipython()\nx = torch.ones(1024, 1024)")
    ok(shell, "x")
    ok(shell, "w = weakref.ref(x); del x")
    snap = gpumem(shell)
    assert snap.kind_bytes("output-cache") == 4 * MiB and snap.user_bytes == 0
    assert freeall(shell).kind_bytes("output-cache") == 4 * MiB
    assert shell.user_ns["w"]() is None
