"""A record as plain JSON-ready data (int bytes, None where unknown)."""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any


def record_dict(record: Any) -> Any:
    """A frozen dataclass (or tuple of them) as plain JSON-ready data."""
    if is_dataclass(record) and not isinstance(record, type):
        return {f.name: record_dict(getattr(record, f.name)) for f in fields(record)}
    if isinstance(record, (list, tuple)):
        return [record_dict(x) for x in record]
    if isinstance(record, dict):
        return {str(k): record_dict(v) for k, v in record.items()}
    return record
