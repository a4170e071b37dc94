"""Tests for the memory widget under cells: when it shows, what it says, its button, its lifetime.

A real IPython shell (the ``ip`` fixture), real torch CPU tensors and real ipywidgets objects
(no frontend: children values, captions, button state and ``button.click()`` are checked
directly). There is no GPU here, so the CUDA caption and the other-processes table are checked on
a FAKE snapshot built from the real record types with made-up figures (``fake_gpu_report``).
"""
from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from oom_magic.device.reading import DeviceReading
from oom_magic.device.processes import ProcessInfo
from oom_magic.heap.snapshot import QUICK_WALK_FLOOR_SECONDS, Snapshot
from oom_magic.heap.tracker import StorageRecord
from oom_magic.notebook.watch import CellChange, CellRecord, CellReport, Probe
from oom_magic.notebook.widget import WIDGET_VIEW_MIME, CellWatch, MemoryWidget

MiB = 1 << 20
GiB = 1 << 30
XSS = "<img src=x onerror=alert(1)>"
XSS_ESCAPED = "&lt;img src=x onerror=alert(1)&gt;"


@pytest.fixture
def watch(ip):
    """The loaded extension's CellWatch, torch imported in the shell, settings restored afterwards."""
    magics = ip.magics_manager.registry["OomMagics"]
    ip.run_cell("import torch", store_history=True)
    # A budget every full scan here fits: these tests check the full view (the quick view: below).
    ip.run_line_magic("config", "OomMagics.hook_budget_ms = 600000")
    yield magics.cell_watch
    for name in ("auto_display", "live_widgets", "cpu_change_threshold", "gpu_change_threshold", "hook_budget_ms"):
        ip.config.OomMagics.pop(name, None)


def run(ip, src: str):
    result = ip.run_cell(src, store_history=True)
    return result


def fake_gpu_report(stale: int = int(1.2 * GiB), process_name: str = "python") -> CellReport:
    """FAKE CUDA snapshot (no GPU here): real record types, figures from the issue's example."""
    reading = DeviceReading(
        device="cuda:0", name="NVIDIA Fake", total=int(15.78 * GiB), free=int(1.58 * GiB), used=int(14.2 * GiB),
        process_used=int(13.9 * GiB), allocated=int(13.0 * GiB), reserved=int(13.5 * GiB),
        peak_allocated=int(13.1 * GiB),
        processes=(ProcessInfo(4242, 300 * MiB, process_name, "me", True, False, None),),
    )
    storages = (
        StorageRecord(1, "cuda:0", int(11.8 * GiB), "bfloat16", (32000, 4096), 1, "user", "model.lm_head.weight"),
        StorageRecord(2, "cuda:0", stale, "float32", (1024, 1024), 1, "output-cache", f"Out[3]['{XSS}']"),
    )
    snap = Snapshot("cuda:0", reading, storages, (("user", int(11.8 * GiB)), ("output-cache", stale)),
                    0.01, 1000, True)
    record = CellRecord(4, "cuda:0", int(13.0 * GiB), int(13.5 * GiB), int(13.5 * GiB), None, None, False,
                        None, True)
    change = CellChange(record, Probe("cuda:0", int(0.4 * GiB), int(0.5 * GiB), int(0.4 * GiB)),
                        Probe("cuda:0", int(13.0 * GiB), int(13.5 * GiB), int(13.5 * GiB)),
                        int(12.6 * GiB), None, int(13.1 * GiB), ("allocated", "reserved"))
    return CellReport(change, snap)


def test_a_cell_that_changes_memory_gets_a_widget(ip, watch) -> None:
    run(ip, "x = torch.ones(16 << 20)")
    assert len(watch.live) == 1
    w = watch.live[0]
    caption = w.caption.value
    assert caption.startswith("cpu · ") and " GiB used · " in caption
    assert "this cell RSS +" in caption and "variables +64.00 MiB" in caption
    assert caption.endswith("stale 0 B")
    assert "oom-seg-user" in w.bar.value and "user: 64.00 MiB" in w.bar.value
    assert "<code>x</code>" in w.details_body.value and "64.00 MiB" in w.details_body.value
    assert "<details class='oom-details'><summary>details</summary>" in w.bar.value  # collapsed: no `open`
    assert w.button.layout.display == "none"  # nothing stale: no button
    record = watch.watcher.history[-1]
    assert record.changed and record.tensor_bytes is not None and record.tensor_bytes >= 64 * MiB
    assert w.report.change.execution_count == record.execution_count


