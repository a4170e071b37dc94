"""Concurrency and lifetime: load/unload/reload without leaks, the button under pressure, two kernels.

A real IPython shell (the ``ip`` fixture), real ipywidgets models (no frontend: their state is
read directly), real torch CPU tensors and two real Jupyter kernels (jupyter_client). The one fake
is NVML (no GPU here): in the two-kernel test each kernel is given the same fake device listing
both kernels' real pids, so that each must tell itself from the other by pid.
"""
from __future__ import annotations

import gc
import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest

from oom_magic.notebook import watch as watch_module
from oom_magic.heap.snapshot import snapshot
from oom_magic.notebook.watch import CellReport
from oom_magic.notebook.widget import CellWatch, MemoryWidget

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("fresh_heap")


def cell_watch(ip) -> CellWatch:
    return ip.magics_manager.registry["OomMagics"].cell_watch


def widget_models() -> int:
    """How many ipywidgets models are alive (``ipywidgets.Widget.widgets``)."""
    from ipywidgets.widgets import widget

    return len(widget._instances)


def callback_counts(ip) -> dict[str, int]:
    return {event: len(callbacks) for event, callbacks in ip.events.callbacks.items()}


def run(ip, source: str) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ip.run_cell(source, store_history=True)
    assert not [w for w in caught if "oom-magic" in str(w.message)], [str(w.message) for w in caught]
    return result


# --------------------------------------------------------------------------- load / unload / reload


def test_load_unload_reload_100_times_leaks_no_callbacks_widgets_or_watchers(ip) -> None:
    run(ip, "import torch\nkept = torch.ones(1000)")
    report = CellReport(None, snapshot("cpu"))  # one real report, shown by every cycle's widgets
    ip.run_line_magic("unload_ext", "oom_magic")
    gc.collect()
    callbacks, models = callback_counts(ip), widget_models()
    watchers: list[weakref.ref] = []
    widgets: list[weakref.ref] = []
    for cycle in range(100):
        ip.run_line_magic("load_ext", "oom_magic")
        if cycle % 10 == 9:
            ip.run_line_magic("reload_ext", "oom_magic")
        if cycle % 3 == 0:
            ip.run_line_magic("load_ext", "oom_magic")  # loading twice is harmless
        current = cell_watch(ip)
        watchers.append(weakref.ref(current))
        shown = current.show(report)
        assert shown is not None
        widgets.append(weakref.ref(shown))
        if cycle % 20 == 0:
            current.pin()
        assert run(ip, "x = 1").success
        assert callback_counts(ip)["post_run_cell"] == callbacks["post_run_cell"] + 1
        ip.run_line_magic("unload_ext", "oom_magic")
        assert callback_counts(ip) == callbacks
        assert widget_models() == models, f"cycle {cycle}: {widget_models() - models} models left open"
        assert watch_module._active is None
        assert all(w().closed for w in widgets if w() is not None)  # every widget it showed is closed
    assert "gpumem" not in ip.magics_manager.magics["line"]
    ip.run_line_magic("load_ext", "oom_magic")  # the fixture unloads it again
    assert ip.user_ns["kept"].sum().item() == 1000


def test_nothing_outlives_its_unload(ip) -> None:
    """Finding 9 (fixed in _extension.py): Magics.__init__ appends to shell.configurables, and unload left it
    there, so every unload and %reload_ext kept a CellWatch, its Watcher and its history alive."""
    run(ip, "import torch")
    ip.run_line_magic("unload_ext", "oom_magic")
    configurables = len(ip.configurables)
    watchers: list[weakref.ref] = []
    for _ in range(5):
        ip.run_line_magic("load_ext", "oom_magic")
        watchers.append(weakref.ref(cell_watch(ip)))
        run(ip, "x = 1")
        ip.run_line_magic("reload_ext", "oom_magic")
        watchers.append(weakref.ref(cell_watch(ip)))
        ip.run_line_magic("unload_ext", "oom_magic")
    gc.collect()
    ip.run_line_magic("load_ext", "oom_magic")  # the fixture unloads it again
    assert [w for w in watchers if w() is not None] == []
    assert len(ip.configurables) == configurables + 1


# --------------------------------------------------------------------------- the button


@pytest.fixture
def stale_widget(ip) -> MemoryWidget:
    """A live widget under a cell whose result left 64 MiB in the output cache."""
    ip.run_line_magic("gpumem", "-o --auto always")
    run(ip, "import torch\nkept = torch.ones(1000)")
    run(ip, "torch.ones(16 << 20) * 2")
    widget = cell_watch(ip).live[-1]
    assert widget.report.snapshot.stale_bytes == 64 << 20
    return widget


def test_the_button_clicked_twice_in_a_row(ip, stale_widget: MemoryWidget) -> None:
    kept = ip.user_ns["kept"]
    stale_widget.button.click()
    first = stale_widget.report.freed
    stale_widget.button.click()
    second = stale_widget.report.freed
    assert first is not None and first.freed_bytes == 64 << 20
    assert second is not None and second is not first and second.freed_bytes == 0
    assert not stale_widget.button.disabled and stale_widget.status.value.startswith("freed 0 B")
    assert stale_widget.button.layout.display == "none"  # nothing stale left: no button
    assert ip.user_ns["kept"] is kept and kept.sum().item() == 1000


