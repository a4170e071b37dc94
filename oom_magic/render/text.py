"""Aligned plain-text reports for terminals and text/plain exports."""
from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Iterable

from ..records.cleanup import FreeReport, StillHeld
from ..records.shown import renders
from ..records.snapshot import STALE_KINDS, HolderGroup, KernelInfo, Snapshot
from .segments import Segment, memory_segments
from .units import format_bytes, one_line

if TYPE_CHECKING:
    from ..records.device import DeviceReading
    from ..records.device import ProcessInfo

BAR_WIDTH = 40
_BAR_CHARS = {"user": "█", "stale": "▓", "other": "▒", "untracked": "░", "cache": "▚",
              "context": "▞", "process-rest": "▞", "others": "■", "mapped": "▁", "free": "·"}


def usage_line(reading: DeviceReading) -> str:
    """``cuda:0 NVIDIA H200 · 14.20 GiB used of 15.78 GiB · 1.58 GiB free``."""
    name = f" {reading.name}" if reading.name else ""
    free_word = "available" if reading.device == "cpu" else "free"
    return (f"{reading.device}{name} · {format_bytes(reading.used)} used of {format_bytes(reading.total)}"
            f" · {format_bytes(reading.free)} {free_word}")


def bar(segments: Iterable[Segment], total: int | None, width: int = BAR_WIDTH) -> str:
    """A one-line bar with one character run per segment, proportional to bytes."""
    segs = [s for s in segments if s.bytes]
    whole = total or sum(s.bytes or 0 for s in segs) or 1
    out = ""
    for s in segs:
        out += _BAR_CHARS.get(s.key, "#") * round(width * (s.bytes or 0) / whole)
    return "[" + out[:width].ljust(width, " ") + "]"


def table(rows: Iterable[tuple[str, ...]], indent: str = "  ", *, text_last: bool = False) -> list[str]:
    """Left-align the first column, right-align the rest (``text_last``: the last one is words, set left)."""
    rows = [tuple(map(one_line, r)) for r in rows]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        if text_last and len(r) > 1:
            cells[-1] = r[-1]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def snapshot_text(snap: Snapshot) -> str:
    """The %gpumem report: usage line, bar, this process split, other processes, top holders."""
    r = snap.reading
    segments = memory_segments(snap)
    lines = [usage_line(r), bar(segments, r.total) + "  " + "  ".join(
        f"{_BAR_CHARS.get(s.key, '#')} {s.label}" for s in segments if s.bytes)]
    lines.append("this process" + (f" ({process_resident(snap)})" if snap.device == "cpu" else ""))
    lines += table(((s.label, format_bytes(s.bytes), s.explain) for s in segments if s.key != "free"), text_last=True)
    stale_parts = [(k, b) for k, b in snap.bytes_by_kind if k in STALE_KINDS and b]
    if stale_parts:
        pages = snap.file_pages
        mapped = sum(pages.kind_bytes(k) for k, _ in stale_parts) if pages is not None else 0
        lines.append("  stale is " + ", ".join(f"{k} {format_bytes(b)}" for k, b in stale_parts)
                     + (f" ({format_bytes(mapped)} of it file pages, not in the bar)" if mapped else ""))
    if r.processes:
        kernels = dict(snap.kernels)
        lines.append("other processes")
        lines += table((f"pid {p.pid}", _process_label(p, kernels.get(p.pid)), format_bytes(p.used_bytes))
                       for p in r.processes)
        lines += [f"  to stop pid {pid}: {info.stop_hint}" for pid, info in kernels.items()]
    groups = snap.holders()
    if groups:
        shown = groups if snap.top_n <= 0 else groups[: snap.top_n]
        lines.append(f"top holders ({len(shown)} of {len(groups)})")
        lines += table(((g.path, format_bytes(g.bytes), g.dtype, "×".join(map(str, g.shape)) or "scalar",
                         holder_kind_cell(g)) for g in shown), text_last=True)
    lines.append(snap.scan_summary())
    lines += [f"note: {n}" for n in r.notes + snap.notes]
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def process_resident(snap: Snapshot) -> str:
    """cpu: ``764.36 MiB resident, 120.00 MiB of it file pages`` (file pages count as available, not used)."""
    r, pages = snap.reading, snap.file_pages
    text = f"{format_bytes(r.process_used)} resident"
    if pages is not None and pages.process_file_resident:
        text += f", {format_bytes(pages.process_file_resident)} of it file pages"
    return text