def test_a_cell_that_changes_nothing_gets_none(ip, watch) -> None:
    run(ip, "x = torch.ones(16 << 20)")
    shown = list(watch.live)
    run(ip, "y = 1")
    assert watch.live == shown
    last = watch.watcher.history[-1]
    assert last.changed is False and last.tensor_bytes is None  # no scan when nothing changed


def test_free_stale_button_frees_and_updates_in_place(ip, watch) -> None:
    run(ip, "x = torch.ones(16 << 20)")
    kept = ip.user_ns["x"]
    run(ip, "torch.ones(16 << 20) * 2")  # only the output cache holds this one
    count = ip.execution_count - 1
    w = watch.live[-1]
    assert w.report.snapshot.stale_bytes == 64 * MiB
    assert "stale 64.00 MiB" in w.caption.value
    assert w.button.description == "Free stale tensors (64.00 MiB)"
    assert w.button.layout.display is None and not w.button.disabled
    seen: list[bool] = []
    w.button.observe(lambda change: seen.append(change["new"]), "disabled")
    w.button.click()
    assert seen == [True, False]  # disabled while it ran
    assert watch.live[-1] is w  # the same widget, updated in place
    assert "stale 0 B" in w.caption.value and w.caption.value.endswith("freed 64.00 MiB")
    assert "freed 64.00 MiB (output-cache 64.00 MiB)" in w.status.value
    assert w.button.layout.display == "none"
    assert w.report.freed is not None and w.report.freed.freed_bytes == 64 * MiB
    assert ip.user_ns["x"] is kept  # a user variable is never touched
    assert count not in ip.user_ns["Out"]


def test_a_button_failure_is_shown_in_the_widget_not_raised(ip, watch) -> None:
    def failing_free(device):
        """FAKE cleanup failure."""
        raise RuntimeError("boom <b>")

    w = MemoryWidget(fake_gpu_report(), free=failing_free)
    w.button.click()
    assert w.status.value == "could not free stale tensors: RuntimeError: boom &lt;b&gt;"
    assert not w.button.disabled and w.button.layout.display is None
    assert w.button.description == "Free stale tensors (1.20 GiB)"


def test_gpu_caption_reads_like_the_issue_example() -> None:
    w = MemoryWidget(fake_gpu_report(), free=lambda device: (_ for _ in ()).throw(AssertionError))
    assert w.caption.value == ("cuda:0 · 14.20 GiB / 15.78 GiB used · this cell +12.60 GiB "
                               "(peak +13.10 GiB) · stale 1.20 GiB")
    assert w.button.description == "Free stale tensors (1.20 GiB)"
    assert "Jupyter kernel" in w.details_body.value and "4242" in w.details_body.value
    for key in ("user", "stale", "cache", "context", "free"):
        assert f"oom-seg-{key}" in w.bar.value
    w.close()


def test_the_mimebundle_keeps_text_and_static_html_beside_the_widget_view(ip, watch) -> None:
    run(ip, "x = torch.ones(16 << 20)")
    w = watch.live[-1]
    bundle = w._repr_mimebundle_()
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == w.box.model_id
    assert bundle["text/plain"].splitlines()[0] == w.caption.value
    assert re.search(r"^\s*x\s+64\.00 MiB\s+user$", bundle["text/plain"], re.M)  # columns pad to the longest path
    html = bundle["text/html"]
    assert "<details><summary>details</summary>" in html and "oom-bar" in html
    assert w.caption.value.replace("·", "·") in html
    assert repr(w).startswith("<MemoryWidget In [") and "live" in repr(w)


