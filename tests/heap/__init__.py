"""Shared by the heap tests."""
from __future__ import annotations

import gc
from typing import Any


def count_climbs(monkeypatch: Any) -> list[int]:
    """Count the ``gc.get_referrers`` climbs (a search for what holds a tensor or its parents) a scan
    makes from now on; the heap pass asks the tensor classes' referrers, which is no climb."""
    climbs: list[int] = []
    real = gc.get_referrers

    def counting(*targets: Any) -> list[Any]:
        if not all(isinstance(t, type) for t in targets):
            climbs.append(len(targets))
        return real(*targets)

    monkeypatch.setattr(gc, "get_referrers", counting)
    return climbs
