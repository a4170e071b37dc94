"""FAKE ``torch.cuda``: the one stand-in the tests use for an absent CUDA device (no GPU here).

This is a fake, for tests only. Every value it returns has the shape PyTorch 2.x gives
(torch/cuda/memory.py, c10/cuda/CUDACachingAllocator.cpp):

- ``memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated(device)``: int bytes;
  ``reset_peak_memory_stats(device)`` sets the peak back to what is allocated now;
- ``memory_stats(device)``: the flat dict ('allocated_bytes.all.current', '...all.peak',
  'reserved_bytes.all.current', 'inactive_split_bytes.all.current', 'num_ooms', and the counters
  'allocation.all.allocated' / 'allocation.all.freed' / 'allocation.all.current': blocks ever
  allocated, ever freed, live now; one block per ``allocate``/``free`` here) and
  ``memory_stats_as_nested_dict(device)`` the same figures as {'allocated_bytes': {'all':
  {'current': ..., 'peak': ...}}, ...};
- ``mem_get_info(device)``: (free, total) for the whole device, every process included;
- ``memory_snapshot()``: segment dicts with 'device', 'address', 'total_size', 'allocated_size',
  'active_size', 'segment_type' and 'blocks' of {'address', 'size', 'requested_size', 'state',
  'frames'} where state is 'active_allocated', 'active_pending_free' or 'inactive' (given to the
  fake as ``segments=``, since the fake does not lay out blocks);
- ``memory._record_memory_history(enabled='all'|None, max_entries=...)`` and
  ``memory._dump_snapshot(filename)`` writing a pickle {'segments': ..., 'device_traces': [...]};
- ``get_device_properties(device)``: ``total_memory`` and ``name`` (no ``pci_*`` fields: the code
  under test then finds the NVML device from CUDA_VISIBLE_DEVICES, as when they cannot be read);
- ``set_per_process_memory_fraction(fraction, device)`` raises TypeError unless ``fraction`` is a
  float and ValueError outside [0, 1]; below 1.0 it sets ``allowed_memory_maximum =
  size_t(fraction * totalGlobalMem)`` (C++ truncation), and 1.0 clears the cap;
  ``get_per_process_memory_fraction(device)`` returns ``allowed / totalGlobalMem``, or 1.0 when
  no cap is set (absent in torch before 2.9: ``FakeTorchCuda(has_getter=False)``);
- ``is_initialized()`` / ``init()``: no context until ``init()`` (``initialized=False``); a
  context exists on the current device once initialized (``torch._C._cuda_hasPrimaryContext``).

The allocator model: the cap is checked against the *reserved* total (every segment
cudaMalloc'd, cache included) before a new segment is allocated; cached blocks are reused without
touching the cap; when the cap is hit the allocator frees its cache and retries once before
raising OutOfMemoryError; ``empty_cache()`` gives the cache back. One block per request, no
rounding or splitting. Calls with side effects are recorded in ``calls`` as (name, args).
"""
from __future__ import annotations

import pickle
import types
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30

# The names of torch.cuda that ``install`` replaces on a real torch (what the package reads).
_SURFACE = ("is_initialized", "init", "device_count", "current_device", "set_device", "memory_allocated",
            "memory_reserved", "max_memory_allocated", "reset_peak_memory_stats", "memory_stats",
            "memory_stats_as_nested_dict", "mem_get_info", "memory_snapshot", "get_device_properties",
            "get_device_name", "empty_cache", "set_per_process_memory_fraction", "get_per_process_memory_fraction")


class FakeOutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError."""


@dataclass
class _Device:
    total: int
    allowed: int | None = None
    reserved: int = 0      # total_allocated_memory: segments held, cache included
    allocated: int = 0     # live tensors
    peak: int = 0          # allocated high-water mark since the last reset
    ooms: int = 0
    allocations: int = 0   # the allocator's counters: blocks ever allocated ('allocation.all.allocated')
    frees: int = 0         # and ever freed ('allocation.all.freed')
    set_calls: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Props:
    """torch.cuda's _CudaDeviceProperties: the fields the package reads."""

    total_memory: int
    name: str = "FAKE GPU"