def test_outside_strings_stay_escaped(ip, watch) -> None:
    run(ip, f"d = {{{XSS!r}: torch.ones(16 << 20)}}")
    w = watch.live[-1]
    for html in (w.details_body.value, w._repr_mimebundle_()["text/html"]):
        assert XSS_ESCAPED in html and XSS not in html
    fake = MemoryWidget(fake_gpu_report(process_name=XSS), free=None)
    for html in (fake.details_body.value, fake._repr_mimebundle_()["text/html"], fake.bar.value):
        assert XSS not in html
    assert fake.details_body.value.count(XSS_ESCAPED) == 2  # holder path and process name
    assert fake.button.layout.display == "none"  # no cleanup action: no button
    fake.close()


def test_an_out_of_memory_cell_always_gets_the_widget(ip, watch) -> None:
    ip.magics_manager.registry["OomMagics"].cpu_change_threshold = 1 << 40  # nothing else would count
    result = run(ip, "torch.empty(1 << 50, dtype=torch.uint8)")
    assert result.error_in_exec is not None
    assert len(watch.live) == 1
    w = watch.live[0]
    assert "out of memory" in w.caption.value
    assert watch.watcher.history[-1].oom and not watch.watcher.history[-1].changed


def test_auto_modes(ip, watch) -> None:
    magics = ip.magics_manager.registry["OomMagics"]
    status = ip.run_line_magic("gpumem", "-o --auto off")
    assert status.mode == "off" and magics.auto_display == "off"
    assert "after-cell memory view: off" in str(status)
    recorded = len(watch.watcher.history)
    run(ip, "x = torch.ones(16 << 20)")
    assert watch.live == [] and len(watch.watcher.history) == recorded + 1  # history still kept
    run(ip, "torch.empty(1 << 50, dtype=torch.uint8)")
    assert watch.live == []  # off means off, out-of-memory cells included
    ip.run_line_magic("gpumem", "-o --auto ALWAYS")
    assert magics.auto_display == "always"
    run(ip, "y = 1")
    assert len(watch.live) == 1
    ip.run_line_magic("config", "OomMagics.auto_display = 'off'")
    assert magics.auto_display == "off"
    with pytest.raises(UsageError, match="invalid choice"):
        ip.run_line_magic("gpumem", "-o --auto sometimes")


def test_pin_shows_one_live_widget_that_follows_the_cells(ip, watch) -> None:
    status = ip.run_line_magic("gpumem", "-o --pin")
    assert status.pinned and "pinned widget" in str(status)
    pinned = watch.pinned
    assert pinned is not None and pinned.caption.value.startswith("cpu · ")
    run(ip, "x = torch.ones(16 << 20)")
    count = ip.execution_count - 1
    assert watch.live == []  # no per-cell widget while pinned
    assert pinned.caption.value.startswith(f"In [{count}] · cpu · ")
    assert "variables +64.00 MiB" in pinned.caption.value
    run(ip, "y = 1")
    assert pinned.caption.value.startswith(f"In [{count}] · ")  # nothing changed: left as it was
    ip.run_line_magic("gpumem", "-o --auto changes")
    assert watch.pinned is None and pinned.closed


def test_live_widgets_are_capped_and_old_ones_freeze_to_static_html(ip, watch) -> None:
    ip.magics_manager.registry["OomMagics"].live_widgets = 2
    watch.update_outputs = True  # as in a kernel: rewrite frozen outputs
    with capture_output() as captured:
        for i in range(4):
            run(ip, f"t{i} = torch.ones(16 << 20)")
    shown = [o for o in captured.outputs if WIDGET_VIEW_MIME in o.data]
    assert len(shown) == 4
    assert len(watch.live) == 2
    frozen = [o for o in captured.outputs if getattr(o, "update", False)]
    assert len(frozen) == 2
    for output in frozen:
        assert set(output.data) == {"text/plain", "text/html"}
        assert re.match(r"as of In \[\d+\] · cpu · ", output.data["text/plain"])  # an older cell's figures, said so
    first_id = shown[0].transient["display_id"]
    assert frozen[0].transient["display_id"] == first_id
    assert "t0" in frozen[0].data["text/html"]  # the first cell's own state, not a later one


