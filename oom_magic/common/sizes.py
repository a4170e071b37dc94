"""Read sizes the user types ("16GiB", "15360MiB", "1.5G", "1024", a "5%" headroom) into int bytes.

Its messages quote what was typed through ``quoted``; ``shorten`` is the same cut for any outside
text a message repeats (a call's source, a value's repr), so every message shortens one way.
"""
from __future__ import annotations

import math
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
DEFAULT_HEADROOM = "5%"


def parse_size(text: str) -> int:
    """Turn "16GiB" / "512 MiB" / "2G" / "1024" into bytes; units are powers of 1024."""
    typed = str(text)
    match = _SIZE.match(typed)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        shown = quoted(typed) if isinstance(text, str) else repr(text)
        raise OomMagicError(
            f"cannot read size {shown}: write a number with a unit such as 512MiB, 16GiB or 2TiB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not value < _LARGEST:  # also catches inf from a figure with hundreds of digits
        raise OomMagicError(f"size {quoted(typed)} is larger than any device (16 EiB): check the number and its unit")
    return int(value)


def parse_headroom(spec: str | int | None, base: int | None) -> int:
    """Turn a headroom ("5%", "2GiB", 1024, None = 5%) into bytes; percentages are of ``base``."""
    if spec is None:
        spec = DEFAULT_HEADROOM
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise OomMagicError(f"headroom must be 0 or more, not {spec}")
        return spec
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100 or math.isnan(percent):
            raise OomMagicError(f"cannot read headroom {text!r}: write a percentage from 0% to 99% or a size such as 2GiB")
        return int((base or 0) * percent / 100)
    try:
        return parse_size(text)
    except OomMagicError:
        raise OomMagicError(f"cannot read headroom {text!r}: write a size such as 512MiB or 2GiB, "
                            "or a percentage of the device such as 5%") from None


def shorten(text: str, limit: int = 80) -> str:
    """Outside text on one short line: runs of whitespace become one space, a longer text ends in "…"."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def quoted(text: str, limit: int = 40) -> str:
    """repr() of what the user typed (or a file holds), cut to ``limit`` characters and "..."."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
