"""One out-of-memory message as PyTorch printed it, read into int bytes (``oom.py`` parses it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .shown import Shown

__all__ = ["Backend", "OOMMessage"]

Backend = Literal["cuda", "hip", "xpu", "mps", "cpu"]


@dataclass(frozen=True)
class OOMMessage(Shown):
    """One out-of-memory error as PyTorch printed it: which device, what was asked, what was held.

    All figures are int bytes, rounded from PyTorch's two-decimal print, or None where the message
    does not give them. For MPS, `total` is the "max allowed" limit and `allocated` is
    "MPS allocated".
    """

    backend: Backend
    device_index: int | None
    requested: int | None
    total: int | None
    free: int | None
    allocated: int | None  # allocated by PyTorch
    reserved_unallocated: int | None  # reserved by PyTorch but unallocated (the cache)
    reserved_total: int | None  # reserved in total by PyTorch
    this_process: int | None  # "Including non-PyTorch memory, this process has M memory in use"
    processes: tuple[tuple[int, int], ...]  # (pid, bytes) from "Process P has M memory in use."
    other_allocations: int | None  # MPS "other allocations"
    pool: str | None  # MPS 'private' | 'shared'
    text: str = field(repr=False)  # the one OOM message as found, whitespace normalised
    allowed: int | None = None  # "X allowed;": the cap set_per_process_memory_fraction put on this process