def test_an_earlier_widget_keeps_its_cells_state_and_says_which_cell(ip, watch) -> None:
    result = run(ip, "a = torch.ones(16 << 20)")
    first = watch.live[-1]
    caption = first.caption.value
    assert caption.startswith("cpu · ")  # the newest widget: its figures are now's
    run(ip, "b = torch.ones(32 << 20)")
    assert watch.live[-1] is not first
    # the same figures, now said to be those of its own cell
    assert first.caption.value == f"as of In [{result.execution_count}] · {caption}"
    assert "variables +64.00 MiB" in first.caption.value
    assert "variables +128.00 MiB" in watch.live[-1].caption.value and not watch.live[-1].caption.value.startswith("as of")
    assert first.static_bundle()["text/plain"].startswith(f"as of In [{result.execution_count}] · ")


def test_an_older_widgets_button_refreshes_it_to_now(ip, watch) -> None:
    # A widget under every cell: late in a long session the allocator reuses freed pages, so 32 MiB
    # may not move the resident set (the default 'changes' would show no widget at all).
    ip.run_line_magic("config", "OomMagics.auto_display = 'always'")
    run(ip, "torch.ones(8 << 20) * 3")  # 32 MiB kept only by Out[N]: the widget offers the button
    older = watch.live[-1]
    run(ip, "c = torch.ones(16 << 20)")
    assert older.caption.value.startswith("as of In [")
    older.button.click()
    assert not older.caption.value.startswith("as of") and older.caption.value.endswith("freed 32.00 MiB")
    assert " · stale 0 B · " in older.caption.value
    run(ip, "d = torch.ones(16 << 20)")  # newer again: its figures are those of the click
    assert older.caption.value.startswith("as of the click · cpu · ")
    ip.run_line_magic("config", "OomMagics.auto_display = 'changes'")  # the default, for the tests after


def test_the_bar_has_a_legend_with_bytes_and_labels(ip, watch) -> None:
    run(ip, "big = torch.ones(64 << 20)")  # 256 MiB: wide enough for its label inside the bar
    bar = watch.live[-1].bar.value
    legend = bar[bar.index("<div class=\"oom-legend\""):bar.index("<details")]
    assert 'class="oom-legend-item oom-legend-user"' in legend and "user 256.00 MiB" in legend
    assert "free " in legend and "rest of this process " in legend
    assert 'title="tensors reachable from your variables (268,435,456 bytes)"' in legend  # exact bytes on hover
    assert 'title="user: 256.00 MiB (268,435,456 bytes) — tensors reachable from your variables"' in bar
    static = watch.live[-1].static_bundle()["text/html"]
    assert "oom-legend-user" in static  # the static fallback keeps the legend


def test_zero_live_widgets_shows_static_html_only(ip, watch) -> None:
    ip.magics_manager.registry["OomMagics"].live_widgets = 0
    with capture_output() as captured:
        run(ip, "x = torch.ones(16 << 20)")
    assert watch.live == []
    assert len(captured.outputs) == 1
    assert set(captured.outputs[0].data) == {"text/plain", "text/html"}
    assert "variables +64.00 MiB" in captured.outputs[0].data["text/plain"]


def test_frozen_widgets_close_every_model(ip, watch) -> None:
    import ipywidgets.widgets.widget as widget_module

    before = set(widget_module._instances)
    w = MemoryWidget(fake_gpu_report(), free=None)
    created = set(widget_module._instances) - before
    assert len(created) >= 8
    w.close()
    assert not (set(widget_module._instances) & created)
    assert w.closed and WIDGET_VIEW_MIME not in w._repr_mimebundle_()
    assert "text/html" in w._repr_mimebundle_()


def test_cell_watch_is_the_registered_one(ip, watch) -> None:
    assert isinstance(watch, CellWatch)
    assert watch.status().cells_recorded == len(watch.watcher.history)


