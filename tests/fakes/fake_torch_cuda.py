"""FAKE ``torch.cuda`` memory-fraction surface: stands in for an absent CUDA device in tests of the cap.

This is a fake, for tests only. It mirrors what PyTorch 2.13's caching allocator does
(c10/cuda/CUDACachingAllocator.cpp and torch/cuda/memory.py):

- ``set_per_process_memory_fraction(fraction, device)`` raises TypeError unless ``fraction`` is a
  float and ValueError outside [0, 1]; below 1.0 it sets ``allowed_memory_maximum =
  size_t(fraction * totalGlobalMem)`` (C++ truncation), and 1.0 clears the cap;
- ``get_per_process_memory_fraction(device)`` returns ``allowed / totalGlobalMem``, or 1.0 when no
  cap is set (absent in torch before 2.9: ``FakeTorchCuda(has_getter=False)``);
- the cap is checked against the allocator's *reserved* total (``total_allocated_memory``, every
  segment cudaMalloc'd, cache included) before a new segment is allocated; cached blocks are
  reused without touching the cap, and when the cap is hit the allocator frees its cache and
  retries once before raising OutOfMemoryError.
Allocation is modelled per call (one block per request, no rounding or splitting).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class FakeOutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError."""


@dataclass
class _Device:
    total: int
    allowed: int | None = None
    reserved: int = 0      # total_allocated_memory: segments held, cache included
    allocated: int = 0     # live tensors
    set_calls: list[float] = field(default_factory=list)


class FakeTorchCuda:
    """A stand-in for ``torch.cuda`` with one or more devices of the given totals (bytes)."""

    def __init__(self, *totals: int, has_getter: bool = True, fail_restore: bool = False) -> None:
        self._devices = [_Device(total) for total in totals]
        self._fail_on_second_set = fail_restore
        self._has_getter = has_getter

    def __getattribute__(self, name: str):
        # torch < 2.9 has no public getter: the attribute is absent there, not None.
        if name == "get_per_process_memory_fraction" and not object.__getattribute__(self, "_has_getter"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # -- the public surface the code under test uses ----------------------------------------

    def set_per_process_memory_fraction(self, fraction: float, device: int = 0) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        dev = self._devices[device]
        if self._fail_on_second_set and dev.set_calls:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        dev.set_calls.append(fraction)
        dev.allowed = int(fraction * dev.total) if fraction < 1.0 else None

    def get_per_process_memory_fraction(self, device: int = 0) -> float:
        dev = self._devices[device]
        return 1.0 if dev.allowed is None else dev.allowed / dev.total

    def get_device_properties(self, device: int = 0) -> "_Props":
        return _Props(self._devices[device].total)

    def memory_allocated(self, device: int = 0) -> int:
        return self._devices[device].allocated

    def memory_reserved(self, device: int = 0) -> int:
        return self._devices[device].reserved

    # -- test helpers: a tiny allocator ------------------------------------------------------

    def allocate(self, nbytes: int, device: int = 0) -> None:
        """Take ``nbytes`` for a tensor: from the cache if it holds enough, else a new segment."""
        dev = self._devices[device]
        cached = dev.reserved - dev.allocated
        if cached >= nbytes:
            dev.allocated += nbytes
            return
        if not self._segment_fits(dev, nbytes):
            dev.reserved = dev.allocated  # release_cached_blocks(), then one retry
            if not self._segment_fits(dev, nbytes):
                raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes.")
        dev.reserved += nbytes
        dev.allocated += nbytes

    def free(self, nbytes: int, device: int = 0) -> None:
        """Drop a tensor: its block stays cached (reserved) as in the caching allocator."""
        self._devices[device].allocated -= nbytes

    def set_calls(self, device: int = 0) -> list[float]:
        return list(self._devices[device].set_calls)

    @staticmethod
    def _segment_fits(dev: _Device, nbytes: int) -> bool:
        if dev.allowed is not None and dev.reserved + nbytes > dev.allowed:
            return False
        return dev.reserved + nbytes <= dev.total


@dataclass(frozen=True)
class _Props:
    total_memory: int
