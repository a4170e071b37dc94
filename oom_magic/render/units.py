"""Format int bytes for people: the only place bytes become KiB/MiB/GiB."""
from __future__ import annotations

import re


def format_bytes(n: int | None, *, signed: bool = False) -> str:
    """Format bytes as "12.55 GiB" (powers of 1024); None reads "n/a"."""
    if n is None:
        return "n/a"
    sign = ("+" if n > 0 else "-" if n < 0 else "") if signed else ("-" if n < 0 else "")
    value: float = abs(int(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# Control characters, lone surrogates, line and paragraph separators and bidi/format controls:
# shown as escapes, so outside text (a path, a name, a message) stays on its one line and can
# neither forge another line nor break UTF-8 serialisation.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff"
                     "\ud800-\udfff]")


def one_line(text: object) -> str:
    """Outside text for a text report: on one line, control characters and lone surrogates escaped."""
    text = str(text)
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text) if _UNSAFE.search(text) else text


def surrogate_safe(text: str) -> str:
    """Text that encodes to UTF-8: a lone surrogate (an odd attribute or file name) shown as its
    escape, for HTML and JSON sent to the front end; everything else unchanged."""
    return _SURROGATE.sub(lambda m: ascii(m.group())[1:-1], text) if _SURROGATE.search(text) else text


_SURROGATE = re.compile("[\ud800-\udfff]")


def escape(text: str, quote: bool = True) -> str:
    """html.escape that also keeps the result encodable: lone surrogates shown as escapes (a kernel
    sends its output as UTF-8, and one odd attribute name would fail the whole message)."""
    import html

    return surrogate_safe(html.escape(text, quote))