# --------------------------------------------------------------------------- the quick view


@pytest.fixture
def heap_passes(monkeypatch) -> list[str]:
    """Counts the heap passes snapshots make (a spy: the real find_tensors still runs)."""
    import sys

    snapshot_module = sys.modules["oom_magic.heap.snapshot"]  # the package's `snapshot` is the function
    calls: list[str] = []
    real = snapshot_module.find_tensors

    def counted(torch, device=None):
        calls.append(device)
        return real(torch, device)

    monkeypatch.setattr(snapshot_module, "find_tensors", counted)
    return calls


def test_over_its_budget_the_hook_shows_the_quick_view_and_says_so(ip, watch, heap_passes) -> None:
    ip.run_line_magic("config", "OomMagics.hook_budget_ms = 0")  # no full scan fits
    run(ip, "kept = torch.ones(16 << 20)")
    run(ip, "torch.ones(8 << 20) * 2")  # only the output cache holds this one
    widget = watch.live[-1]
    snap = widget.report.snapshot
    assert heap_passes == [] and not snap.heap_scan
    # What the walk reaches is still named, and the output cache is still stale.
    assert snap.held_by("kept") == 64 * MiB and snap.stale_bytes == 32 * MiB
    assert widget.caption.value.endswith(" · stale 32.00 MiB (quick view)")
    # One note, in plain words: what was counted, what was left out, and where the full picture is.
    note = snap.notes[0]
    assert note.startswith("quick view: to keep this view under 0 ms (OomMagics.hook_budget_ms), only the tensors "
                           "your variables, the output cache and stored tracebacks hold were counted")
    assert "Left out: garbage (objects that only refer to each other) and tensors a library keeps." in note
    assert "%gpumem has the full picture." in note
    assert [n for n in snap.notes if n.startswith("quick view")] == [note]
    for engine_words in ("allocated blocks", "budget of", "heap scan", "holder walk"):
        assert engine_words not in " ".join(snap.notes)
    assert "%gpumem has the full picture." in widget.details_body.value


def test_the_quick_view_learns_what_collecting_the_roots_costs(ip, watch, heap_passes, monkeypatch) -> None:
    """What a quick view costs past its walk is learnt from the hook's clock, so the roots' collection
    (before the snapshot starts its own) is kept free for the next cell: here a collection that moves
    a stand-in clock by 30 ms (the spy below: the real roots are still collected)."""
    import types

    import oom_magic.notebook.widget as widget_module

    clock = [0.0]
    real_clock = widget_module.time.perf_counter
    monkeypatch.setattr(widget_module, "time", types.SimpleNamespace(perf_counter=lambda: real_clock() + clock[0]))
    real_roots = widget_module.collect_roots

    def slow_roots(*args, **kwargs):
        clock[0] += 0.030
        return real_roots(*args, **kwargs)

    monkeypatch.setattr(widget_module, "collect_roots", slow_roots)
    ip.run_line_magic("config", "OomMagics.hook_budget_ms = 0")
    run(ip, "kept = torch.ones(16 << 20)")
    assert heap_passes == [] and not watch.live[-1].report.snapshot.heap_scan  # the quick view ran
    # The walk was given its floor (no budget is left at 0 ms); all past it is kept free next time.
    assert watch.scan_cost.after_walk_seconds >= 0.030 - QUICK_WALK_FLOOR_SECONDS


