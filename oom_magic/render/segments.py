"""Split a device's memory into the parts the bar and the tables show, in one fixed order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..snapshot import Snapshot


@dataclass(frozen=True)
class Segment:
    """One part of the device: what it is, its bytes (None if unknown) and a one-line why."""

    key: str
    label: str
    bytes: int | None
    explain: str


def memory_segments(snap: Snapshot) -> tuple[Segment, ...]:
    """user | stale | other tensors | untracked | cache | context | other processes | free."""
    r = snap.reading
    parts = [
        Segment("user", "user", snap.user_bytes, "tensors reachable from your variables"),
        Segment("stale", "stale", snap.stale_bytes,
                "held only by the output cache, a stored traceback or garbage: %freeall gives it back"),
        Segment("other", "other tensors", snap.other_bytes,
                "tensors held by something that is not a variable of yours (a library global, a hidden object)"),
    ]
    if snap.device == "cpu":
        rest = None if r.process_used is None else max(r.process_used - snap.tracked_bytes, 0)
        parts.append(Segment("process-rest", "rest of this process", rest,
                             "this process's resident memory outside tensors (Python objects, libraries)"))
        elsewhere = None
        if r.used is not None and r.process_used is not None:
            elsewhere = max(r.used - max(r.process_used, snap.tracked_bytes), 0)
        parts.append(Segment("others", "other processes", elsewhere, "used by the rest of the system"))
    else:
        untracked = (Segment("untracked", "untracked", snap.untracked_bytes,
                             "allocated by PyTorch but in no tensor Python can see (autograd graph, workspaces)")
                     if snap.heap_scan else
                     Segment("untracked", "not attributed (quick view)", snap.untracked_bytes,
                             "allocated by PyTorch but not reached from your variables, the output cache or "
                             "tracebacks: garbage, a library's tensors or the autograd graph; %gpumem says which"))
        parts += [
            untracked,
            Segment("cache", "cache", r.cache,
                    "reserved by PyTorch but unallocated: torch.cuda.empty_cache() returns it"),
            Segment("context", "context/non-PyTorch", r.context,
                    "this process's device memory outside PyTorch's allocator (CUDA context, libraries)"),
            Segment("others", "other processes", r.other_processes_used, "held by other processes on this device"),
        ]
    parts.append(Segment("free", "free", r.free, "free on the device" if snap.device != "cpu" else "available"))
    return tuple(parts)
