"""Format int bytes for people: the only place bytes become KiB/MiB/GiB."""
from __future__ import annotations


def format_bytes(n: int | None, *, signed: bool = False) -> str:
    """Format bytes as "12.55 GiB" (powers of 1024); None reads "n/a"."""
    if n is None:
        return "n/a"
    sign = ("+" if n > 0 else "-" if n < 0 else "") if signed else ("-" if n < 0 else "")
    value = abs(int(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{value} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