class FakeTorchCuda:
    """A stand-in for ``torch.cuda`` with one device per total given (bytes; one 80 GiB device if none).

    ``initialized``: whether a CUDA context exists yet; ``peak``: device 0's allocated high-water
    mark to start from; ``fraction``: a per-process cap already set on device 0; ``segments``: what
    ``memory_snapshot()`` returns; ``used_elsewhere``: bytes other processes hold on each device
    (``mem_get_info``'s free is what is left); ``fail_restore``: the second ``set_per_process_memory_fraction`` on a device
    raises, as a CUDA error would; ``interrupt_first_set``: the first one takes effect, then a
    KeyboardInterrupt lands as it returns (Ctrl-C).
    """

    def __init__(self, *totals: int, initialized: bool = True, has_getter: bool = True, fail_restore: bool = False,
                 peak: int = 0, fraction: float | None = None, segments: list[dict[str, Any]] | None = None,
                 used_elsewhere: int = 0, interrupt_first_set: bool = False) -> None:
        self._devices = [_Device(total) for total in (totals or (80 * GiB,))]
        self._fail_on_second_set = fail_restore
        self._interrupt_next_set = interrupt_first_set
        self._has_getter = has_getter
        self._segments = list(segments or [])
        self._used_elsewhere = used_elsewhere
        self.initialized = initialized
        self.current = 0
        self.inits = 0
        self.calls: list[tuple[str, tuple]] = []
        self._devices[0].peak = peak
        if fraction is not None and fraction < 1.0:
            self._devices[0].allowed = int(fraction * self._devices[0].total)
        self.memory = _Memory(self)

    def __getattribute__(self, name: str) -> Any:
        # torch < 2.9 has no public getter: the attribute is absent there, not None.
        if name == "get_per_process_memory_fraction" and not object.__getattribute__(self, "_has_getter"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # -- the public surface the code under test uses ----------------------------------------

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self) -> None:
        self.calls.append(("init", ()))
        self.inits += 1
        self.initialized = True

    def device_count(self) -> int:
        return len(self._devices)

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: int) -> None:
        self.current = device

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
        if self._interrupt_next_set:
            self._interrupt_next_set = False
            raise KeyboardInterrupt

    def get_per_process_memory_fraction(self, device: int = 0) -> float:
        dev = self._devices[device]
        return 1.0 if dev.allowed is None else dev.allowed / dev.total

    def get_device_properties(self, device: int = 0) -> _Props:
        return _Props(self._devices[device].total)

    def get_device_name(self, device: int = 0) -> str:
        return self.get_device_properties(device).name

    def memory_allocated(self, device: int = 0) -> int:
        return self._devices[device].allocated

    def memory_reserved(self, device: int = 0) -> int:
        return self._devices[device].reserved

    def max_memory_allocated(self, device: int = 0) -> int:
        return self._devices[device].peak

    def reset_peak_memory_stats(self, device: int = 0) -> None:
        self.calls.append(("reset", (device,)))
        dev = self._devices[device]
        dev.peak = dev.allocated

    def memory_stats(self, device: int = 0) -> dict[str, int]:
        dev = self._devices[device]
        return {"allocated_bytes.all.current": dev.allocated, "allocated_bytes.all.peak": dev.peak,
                "reserved_bytes.all.current": dev.reserved, "reserved_bytes.all.peak": dev.reserved,
                "inactive_split_bytes.all.current": 0, "num_ooms": dev.ooms,
                "allocation.all.allocated": dev.allocations, "allocation.all.freed": dev.frees,
                "allocation.all.current": dev.allocations - dev.frees}

    def memory_stats_as_nested_dict(self, device: int = 0) -> dict[str, Any]:
        nested: dict[str, Any] = {}
        for key, value in self.memory_stats(device).items():
            parts = key.split(".")
            node = nested
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return nested

    def mem_get_info(self, device: int = 0) -> tuple[int, int]:
        self.calls.append(("mem_get_info", (device,)))
        dev = self._devices[device]
        return dev.total - dev.reserved - self._used_elsewhere, dev.total

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return list(self._segments)

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", ()))
        for dev in self._devices:
            dev.reserved = dev.allocated

    def has_primary_context(self, device: int) -> bool:
        """``torch._C._cuda_hasPrimaryContext``: only the current device's, once initialized."""
        return self.initialized and device == self.current

    # -- test helpers: a tiny allocator ------------------------------------------------------

    def allocate(self, nbytes: int, device: int = 0) -> None:
        """Take ``nbytes`` for a tensor: from the cache if it holds enough, else a new segment."""
        dev = self._devices[device]
        cached = dev.reserved - dev.allocated
        if cached < nbytes and not self._segment_fits(dev, nbytes):
            dev.reserved = dev.allocated  # release_cached_blocks(), then one retry
            if not self._segment_fits(dev, nbytes):
                dev.ooms += 1
                raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes.")
        if cached < nbytes:
            dev.reserved += nbytes
        dev.allocated += nbytes
        dev.allocations += 1
        dev.peak = max(dev.peak, dev.allocated)

    def free(self, nbytes: int, device: int = 0) -> None:
        """Drop a tensor: its block stays cached (reserved) as in the caching allocator."""
        self._devices[device].allocated -= nbytes
        self._devices[device].frees += 1

    def hold(self, allocated: int, reserved: int | None = None, device: int = 0) -> None:
        """Set the allocator's figures outright (a cell's tensors come and go): the peak follows."""
        dev = self._devices[device]
        dev.allocated = allocated
        dev.reserved = max(dev.reserved, allocated) if reserved is None else reserved
        dev.peak = max(dev.peak, allocated)

    def set_calls(self, device: int = 0) -> list[float]:
        return list(self._devices[device].set_calls)

    def calls_to(self, name: str) -> list[tuple]:
        """The arguments of each recorded call to ``name``, in order."""
        return [args for called, args in self.calls if called == name]

    def install(self, monkeypatch: Any, torch: types.ModuleType) -> FakeTorchCuda:
        """Put this fake's surface on a real torch's ``cuda`` (for code that reads ``sys.modules['torch']``)."""
        for name in _SURFACE:
            if name != "get_per_process_memory_fraction" or self._has_getter:
                monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "memory", self.memory)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", self.has_primary_context, raising=False)
        return self

    @staticmethod
    def _segment_fits(dev: _Device, nbytes: int) -> bool:
        if dev.allowed is not None and dev.reserved + nbytes > dev.allowed:
            return False
        return dev.reserved + nbytes <= dev.total


