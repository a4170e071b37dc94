"""Tests for the memory timeline (``%gpumem --plot``): values plotted, OOM marks, labels, PNG files.

Cells run in a real IPython shell with real torch CPU tensors and a real CPU out-of-memory error.
The GPU timeline is drawn from FAKE records (no GPU here): real ``CellRecord``s with made-up
allocator figures, labelled where built.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from oom_magic.common.errors import OomMagicError
from oom_magic.render.plot import Timeline, plot_timeline
from oom_magic.notebook.watch import CellRecord

MiB = 1 << 20
GiB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_gpu_records() -> list[CellRecord]:
    """FAKE allocator figures for five cells on cuda:0 (a load, an OOM, a guarded retry)."""
    return [
        CellRecord(1, "cuda:0", 0, 0, None, None, None, False, None, False),
        CellRecord(2, "cuda:0", 12 * GiB, 13 * GiB, 13 * GiB, None, None, False, None, True),
        CellRecord(3, "cuda:0", 12 * GiB, 14 * GiB, None, None, None, True, None, True),
        CellRecord(4, "cuda:0", 2 * GiB, 14 * GiB, None, None, None, False, "load $model", True),
        CellRecord(6, "cuda:0", 2 * GiB, 2 * GiB, 2 * GiB, None, None, False, None, True),
        CellRecord(7, "cpu", None, None, None, 500 * MiB, None, False, None, False),
    ]


def test_gpu_timeline_plots_allocated_reserved_and_known_peaks(tmp_path) -> None:
    target = tmp_path / "timeline.png"
    timeline = plot_timeline(fake_gpu_records(), device="cuda:0", path=str(target))
    assert timeline.device == "cuda:0"
    assert timeline.cells == (1, 2, 3, 4, 6)  # x = execution counts; the cpu cell is left out
    assert timeline.values("allocated") == (0, 12 * GiB, 12 * GiB, 2 * GiB, 2 * GiB)
    assert timeline.values("reserved") == (0, 13 * GiB, 14 * GiB, 14 * GiB, 2 * GiB)
    assert timeline.values("peak") == (None, 13 * GiB, None, None, 2 * GiB)
    assert timeline.oom_cells == (3,)
    assert timeline.labels == ((4, "load $model"),)
    assert timeline.path == str(target)
    assert target.read_bytes().startswith(PNG_MAGIC)
    ax = timeline.figure.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"allocated", "reserved", "peak"}
    ys = list(lines["allocated"].get_ydata())
    assert [y for y in ys if not math.isnan(y)] == [0, 12, 12, 2, 2]  # in GiB, the axis unit
    # issue 25: cell 5 was not recorded, so the line stops between 4 and 6 instead of joining across it
    assert list(lines["allocated"].get_xdata()) == [1, 2, 3, 4, 5, 6] and math.isnan(ys[4])
    assert list(lines["peak"].get_xdata()) == [2, 6] and list(lines["peak"].get_ydata()) == [13, 2]
    assert ax.get_ylabel() == "GiB" and ax.get_xlabel() == "execution count"
    texts = [t.get_text() for t in ax.texts]
    assert " OOM" in texts and r"load \$model" in texts  # "$" shown as typed, not as mathtext
    assert timeline.png().startswith(PNG_MAGIC) and timeline._repr_png_().startswith(PNG_MAGIC)
    assert repr(timeline) == f"<Timeline cuda:0: 5 cells, 1 out of memory, 1 labelled, saved to {target}>"


def test_default_device_is_the_last_cells() -> None:
    timeline = plot_timeline(fake_gpu_records())
    assert timeline.device == "cpu" and timeline.cells == (7,)
    assert timeline.values("RSS") == (500 * MiB,)
    assert timeline.values("tensor bytes") == (None,)
    ax = timeline.figure.axes[0]
    assert ax.get_ylabel() == "MiB"
    rss = next(line for line in ax.get_lines() if line.get_label() == "RSS")
    assert list(rss.get_ydata()) == [500]


def test_no_cells_is_a_one_line_error() -> None:
    with pytest.raises(OomMagicError, match="no cells recorded on cuda:1 yet"):
        plot_timeline(fake_gpu_records(), device="cuda:1")
    with pytest.raises(OomMagicError, match="no cells recorded yet"):
        plot_timeline([])


def test_plotting_never_touches_pyplot() -> None:
    code = ("import sys\nfrom oom_magic.render.plot import plot_timeline\nfrom oom_magic.notebook.watch import CellRecord\n"
            "t = plot_timeline([CellRecord(1, 'cpu', None, None, None, 1 << 20, None, False, None, False)])\n"
            "t.png()\nprint('matplotlib.pyplot' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_gpumem_plot_draws_the_shells_cells(ip, tmp_path) -> None:
    run = lambda src: ip.run_cell(src, store_history=True)  # noqa: E731
    run("import torch")
    run("x = torch.ones(16 << 20)")
    grown = ip.execution_count - 1
    run("del x")
    run("torch.empty(1 << 50, dtype=torch.uint8)")
    oom = ip.execution_count - 1
    run("from oom_magic.notebook.watch import mark_cell\nmark_cell('load tiny')\ny = torch.ones(4 << 20)")
    labelled = ip.execution_count - 1
    target = tmp_path / "cells.png"
    timeline = ip.run_line_magic("gpumem", f"-o --plot {target}")
    assert isinstance(timeline, Timeline)
    history = ip.magics_manager.registry["OomMagics"].cell_watch.watcher.records("cpu")
    assert timeline.cells == tuple(r.execution_count for r in history)
    assert grown in timeline.cells and oom in timeline.cells
    assert timeline.values("RSS") == tuple(r.rss for r in history)
    tensor_bytes = dict(zip(timeline.cells, timeline.values("tensor bytes")))
    assert tensor_bytes[grown] is not None and tensor_bytes[grown] >= 64 * MiB  # scanned: it changed
    assert timeline.oom_cells == (oom,)
    assert timeline.labels == ((labelled, "load tiny"),)
    assert target.read_bytes().startswith(PNG_MAGIC)
    texts = [t.get_text() for t in timeline.figure.axes[0].texts]
    assert texts.count(" OOM") == 1 and "load tiny" in texts
    y = [v for v in timeline.figure.axes[0].get_lines()[0].get_ydata() if not math.isnan(v)]
    assert len(y) == len(timeline.cells)
    without_path = ip.run_line_magic("gpumem", "-o --plot")
    assert without_path.path is None and without_path.cells[-1] >= timeline.cells[-1]
    # issue 25: this terminal shell draws no pictures, so the plot says where one would go
    with capture_output() as shown:
        ip.run_line_magic("gpumem", "--plot")
    said = shown.outputs[-1].data["text/plain"]
    assert said.startswith("<Timeline cpu:") and "this terminal shows no pictures: %gpumem --plot PATH" in said
    assert "shows no pictures" not in repr(timeline)  # with a PATH it was saved: nothing to add


def test_gpumem_plot_errors_are_one_line_usage_errors(ip, tmp_path) -> None:
    with pytest.raises(UsageError, match="no cells recorded"):
        ip.run_line_magic("gpumem", "-o --plot")
    ip.run_cell("import torch", store_history=True)
    with pytest.raises(UsageError, match="could not save the timeline"):
        ip.run_line_magic("gpumem", f"-o --plot {tmp_path}/missing/dir/t.png")
    with pytest.raises(UsageError, match="unknown device"):
        ip.run_line_magic("gpumem", "-o --plot --device cuda:7")


def test_a_quoted_plot_path_is_the_path_without_its_quotes(ip, tmp_path) -> None:
    """IPython passes a magic's quoted argument on with its quotes (arg_split, posix=False): the
    timeline goes to the file named inside them, also with a space in the name (found on a real GPU)."""
    ip.run_cell("import torch\nx = torch.ones(1 << 20)", store_history=True)
    for quote, name in (('"', "run one.png"), ("'", "run two.png")):
        target = tmp_path / name
        timeline = ip.run_line_magic("gpumem", f"-o --plot {quote}{target}{quote}")
        assert timeline.path == str(target) and target.read_bytes().startswith(PNG_MAGIC)


def test_a_guardload_label_never_overlaps_the_oom_mark() -> None:
    """issue 25: a %%guardload cell that ran out of memory: its label and "OOM" are drawn apart (FAKE records)."""
    records = [CellRecord(1, "cuda:0", 0, 0, None, None, None, False, None, False),
               CellRecord(2, "cuda:0", 12 * GiB, 14 * GiB, None, None, None, True, "%%guardload", True),
               CellRecord(3, "cuda:0", 2 * GiB, 14 * GiB, None, None, None, False, "%%guardload", True)]
    timeline = plot_timeline(records, device="cuda:0")
    figure = timeline.figure
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = {t.get_text(): t for t in figure.axes[0].texts if t.get_text() == " OOM"}
    labels = [t for t in figure.axes[0].texts if t.get_text().startswith("%%guardload")]
    assert len(labels) == 2 and texts
    oom_box = texts[" OOM"].get_window_extent(renderer)
    assert not any(label.get_window_extent(renderer).overlaps(oom_box) for label in labels)
