"""Records are shown through the renderer registry: str, IPython's pretty printer and HTML agree."""
from __future__ import annotations

import json
from dataclasses import dataclass

from IPython.lib.pretty import pretty

from oom_magic.device.reading import DeviceReading
from oom_magic.records import snapshot as records_snapshot
from oom_magic.records.cell import CellChange, CellRecord, CellReport, Probe, Thresholds, WatchStatus
from oom_magic.records.cleanup import FreeReport, StillHeld
from oom_magic.records.shown import Shown, renderer_for, renders
from oom_magic.records.snapshot import Snapshot, StorageRecord, View
from oom_magic.render.cell import cell_html, cell_text, watch_status_text
from oom_magic.render.html import free_report_html, snapshot_html
from oom_magic.render.segments import memory_segments
from oom_magic.render.text import free_report_text, snapshot_text, still_held_text


@dataclass(frozen=True)
class _Box(Shown):
    used: int


@dataclass(frozen=True)
class _SmallBox(_Box):
    pass


def test_a_registered_record_is_shown_by_its_renderer_in_str_pretty_and_html() -> None:
    renders(_Box, lambda r: f"box uses {r.used} B", lambda r: f"<b>{r.used}</b>")
    box = _Box(512)
    assert str(box) == "box uses 512 B"
    # @dataclass writes __repr__ into the class; IPython's pretty printer must still use the renderer.
    assert pretty(box) == "box uses 512 B"
    assert box._repr_html_() == "<b>512</b>"
    assert repr(box) == "_Box(used=512)"


def test_a_subclass_uses_its_nearest_registered_base() -> None:
    renders(_Box, lambda r: f"box uses {r.used} B")
    small = _SmallBox(1)
    assert renderer_for(small) is renderer_for(_Box(0))
    assert pretty(small) == "box uses 1 B"
    assert small._repr_html_() is None


# -- each record family is shown by its renderer (records never import render; oom_magic registers it) --
MiB = 1 << 20


def _reading(device: str = "cuda:0", process_used: int | None = 300 * MiB) -> DeviceReading:
    return DeviceReading(device=device, name="NVIDIA Fake", total=1024 * MiB, free=512 * MiB, used=512 * MiB,
                         process_used=process_used, allocated=200 * MiB, reserved=256 * MiB, peak_allocated=220 * MiB)


def _snapshot(view: View = "table") -> Snapshot:
    storages = (StorageRecord(1, "cuda:0", 128 * MiB, "float32", (32, 1 << 20), 1, "user", "model.weight"),
                StorageRecord(2, "cuda:0", 64 * MiB, "float32", (16, 1 << 20), 1, "output-cache", "Out[3]"))
    return Snapshot("cuda:0", _reading(), storages, (("user", 128 * MiB), ("output-cache", 64 * MiB)),
                    0.01, 1000, True, view=view)


def test_a_snapshot_is_shown_by_its_renderer_and_as_json_in_the_json_view() -> None:
    snap = _snapshot()
    assert str(snap) == snapshot_text(snap) and "model.weight" in str(snap)
    assert pretty(snap) == snapshot_text(snap)
    assert snap._repr_html_() == snapshot_html(snap) and "model.weight" in snapshot_html(snap)
    assert repr(snap).startswith("<Snapshot cuda:0: 2 storages")
    as_json = _snapshot("json")
    assert json.loads(pretty(as_json))["stale_bytes"] == 64 * MiB and as_json._repr_html_() is None
    assert dict(snap.parts())["untracked"] == 200 * MiB - 192 * MiB
    assert snap.to_dict()["segments"] == {s.key: s.bytes for s in memory_segments(snap)}


def test_a_free_report_and_what_still_holds_a_name_are_shown_by_their_renderers() -> None:
    held = StillHeld("model", 2 * MiB, ("model2", "opt.state"))
    assert str(held) == held.sentence() == still_held_text(held)
    assert held.sentence() == "`model` deleted; its 2.00 MiB are still held by `model2` and `opt.state`"
    report = FreeReport("cuda:0", 64 * MiB, (("output-cache", 64 * MiB),), _reading(), _reading(),
                        ("model",), (held,))
    assert str(report) == pretty(report) == free_report_text(report)
    assert "freed 64.00 MiB on cuda:0 (output-cache 64.00 MiB)" in str(report) and held.sentence() in str(report)
    assert report._repr_html_() == free_report_html(report)
    assert repr(report) == "<FreeReport cuda:0: freed=67108864 B>"


def test_the_after_cell_records_are_shown_by_their_renderers() -> None:
    record = CellRecord(4, "cuda:0", 200 * MiB, 256 * MiB, 220 * MiB, None, None, False, None, True)
    change = CellChange(record, Probe("cuda:0", 0, 0, 0), Probe("cuda:0", 200 * MiB, 256 * MiB, 220 * MiB),
                        200 * MiB, None, 220 * MiB, ("allocated", "reserved"))
    report = CellReport(change, _snapshot())
    assert str(report) == pretty(report) == cell_text(report)
    assert "this cell +200.00 MiB (peak +220.00 MiB)" in str(report)
    assert report._repr_html_() == cell_html(report)
    status = WatchStatus("changes", False, True, Thresholds(), 3, 4)
    assert str(status) == pretty(status) == watch_status_text(status)
    assert str(status).endswith("4 cells recorded") and status._repr_html_() is None


def test_the_use_case_modules_still_export_their_records() -> None:
    from importlib import import_module

    cleanup, jupyter_kernels, snapshot, tracker, watch = (
        import_module(f"oom_magic.{name}") for name in ("heap.cleanup", "device.jupyter_kernels", "heap.snapshot", "heap.tracker", "notebook.watch"))
    assert (snapshot.Snapshot, cleanup.FreeReport, cleanup.StillHeld, watch.CellReport, watch.WatchStatus,
            tracker.StorageRecord, jupyter_kernels.KernelInfo) == (
        Snapshot, FreeReport, StillHeld, CellReport, WatchStatus, StorageRecord, records_snapshot.KernelInfo)