def test_a_click_while_the_button_is_busy_is_ignored(ip, stale_widget: MemoryWidget) -> None:
    real, calls = stale_widget._free, []

    def free_and_click_again(device: str) -> Any:
        """The user clicks again while the first click is still freeing (the button is disabled)."""
        calls.append(device)
        stale_widget.button.click()
        return real(device)

    stale_widget._free = free_and_click_again
    stale_widget.button.click()
    assert calls == ["cpu"] and stale_widget.report.freed.freed_bytes == 64 << 20
    assert not stale_widget.button.disabled


def test_a_click_from_inside_a_running_cell(ip, stale_widget: MemoryWidget) -> None:
    ip.user_ns["w"] = stale_widget
    result = run(ip, "w.button.click()\nafter_click = torch.ones(32 << 20)")  # frees 64 MiB, takes 128
    assert result.success
    assert stale_widget.report.freed.freed_bytes == 64 << 20
    latest = cell_watch(ip).live[-1]
    assert latest is not stale_widget and latest.report.snapshot.held_by("after_click") == 128 << 20
    assert ip.user_ns["kept"].sum().item() == 1000


def test_a_click_while_another_cells_hook_runs(ip, stale_widget: MemoryWidget) -> None:
    clicked: list[int] = []

    def click_during_hooks(result: Any) -> None:
        """A comm message handled while post_run_cell callbacks run (another extension's hook)."""
        if not clicked:
            clicked.append(result.execution_count)
            stale_widget.button.click()

    ip.events.register("post_run_cell", click_during_hooks)
    try:
        result = run(ip, "again = torch.ones(16 << 20) * 3\nagain")  # a new stale result in the same cell
    finally:
        ip.events.unregister("post_run_cell", click_during_hooks)
    assert result.success and clicked and cell_watch(ip).enabled
    assert stale_widget.report.freed is not None and stale_widget.report.freed.freed_bytes >= 64 << 20
    assert ip.user_ns["again"].sum().item() == 3 * (16 << 20)  # a user variable is never freed
    assert ip.user_ns["kept"].sum().item() == 1000


def test_reset_between_cells_then_the_button(ip, stale_widget: MemoryWidget) -> None:
    run(ip, "%reset -f")
    stale_widget.button.click()
    assert stale_widget.report.freed is not None and "could not" not in stale_widget.status.value
    ip.run_line_magic("gpumem", "-o --pin")
    pinned = cell_watch(ip).pinned
    run(ip, "%reset -f")
    run(ip, "import torch\nfresh = torch.ones(16 << 20)")
    assert pinned.report.snapshot.held_by("fresh") == 64 << 20 and cell_watch(ip).enabled


# --------------------------------------------------------------------------- two real kernels

_KERNEL_SETUP = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
print("PID", os.getpid())
"""

_KERNEL_CHECK = """
import json
from oom_magic.device import nvml as _nvml
from oom_magic.device.nvml import Nvml
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
# FAKE NVML (no GPU here): one device holding both kernels, by their real pids.
_fake_nvml = _nvml.use(Nvml(FakeNvml([FakeGpu(used=8 << 30, processes={processes!r})]).module))
_fake_nvml.__enter__()  # for this kernel's life (held in a name: a dropped one would exit and put NVML back)
get_ipython().run_line_magic("load_ext", "oom_magic")
_s = get_ipython().run_line_magic("gpumem", "-o --device cuda:0")
print("RESULT", json.dumps({{"self": _s.reading.process_used,
                            "others": [[p.pid, p.is_jupyter_kernel, p.is_self, p.used_bytes] for p in _s.reading.processes],
                            "text": str(_s)}}))
"""


def _execute(kc: Any, code: str) -> str:
    printed: list[str] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=120, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(printed)
    return "".join(printed)


@pytest.mark.xdist_group("jupyter")  # real kernels run on one xdist worker, one after another
def test_two_kernels_see_each_other_as_other_jupyter_kernels(tmp_path: Path) -> None:
    manager = pytest.importorskip("jupyter_client.manager")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "CUDA_VISIBLE"))}
    env["MPLBACKEND"] = "Agg"
    kernels = []
    try:
        for _ in range(2):
            km = manager.KernelManager(kernel_name="python3")
            km.start_kernel(env=env, cwd=str(tmp_path))
            kc = km.client()
            kc.start_channels()
            kernels.append((km, kc))
        pids = []
        for _, kc in kernels:
            kc.wait_for_ready(timeout=120)
            pids.append(int(_execute(kc, _KERNEL_SETUP).split("PID", 1)[1].split()[0]))
        a, b = pids
        assert a != b and os.getpid() not in pids
        usage = {a: 3 * GiB, b: 5 * GiB}
        for (_, kc), me, other in ((kernels[0], a, b), (kernels[1], b, a)):
            printed = _execute(kc, _KERNEL_CHECK.format(processes=[(a, usage[a]), (b, usage[b])]))
            seen = json.loads(printed.split("RESULT", 1)[1])
            assert seen["self"] == usage[me]  # itself: this process, not another
            assert seen["others"] == [[other, True, False, usage[other]]]  # the other: a Jupyter kernel
            assert f"pid {other}" in seen["text"] and "Jupyter kernel" in seen["text"]
            assert f"pid {me}" not in seen["text"]
    finally:
        for km, kc in kernels:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