def test_a_quick_view_s_budget_counts_its_reading(monkeypatch) -> None:
    """The quick view's budget runs from the call: a device reading that takes 40 ms of a 50 ms budget leaves
    the walk 10 ms (a stand-in clock the spy reading moves; the real reading and walk still run), and one
    that takes it all leaves the walk its floor."""
    import sys
    import types

    import torch

    from oom_magic.heap.roots import collect_roots
    from oom_magic.heap.snapshot import snapshot

    snapshot_module = sys.modules["oom_magic.heap.snapshot"]  # the package's `snapshot` is the function
    clock = [0.0]
    monkeypatch.setattr(snapshot_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real_read, real_walk = snapshot_module.read_device, snapshot_module.attribute_reachable
    given: list[float] = []

    def slow_read(*args, **kwargs):
        clock[0] += taken
        return real_read(*args, **kwargs)

    def spy_walk(*args, budget_seconds, **kwargs):
        given.append(budget_seconds)
        return real_walk(*args, budget_seconds=budget_seconds, **kwargs)

    monkeypatch.setattr(snapshot_module, "read_device", slow_read)
    monkeypatch.setattr(snapshot_module, "attribute_reachable", spy_walk)
    for taken in (0.040, 0.080):
        snapshot("cpu", roots=collect_roots(namespace={"x": torch.ones(4)}), heap_scan=False, budget_seconds=0.050)
    assert given == pytest.approx([0.010, QUICK_WALK_FLOOR_SECONDS])


def test_the_quick_view_misses_garbage_and_the_button_still_frees_it(ip, watch, heap_passes) -> None:
    ip.run_line_magic("config", "OomMagics.hook_budget_ms = 0")
    run(ip, "import gc\ngc.disable()")
    try:
        run(ip, "class Node: pass\n"
                "n = Node(); n.me = n; n.weights = torch.ones(8 << 20)\n"
                "probe = torch.ones(16 << 20) * 2")  # the output cache holds this one
        run(ip, "del n")  # the 32 MiB cycle is garbage now; the cell also changes the output count
        run(ip, "probe2 = torch.ones(16 << 20)")
        widget = watch.live[-1]
        assert not widget.report.snapshot.heap_scan
        assert widget.report.snapshot.kind_bytes("garbage") == 0  # the walk cannot see it
        widget.button.click()  # the button runs the full cleanup and a full rescan
        assert widget.report.freed is not None and widget.report.freed.freed_bytes >= 32 * MiB
        assert widget.report.snapshot.heap_scan and widget.report.snapshot.stale_bytes == 0
        assert heap_passes  # the full rescan ran
        assert ip.user_ns["probe2"].sum().item() == 16 << 20
    finally:
        run(ip, "gc.enable()")


def test_within_its_budget_the_hook_scans_the_whole_heap_and_learns_its_cost(ip, watch, heap_passes) -> None:
    rate = watch.scan_cost.seconds_per_block
    run(ip, "kept = torch.ones(16 << 20)")
    snap = watch.live[-1].report.snapshot
    assert heap_passes == ["cpu"] and snap.heap_scan
    assert not any("quick view" in n for n in snap.notes)
    assert watch.scan_cost.seconds_per_block != rate  # folded in the measured scan



def test_on_cuda_the_quick_view_calls_the_remainder_not_attributed() -> None:
    """FAKE CUDA figures: without a heap scan, allocated − found is not only the autograd graph."""
    from dataclasses import replace

    from oom_magic.render.segments import memory_segments

    full = fake_gpu_report().snapshot
    quick = replace(full, heap_scan=False)
    (full_rest,) = [s for s in memory_segments(full) if s.key == "untracked"]
    (quick_rest,) = [s for s in memory_segments(quick) if s.key == "untracked"]
    assert full_rest.label == "untracked" and "autograd graph" in full_rest.explain
    assert quick_rest.label == "not attributed (quick view)" and quick_rest.bytes == full_rest.bytes
    assert "garbage, a library's tensors or the autograd graph" in quick_rest.explain


def test_latest_widget_is_the_newest_live_one(ip, watch) -> None:
    import oom_magic

    assert oom_magic.latest_widget(ip) is None
    run(ip, "a = torch.ones(16 << 20)")
    run(ip, "b = torch.ones(16 << 20)")
    assert oom_magic.latest_widget(ip) is watch.live[-1] is not watch.live[0]
    pinned = watch.pin()
    assert oom_magic.latest_widget(ip) is pinned
    ip.run_line_magic("unload_ext", "oom_magic")
    try:
        assert oom_magic.latest_widget(ip) is None
    finally:
        ip.run_line_magic("load_ext", "oom_magic")
