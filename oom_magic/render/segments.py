"""Name the parts of a device's memory (``Snapshot.parts``) for the bar and the tables, in their fixed order."""
from __future__ import annotations

from dataclasses import dataclass

from ..records.snapshot import SegmentKey, Snapshot


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
                     "this process's resident memory outside tensors (Python objects, libraries)"),
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
    "free": ("free", "available"),
}


def memory_segments(snap: Snapshot) -> tuple[Segment, ...]:
    """user | stale | other tensors | untracked | cache | context | other processes | free."""
    words = _CPU_WORDS if snap.device == "cpu" else _WORDS
    segments = []
    for key, size in snap.parts():
        label, explain = _QUICK_UNTRACKED if key == "untracked" and not snap.heap_scan else words[key]
        segments.append(Segment(key, label, size, explain))
    return tuple(segments)
