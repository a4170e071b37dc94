"""Name the parts of a device's memory (``Snapshot.parts``) for the bar and the tables, in their fixed order."""
from __future__ import annotations

from dataclasses import dataclass

from ..records.snapshot import SegmentKey, Snapshot
from .units import format_bytes


@dataclass(frozen=True)
class Segment:
    """One part of the device: what it is, its bytes (None if unknown) and a one-line why."""

    key: SegmentKey
    label: str
    bytes: int | None
    explain: str


# key -> (label, why), for every part but the quick view's untracked and cpu's free.
_WORDS: dict[SegmentKey, tuple[str, str]] = {
    "user": ("user", "tensors reachable from your variables"),
    "stale": ("stale", "held only by the output cache, a stored traceback or garbage: %freeall gives it back"),
    "other": ("other tensors",
              "tensors held by something that is not a variable of yours (a library global, a hidden object)"),
    "process-rest": ("rest of this process",
                     "this process's anonymous memory outside tensors (Python objects, allocator caches)"),
    "untracked": ("untracked", "allocated by PyTorch but in no tensor Python can see (autograd graph, workspaces)"),
    "cache": ("cache", "reserved by PyTorch but unallocated: torch.cuda.empty_cache() returns it"),
    "context": ("context/non-PyTorch",
                "this process's device memory outside PyTorch's allocator (CUDA context, libraries)"),
    "others": ("other processes", "held by other processes on this device"),
    "free": ("free", "free on the device"),
}
_QUICK_UNTRACKED = ("not attributed (quick view)",
                    "allocated by PyTorch but not reached from your variables, the output cache or "
                    "tracebacks: garbage, a library's tensors or the autograd graph; %gpumem says which")
_CPU_WORDS: dict[SegmentKey, tuple[str, str]] = {
    **_WORDS,
    "others": ("other processes", "used by the rest of the system"),
    "free": ("free", "available, beyond the file pages"),
}


def memory_segments(snap: Snapshot) -> tuple[Segment, ...]:
    """user | stale | other tensors | untracked | cache | context | other processes | free
    (cpu: user | stale | other tensors | rest of this process | other processes | file pages | free)."""
    words = _CPU_WORDS if snap.device == "cpu" else _WORDS
    segments = []
    for key, size in snap.parts():
        if key == "mapped":
            label, explain = "file pages", _file_pages_explain(snap)
        elif key == "user" and snap.user_mapped_bytes:
            label, explain = "user", (f"{words[key][1]}, in this process's own memory (the "
                                      f"{format_bytes(snap.user_mapped_bytes)} mapped from files are file pages)")
        else:
            label, explain = _QUICK_UNTRACKED if key == "untracked" and not snap.heap_scan else words[key]
        segments.append(Segment(key, label, size, explain))
    return tuple(segments)


def _file_pages_explain(snap: Snapshot) -> str:
    """What the mapped part is: this process's file pages in memory now, counted as available, and what maps them."""
    why = "the kernel can drop them, so they count as available, not used"
    pages = snap.file_pages
    if pages is None or not pages.mapped_bytes:
        return f"this process's file pages in memory now (its libraries, mapped files); {why}"
    files = f"{pages.files} file{'s' if pages.files != 1 else ''}"
    of_them = "" if pages.resident is None else f", {format_bytes(pages.resident)} of it in memory"
    return (f"this process's file pages in memory now: {format_bytes(pages.mapped_bytes)} of tensors view "
            f"{format_bytes(pages.file_bytes)} of {files}{of_them} (weights in their stored dtype), and its "
            f"libraries; {why}")
