"""Turn records into JSON-ready dicts (int bytes, None where unknown)."""
from __future__ import annotations

from typing import Any

from ..records.data import record_dict
from ..records.snapshot import Snapshot

__all__ = ["record_dict", "snapshot_dict"]


def snapshot_dict(snap: Snapshot) -> dict[str, Any]:
    """Every figure of a snapshot, including the derived ones the tables show."""
    return snap.to_dict()
