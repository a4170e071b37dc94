"""The one error type the pure core raises for bad input."""
from __future__ import annotations


class OomMagicError(ValueError):
    """Bad input (a size, a device, a checkpoint); the message is one line that says the fix."""