class _Memory:
    """``torch.cuda.memory``: the private history recorder and snapshot dump."""

    def __init__(self, cuda: FakeTorchCuda) -> None:
        self._cuda = cuda

    def _record_memory_history(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self._cuda.calls.append(("record", (enabled, kwargs.get("max_entries"))))

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        self._cuda.calls.append(("dump", (filename,)))
        with open(filename, "wb") as handle:
            pickle.dump({"segments": self._cuda.memory_snapshot(), "device_traces": []}, handle)


class _FakeC:
    """FAKE ``torch._C``: the fake's ``_cuda_hasPrimaryContext``; anything else from the real one if given."""

    def __init__(self, cuda: FakeTorchCuda, base: Any) -> None:
        self._cuda_hasPrimaryContext = cuda.has_primary_context
        self._base = base

    def __getattr__(self, name: str) -> Any:
        if self.__dict__.get("_base") is None:
            raise AttributeError(name)
        return getattr(self._base, name)


class FakeTorch(types.ModuleType):
    """FAKE torch: ``cuda`` is the given FakeTorchCuda and ``_C`` answers whether a context exists;
    every other name comes from ``base`` (the real torch, when a test needs tensors), else is absent."""

    def __init__(self, cuda: FakeTorchCuda, base: types.ModuleType | None = None) -> None:
        super().__init__("torch")
        self.cuda = cuda
        self._base = base
        self._C = _FakeC(cuda, getattr(base, "_C", None))

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__.get("_base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)
