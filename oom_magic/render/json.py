"""Turn records into JSON-ready dicts (int bytes, None where unknown)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .segments import memory_segments

if TYPE_CHECKING:
    from ..snapshot import Snapshot


def record_dict(record: Any) -> Any:
    """A frozen dataclass (or tuple of them) as plain JSON-ready data."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: record_dict(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (list, tuple)):
        return [record_dict(x) for x in record]
    if isinstance(record, dict):
        return {str(k): record_dict(v) for k, v in record.items()}
    return record


def snapshot_dict(snap: Snapshot) -> dict[str, Any]:
    """Every figure of a snapshot, including the derived ones the tables show."""
    reading = record_dict(snap.reading)
    reading.update(cache=snap.reading.cache, context=snap.reading.context)
    return {
        "device": snap.device,
        "reading": reading,
        "bytes_by_kind": dict(snap.bytes_by_kind),
        "user_bytes": snap.user_bytes,
        "stale_bytes": snap.stale_bytes,
        "other_bytes": snap.other_bytes,
        "tracked_bytes": snap.tracked_bytes,
        "untracked_bytes": snap.untracked_bytes,
        "user_mapped_bytes": snap.user_mapped_bytes,  # cpu: of user, views of a memory-mapped file
        "segments": {s.key: s.bytes for s in memory_segments(snap)},
        "holders": record_dict(snap.holders()),
        "storages": record_dict(snap.storages),
        "scan_seconds": snap.scan_seconds,
        "objects_scanned": snap.objects_scanned,
        "attribution_complete": snap.attribution_complete,
        "notes": list(snap.notes),
        "heap_scan": snap.heap_scan,
        "jupyter_kernels": {str(pid): record_dict(info) for pid, info in snap.kernels},
    }
