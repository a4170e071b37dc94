"""Draw memory over the executed cells (``%gpumem --plot``): allocated, reserved, per-cell peak.

matplotlib is imported when a timeline is drawn, never at import time, and pyplot is never used:
the figure is a bare ``matplotlib.figure.Figure`` on an Agg canvas, so drawing and saving work
headless and leave the user's backend and open figures alone.

On a GPU the lines are the allocator's allocated and reserved bytes after each cell and the
cell's peak allocated (where known). On cpu they are the process's resident set, its per-cell
peak, and the bytes of live tensors at cells after which a scan ran (cells that changed memory).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from ..common.errors import OomMagicError
from ..records.cell import CellRecord

OOM_COLOR = "#e45756"
LABEL_COLOR = "#666666"


@dataclass(frozen=True)
class Timeline:
    """The plotted series (int bytes per executed cell, None where unknown) and the figure."""

    device: str
    cells: tuple[int, ...]                   # x: execution counts
    series: tuple[tuple[str, tuple[int | None, ...]], ...]  # (legend label, one value per cell)
    oom_cells: tuple[int, ...]
    labels: tuple[tuple[int, str], ...]      # (execution count, %%guardload label)
    path: str | None                         # where the PNG was saved
    figure: Any = field(repr=False, compare=False)
    note: str | None = None                  # where the picture goes when this display cannot show it

    def values(self, name: str) -> tuple[int | None, ...]:
        """One series by its legend label ("allocated", "reserved", "peak", "RSS", ...)."""
        return dict(self.series)[name]

    def png(self) -> bytes:
        """The figure as PNG bytes."""
        import io

        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        return buffer.getvalue()

    def _repr_png_(self) -> bytes:
        return self.png()

    def __repr__(self) -> str:
        saved = f", saved to {self.path}" if self.path else ""
        shown = (f"<Timeline {self.device}: {len(self.cells)} cells, {len(self.oom_cells)} out of memory, "
                 f"{len(self.labels)} labelled{saved}>")
        return f"{shown}\n{self.note}" if self.note else shown


def _series(records: Sequence[CellRecord], device: str) -> tuple[tuple[str, tuple[int | None, ...]], ...]:
    if device == "cpu":
        return (("RSS", tuple(r.rss for r in records)),
                ("peak RSS", tuple(r.peak for r in records)),
                ("tensor bytes", tuple(r.tensor_bytes for r in records)))
    return (("allocated", tuple(r.allocated for r in records)),
            ("reserved", tuple(r.reserved for r in records)),
            ("peak", tuple(r.peak for r in records)))


def plot_timeline(records: Sequence[CellRecord], *, device: str | None = None, path: str | None = None,
                  dpi: int = 100) -> Timeline:
    """Plot the cells recorded on ``device`` (default: the last cell's) and save a PNG to ``path``."""
    if device is None:
        device = records[-1].device if records else None
    shown = [r for r in records if r.device == device and r.execution_count is not None]
    if not shown or device is None:
        raise OomMagicError(f"no cells recorded{' on ' + device if device else ''} yet: the timeline records each "
                            "cell run after torch is imported with the extension loaded; run a cell, then plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cells = tuple(r.execution_count or 0 for r in shown)  # every shown cell has its count (filtered above)
    series = _series(shown, device)
    figure = Figure(figsize=(8, 3.6), dpi=dpi)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot(1, 1, 1)
    unit_name, unit = _unit(max((v for _, vs in series for v in vs if v is not None), default=0))
    for name, values in series:
        points = [(x, v / unit) for x, v in zip(cells, values) if v is not None]
        if not points:
            continue
        if name.startswith("peak"):  # known for some cells only: a marker where known
            ax.plot(*zip(*points), label=name, marker="^", linestyle="none", markersize=6)
            continue
        xs, ys = _measured_runs(cells, values, unit)
        if name == "tensor bytes":  # measured at scanned cells only: joined only between neighbouring ones
            ax.plot(xs, ys, label=name, marker="s", markersize=4, linewidth=1.0, linestyle="--")
        else:
            ax.plot(xs, ys, label=name, marker="o", markersize=3, linewidth=1.5)
    oom_cells = tuple(x for x, r in zip(cells, shown) if r.oom)
    where = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for x in oom_cells:
        ax.axvline(x, color=OOM_COLOR, linestyle="--", linewidth=1.2)
        ax.text(x, 0.99, " OOM", color=OOM_COLOR, transform=where, ha="left", va="top", fontsize=8)
    labels = tuple((x, r.label) for x, r in zip(cells, shown) if r.label)
    for x, label in labels:
        if x not in oom_cells:  # an out-of-memory cell has its line already
            ax.axvline(x, color=LABEL_COLOR, linestyle=":", linewidth=1.0)
        # At the foot of the line, left of it: "OOM" sits at its head, right of it, so the two never meet.
        ax.text(x, 0.02, _plain(label), rotation=90, color=LABEL_COLOR, transform=where, ha="right",
                va="bottom", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("execution count")
    ax.set_ylabel(unit_name)
    ax.set_title(f"{device}: memory after each cell", fontsize=10)
    ax.set_ylim(0, max(ax.get_ylim()[1], 1) * 1.12)  # headroom for the OOM and label marks
    ax.grid(True, alpha=0.3)
    if ax.get_lines():
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    saved = _save(figure, path) if path else None
    return Timeline(device, cells, series, oom_cells, labels, saved, figure)


def _measured_runs(cells: Sequence[int], values: Sequence[int | None], unit: int) -> tuple[list[float], list[float]]:
    """A series' points in the axis unit, broken (NaN) at unmeasured cells and where cells were not recorded,
    so the line joins only cells measured one after the other."""
    xs: list[float] = []
    ys: list[float] = []
    previous: int | None = None
    for x, v in zip(cells, values):
        if previous is not None and x > previous + 1:
            xs.append((previous + x) / 2)  # cells between were not recorded: the line stops here
            ys.append(math.nan)
        xs.append(x)
        ys.append(math.nan if v is None else v / unit)
        previous = x
    return xs, ys


def _unit(largest: int) -> tuple[str, int]:
    """The binary unit the y axis counts in, so its ticks are round numbers of it."""
    for name, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if largest >= 1024 ** power:
            return name, 1024 ** power
    return "bytes", 1


def _plain(text: str) -> str:
    """Show a label as typed: "$" would start matplotlib's mathtext."""
    return str(text).replace("$", r"\$")


def _save(figure: Any, path: str) -> str:
    target = os.path.expanduser(str(path))
    try:
        figure.savefig(target, format="png")
    except OSError as exc:
        raise OomMagicError(f"could not save the timeline to {path!r}: {exc.strerror or exc}; "
                            "give a path in a folder you can write to") from None
    return target
