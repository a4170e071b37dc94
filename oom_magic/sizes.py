"""Parse sizes the user types ("16GiB", "15360MiB", "1.5G", "1024") into int bytes."""
from __future__ import annotations

import re

from .errors import OomMagicError

_UNITS = {
    "": 1, "b": 1, "bytes": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)  # ASCII digits only
_LARGEST = 2**64  # no device or machine has 16 EiB: a bigger figure is a typo


def parse_size(text: str) -> int:
    """Turn "16GiB" / "512 MiB" / "2G" / "1024" into bytes; units are powers of 1024."""
    typed = str(text)
    match = _SIZE.match(typed)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        shown = _short(typed) if isinstance(text, str) else repr(text)
        raise OomMagicError(
            f"cannot read size {shown}: write a number with a unit such as 512MiB, 16GiB or 2TiB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not value < _LARGEST:  # also catches inf from a figure with hundreds of digits
        raise OomMagicError(f"size {_short(typed)} is larger than any device (16 EiB): check the number and its unit")
    return int(value)


def _short(text: str, limit: int = 40) -> str:
    """repr() of what the user typed, cut to a short line."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
