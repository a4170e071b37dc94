"""The one error type the package raises for bad input, and how it quotes outside strings."""
from __future__ import annotations


class OomMagicError(ValueError):
    """Bad input (a size, a device, a checkpoint); the message is one line that says the fix."""


def one_line(text: object, limit: int = 300) -> str:
    """An outside string (a file name, a path) fit for a one-line message: control characters
    and lone surrogates escaped, cut to ``limit`` characters."""
    text = str(text)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."
