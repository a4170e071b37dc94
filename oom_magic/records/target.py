"""A deployment GPU a load is sized for, and the memory cap that imitates it on a larger device.

Made by ``fit.targets`` from ``data/gpus.json``; held by the preflight and guard records.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cap", "Target"]


@dataclass(frozen=True)
class Target:
    """A GPU a load is rehearsed for: its total memory and what PyTorch can allocate on it (int bytes)."""

    name: str             # "T4", "A100-80GB", or the size as typed ("16GiB")
    total: int            # as the driver reports it (nvidia-smi / NVML; HIP total for AMD)
    usable: int           # what this process's PyTorch allocator can hold there: total - context_reserve
    context_reserve: int  # kept by the driver plus this process's CUDA context (assumed; see source)
    source: str           # where the figures come from, with the assumptions made
    compute_capability: tuple[int, int] | None = None  # NVIDIA's (major, minor); None: not NVIDIA, or not recorded

    @property
    def native_bf16(self) -> bool | None:
        """Whether the GPU computes in bfloat16 natively (NVIDIA: compute capability 8.0+); None when unknown."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)

    def __repr__(self) -> str:
        return f"Target({self.name!r}, total={self.total}, usable={self.usable})"


@dataclass(frozen=True)
class Cap:
    """A memory fraction set on one device for a block, and the fraction put back afterwards."""

    device_index: int
    fraction: float
    previous: float | None  # None: this torch has no getter, so the previous fraction is unknown
    restore_to: float       # previous, or 1.0 (torch's default: no cap) when it was unknown