def holder_kind_cell(group: HolderGroup) -> str:
    """The holder table's kind: ``user``, or ``user, file-mapped`` when its tensors are views of a file."""
    if not group.mapped_bytes:
        return group.kind
    if group.mapped_bytes >= group.bytes:
        return f"{group.kind}, file-mapped"
    return f"{group.kind}, {format_bytes(group.mapped_bytes)} file-mapped"


def _process_label(p: ProcessInfo, kernel: KernelInfo | None = None) -> str:
    parts = [p.name or "?"]
    if p.user:
        parts.append(f"user {p.user}")
    if kernel is not None and kernel.notebook_path:
        parts.append(f"Jupyter kernel of {kernel.notebook_path}")
    elif p.is_jupyter_kernel or kernel is not None:
        parts.append("Jupyter kernel")
    if p.note:
        parts.append(p.note)
    return ", ".join(parts)


def free_report_text(report: FreeReport) -> str:
    """The %freeall report: what was given back, by holder kind, and the reading before → after."""
    verb = "would free" if report.dry_run else "freed"
    lines = []
    for name in report.deleted:
        lines.append(f"deleted `{name}`")
    lines.append(f"{verb} {format_bytes(report.freed_bytes)} on {report.device}"
                 + (" (" + ", ".join(f"{k} {format_bytes(b)}" for k, b in report.freed_by_kind if b) + ")"
                    if any(b for _, b in report.freed_by_kind) else ""))
    mapped = freed_mapped_text(report)
    if mapped:
        lines.append(mapped)
    back = report.resident_freed
    own = report.freed_bytes - (report.freed_mapped or 0)  # what could come back: the mapped part never was resident
    if back is not None and own > 0 and back < own - max(own // 20, 1 << 20):
        # cpu: weights mapped from a safetensors file were never resident; say what really came back
        # (only when it differs by more than the allocator's usual slack: the next line has both figures).
        lines.append(f"resident memory that came back: {format_bytes(max(back, 0))} of those "
                     f"{format_bytes(own)} (the rest was mapped from a file, or the C allocator keeps it)")
    for held in report.still_held:
        lines.append(still_held_text(held))
    before, after = report.before, report.after
    if report.device == "cpu" and before.process_used is not None and after.process_used is not None:
        # The machine's total moves with every other process: this process's resident memory is what freeing moved.
        lines.append(f"cpu: this process's resident memory {format_bytes(before.process_used)} → "
                     f"{format_bytes(after.process_used)}")
    else:
        lines.append(f"{report.device}: {format_bytes(before.used)} → {format_bytes(after.used)} used"
                     + (f"; this process {format_bytes(before.process_used)} → {format_bytes(after.process_used)}"
                        if before.process_used is not None else ""))
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def freed_mapped_text(report: FreeReport) -> str | None:
    """cpu: ``150.00 MiB of those were views of a memory-mapped file: file pages, no memory came back for them``."""
    if not report.freed_mapped:
        return None
    verb = "would be" if report.dry_run else "were"
    back = "would come" if report.dry_run else "came"
    return (f"{format_bytes(report.freed_mapped)} of those {verb} views of a memory-mapped file: file pages "
            f"(counted as available), so no memory {back} back for them")


def still_held_text(held: StillHeld) -> str:
    """"`model` deleted; its 12.55 GiB are still held by `model2` and `opt.state`"."""
    names = [f"`{h}`" for h in held.holders]
    joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"`{held.name}` deleted; its {format_bytes(held.bytes)} are still held by {joined}"


renders(StillHeld, still_held_text)
