"""What a device reading says: one device's memory at one moment, and the processes that hold it.

Made by ``device.reading`` and ``device.processes``; held by the snapshot, guard and cleanup records.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceReading", "ProcessInfo"]


@dataclass(frozen=True)
class ProcessInfo:
    """One process holding device memory, described as far as privacy and permissions allow."""

    pid: int
    used_bytes: int | None
    name: str | None  # None for other users' processes and when access is denied
    user: str | None
    is_jupyter_kernel: bool | None  # None when the command line could not be read
    is_self: bool
    note: str | None  # "access denied", "process has exited", "another user's process"


@dataclass(frozen=True)
class DeviceReading:
    """One device's memory at one moment; int bytes, None where unknown (see ``notes``)."""

    device: str
    name: str | None
    total: int | None
    free: int | None
    used: int | None            # whole device, every process
    process_used: int | None    # this process on this device (cpu: resident set size)
    allocated: int | None       # torch's allocator: bytes in live tensors
    reserved: int | None        # torch's allocator: allocated + its cache
    peak_allocated: int | None
    processes: tuple[ProcessInfo, ...] = ()  # other processes on this device
    notes: tuple[str, ...] = ()
    # cuda: which NVML query gave total/free/used: "v2" (nvidia-smi's figures), "v1" (deprecated:
    # used includes the driver's reserved memory), "torch" (mem_get_info), None (no reading)
    memory_query: str | None = None
    # The pid NVML lists for this process: os.getpid(), or a host pid inside a container.
    own_listed_pid: int | None = None

    @property
    def cache(self) -> int | None:
        """Reserved by PyTorch but unallocated: given back by ``empty_cache()``."""
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated

    @property
    def context(self) -> int | None:
        """This process's device memory that PyTorch's allocator does not hold (CUDA context, libraries)."""
        if self.process_used is None or self.reserved is None or not self.device.startswith("cuda"):
            return None
        return max(self.process_used - self.reserved, 0)

    @property
    def other_processes_used(self) -> int | None:
        """Bytes held by other processes, where NVML reports them."""
        known = [p.used_bytes for p in self.processes if p.used_bytes is not None]
        return sum(known) if known or not self.processes else None
