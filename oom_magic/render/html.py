"""Static HTML reports for notebooks and exports; every outside string is escaped."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..records.cleanup import FreeReport
from ..records.shown import renders
from ..records.snapshot import KernelInfo, Snapshot
from .segments import memory_segments
from .text import free_report_text, holder_kind_cell, process_resident, snapshot_text, usage_line
from .units import escape, format_bytes  # escape: html.escape, surrogate-safe

if TYPE_CHECKING:
    from ..records.device import ProcessInfo

COLORS = {"user": "#4c78a8", "stale": "#e45756", "other": "#b279a2", "untracked": "#9d755d",
          "cache": "#f2cf5b", "context": "#bab0ac", "process-rest": "#bab0ac", "others": "#72b7b2",
          "mapped": "#c6dbef", "free": "#e8e8e8"}


_DARK_TEXT = frozenset({"cache", "free", "context", "process-rest", "mapped"})  # light colours: dark labels on them


def bar_html(snap: Snapshot) -> str:
    """A stacked bar, one coloured span per segment, labelled where it is wide enough, its bytes on hover."""
    sized = [(s, s.bytes) for s in memory_segments(snap) if s.bytes]
    total = snap.reading.total or sum(size for _, size in sized) or 1
    spans = []
    for s, size in sized:
        width = max(100 * size / total, 0.3)
        label = escape(s.label) if width >= 12 else ""  # a label only where it can be read
        color = "#222" if s.key in _DARK_TEXT else "#fff"
        spans.append(
            f'<span class="oom-seg oom-seg-{s.key}" title="{escape(s.label)}: {format_bytes(s.bytes)} '
            f'({s.bytes:,} bytes) — {escape(s.explain)}" style="display:inline-block;height:16px;width:{width:.2f}%;'
            f'background:{COLORS.get(s.key, "#888")};color:{color};font-size:11px;line-height:16px;overflow:hidden;'
            f'text-overflow:ellipsis;vertical-align:top;text-indent:3px">{label}</span>')
    return (f'<div class="oom-bar" style="width:100%;max-width:640px;white-space:nowrap;overflow:hidden;'
            f'border:1px solid #ccc">{"".join(spans)}</div>')


def bar_legend_html(snap: Snapshot) -> str:
    """The bar's legend: each colour with its part's name and bytes; hover says what the part is."""
    items = "".join(
        f'<span class="oom-legend-item oom-legend-{s.key}" title="{escape(s.explain)} ({s.bytes:,} bytes)" '
        f'style="margin-right:12px;white-space:nowrap"><span style="display:inline-block;width:10px;height:10px;'
        f'margin-right:4px;vertical-align:middle;border:1px solid #999;background:{COLORS.get(s.key, "#888")}">'
        f'</span>{escape(s.label)} {escape(format_bytes(s.bytes))}</span>'
        for s in memory_segments(snap) if s.bytes)
    return f'<div class="oom-legend" style="font-size:12px;line-height:1.7;max-width:640px">{items}</div>'


def table_html(head: tuple[str, ...], rows: list[tuple[str, ...]], css_class: str = "oom-table",
               code_column: int | None = None) -> str:
    """A table whose header and cells line up: text columns left, figures right (escaped).

    JupyterLab right-aligns every table cell, so each cell says its alignment; ``code_column``
    is set in ``<code>`` (a holder's Python path).
    """
    align = ["right" if h in _FIGURE_COLUMNS else "left" for h in head]
    th = "".join(f"<th style='text-align:{a}'>{escape(h)}</th>" for h, a in zip(head, align))
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:{a}'>" + (f"<code>{escape(c)}</code>" if i == code_column
                                                            else escape(c)) + "</td>"
                         for i, (c, a) in enumerate(zip(row, align))) + "</tr>" for row in rows)
    return f"<table class='{css_class}'><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"




_FIGURE_COLUMNS = frozenset({"bytes", "storages", "pid"})


def _kernel_cell(p: ProcessInfo, kernel: KernelInfo | None) -> str:
    """The Jupyter kernel column: its notebook when this user's server names it, else yes or blank."""
    if kernel is not None and kernel.notebook_path:
        return kernel.notebook_path
    return "yes" if p.is_jupyter_kernel or kernel is not None else ""


def snapshot_html(snap: Snapshot) -> str:
    """The %gpumem report as HTML: usage line, bar, split, processes, top holders."""
    r = snap.reading
    parts = [f"<div class='oom-snapshot'><b>{escape(usage_line(r))}</b>", bar_html(snap)]
    split = f"this process ({process_resident(snap)})" if snap.device == "cpu" else "this process"
    parts.append(table_html((split, "bytes", "what it is"),
                            [(s.label, format_bytes(s.bytes), s.explain) for s in memory_segments(snap) if s.key != "free"]))
    if r.processes:
        kernels = dict(snap.kernels)
        head = ("pid", "process", "user", "Jupyter kernel", "bytes") + (("how to stop it",) if kernels else ())
        parts.append(table_html(head, [
            (str(p.pid), p.name or "?", p.user or "?", _kernel_cell(p, kernels.get(p.pid)), format_bytes(p.used_bytes))
            + ((kernels[p.pid].stop_hint if p.pid in kernels else "",) if kernels else ())
            for p in r.processes]))
    groups = snap.holders()
    if groups:
        shown = groups if snap.top_n <= 0 else groups[: snap.top_n]
        parts.append(table_html(("holder", "bytes", "dtype", "shape", "kind"), [
            (g.path, format_bytes(g.bytes), g.dtype, "×".join(map(str, g.shape)) or "scalar", holder_kind_cell(g))
            for g in shown]))
    notes = r.notes + snap.notes
    if notes:
        parts.append("<ul class='oom-notes'>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    parts.append(f"<small>{escape(snap.scan_summary())}</small></div>")
    return "".join(parts)


def free_report_html(report: FreeReport) -> str:
    """The %freeall report as HTML (the text report, escaped, in a pre block)."""
    return f"<pre class='oom-free'>{escape(free_report_text(report))}</pre>"


def _snapshot_shown_text(snap: Snapshot) -> str:
    # --json: the terminal and the notebook show the JSON text, and no HTML table.
    return snap.to_json_text() if snap.view == "json" else snapshot_text(snap)


def _snapshot_shown_html(snap: Snapshot) -> str | None:
    return None if snap.view == "json" else snapshot_html(snap)


renders(Snapshot, _snapshot_shown_text, _snapshot_shown_html)
renders(FreeReport, free_report_text, free_report_html)
