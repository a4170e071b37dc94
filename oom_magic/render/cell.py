"""Words for the after-cell memory view: its caption, button label, details, and static exports.

The live widget (``oom_magic.notebook.widget``) shows these strings; ``cell_text``/``cell_html`` are the
text/plain and text/html it leaves beside the widget view, so terminals, nbconvert and GitHub
show the same figures. Every outside string (holder paths, process names, notes) is escaped.
"""
from __future__ import annotations

from ..records.cell import CellReport, WatchStatus
from ..records.cleanup import FreeReport
from ..records.shown import renders
from ..records.snapshot import STALE_KINDS, Snapshot
from .html import bar_html, bar_legend_html, table_html
from .segments import memory_segments
from .text import bar, freed_mapped_text, holder_kind_cell, table
from .units import escape, format_bytes, one_line  # escape: html.escape, surrogate-safe

DETAIL_HOLDERS = 5


def cell_caption(report: CellReport, *, pinned: bool = False, as_of: bool = False) -> str:
    """``cuda:0 · 14.20 GiB / 15.78 GiB used · this cell +12.60 GiB (peak +13.10 GiB) · stale 1.20 GiB``.

    ``as_of``: a newer cell has run since, so the figures are said to be those of this cell's end
    (``as of In [12] · ...``), or of the last click on the widget's button (``as of the click``).
    """
    snap, change = report.snapshot, report.change
    r = snap.reading
    parts = []
    if as_of and not pinned and report.freed is not None:
        parts.append("as of the click")  # the button refreshed the figures after the cell ran
    elif (pinned or as_of) and change is not None and change.execution_count is not None:
        parts.append(f"{'as of ' if as_of and not pinned else ''}In [{change.execution_count}]")
    parts.append(snap.device)
    parts.append(f"{format_bytes(r.used)} / {format_bytes(r.total)} used")
    if change is not None and change.delta is not None:
        what = " RSS" if change.device == "cpu" else ""
        text = f"this cell{what} {format_bytes(change.delta, signed=True)}"
        if change.peak_delta is not None:
            text += f" (peak {format_bytes(change.peak_delta, signed=True)})"
        parts.append(text)
    if change is not None and change.variable_delta:
        parts.append(f"variables {format_bytes(change.variable_delta, signed=True)}")
    if change is not None and change.oom:
        parts.append("out of memory")
    # The quick view (no heap scan) sees the output cache and tracebacks, not garbage.
    pages = snap.file_pages
    mapped = sum(pages.kind_bytes(k) for k in STALE_KINDS) if pages is not None else 0
    parts.append(f"stale {format_bytes(snap.stale_bytes)}" + ("" if snap.heap_scan else " (quick view)")
                 + (f" ({format_bytes(mapped)} of it file pages)" if mapped else ""))
    if report.freed is not None:
        freed_mapped = report.freed.freed_mapped
        parts.append(f"freed {format_bytes(report.freed.freed_bytes)}"
                     + (f" ({format_bytes(freed_mapped)} of it file pages: no memory back)" if freed_mapped else ""))
    return " · ".join(parts)


def free_button_label(stale_bytes: int) -> str:
    """``Free stale tensors (1.20 GiB)``."""
    return f"Free stale tensors ({format_bytes(stale_bytes)})"


def freed_line(freed: FreeReport) -> str:
    """``freed 1.20 GiB (output-cache 1.20 GiB)`` and the cleanup's notes, in one line."""
    kinds = ", ".join(f"{k} {format_bytes(b)}" for k, b in freed.freed_by_kind if b)
    line = f"freed {format_bytes(freed.freed_bytes)}" + (f" ({kinds})" if kinds else "")
    mapped = freed_mapped_text(freed)
    return "; ".join([line, *([mapped] if mapped else []), *freed.notes])


def cell_details_html(snap: Snapshot, top: int = DETAIL_HOLDERS) -> str:
    """Top holders with their paths, other processes (Jupyter kernels flagged) and notes, escaped."""
    parts = []
    groups = snap.holders()
    if groups:
        parts.append(f"<div><b>top holders</b> ({min(top, len(groups))} of {len(groups)})</div>")
        parts.append(table_html(("holder", "bytes", "dtype", "shape", "kind"), [
            (g.path, format_bytes(g.bytes), g.dtype, _shape(g.shape), holder_kind_cell(g)) for g in groups[:top]],
            "oom-holders", code_column=0))
    else:
        parts.append("<div>no tensors on this device</div>")
    processes = snap.reading.processes
    if processes:
        parts.append("<div><b>other processes</b></div>")
        parts.append(table_html(("pid", "process", "user", "kernel", "bytes", "note"), [
            (str(p.pid), p.name or "?", p.user or "?", "Jupyter kernel" if p.is_jupyter_kernel else "",
             format_bytes(p.used_bytes), p.note or "") for p in processes], "oom-processes"))
    notes = snap.reading.notes + snap.notes
    if notes:
        parts.append("<ul class='oom-notes'>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    return "".join(parts)


def cell_bar_html(snap: Snapshot) -> str:
    """The widget's bar with its legend (the same in the live widget and the static view)."""
    return bar_html(snap) + bar_legend_html(snap)


def cell_html(report: CellReport, *, pinned: bool = False, as_of: bool = False) -> str:
    """The view as static HTML: caption, bar and legend, what a cleanup freed, and collapsible details."""
    freed = f"<div class='oom-freed'>{escape(freed_line(report.freed))}</div>" if report.freed else ""
    caption = cell_caption(report, pinned=pinned, as_of=as_of)
    return (f"<div class='oom-cell'><div class='oom-caption'>{escape(caption)}</div>"
            f"{cell_bar_html(report.snapshot)}{freed}<details><summary>details</summary>"
            f"{cell_details_html(report.snapshot)}</details></div>")


def cell_text(report: CellReport, *, pinned: bool = False, as_of: bool = False) -> str:
    """The view as plain text: caption, a text bar, top holders, and how to free stale memory."""
    snap = report.snapshot
    segments = memory_segments(snap)
    lines = [cell_caption(report, pinned=pinned, as_of=as_of), bar(segments, snap.reading.total) + "  "
             + "  ".join(f"{s.label} {format_bytes(s.bytes)}" for s in segments if s.bytes)]
    if report.freed is not None:
        lines.append(freed_line(report.freed))
    groups = snap.holders()[:DETAIL_HOLDERS]
    lines += table((g.path, format_bytes(g.bytes), g.kind) for g in groups)
    if snap.stale_bytes:
        lines.append(f"%freeall frees the {format_bytes(snap.stale_bytes)} of stale tensors")
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def watch_status_text(status: WatchStatus) -> str:
    """``after-cell memory view: changes (≥ 1.00 MiB on a GPU, ≥ 16.00 MiB on cpu) · 3 cells recorded``."""
    if not status.enabled:
        mode = "off after an error (%gpumem --auto changes turns it back on)"
    elif status.pinned:
        mode = "one pinned widget, updated after each cell that changes memory"
    else:
        mode = {"changes": "a widget under each cell that changes memory",
                "always": "a widget under every cell", "off": "off"}.get(status.mode, status.mode)
    return (f"after-cell memory view: {mode} (threshold {format_bytes(status.thresholds.gpu)} on a GPU, "
            f"{format_bytes(status.thresholds.cpu)} on cpu; {status.live_widgets} live widgets kept) · "
            f"{status.cells_recorded} cells recorded")


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


renders(CellReport, cell_text, cell_html)
renders(WatchStatus, watch_status_text)
