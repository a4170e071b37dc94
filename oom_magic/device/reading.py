"""Read a device's memory: NVML for the device and its processes, torch's allocator, psutil.

Nothing here creates a CUDA context: allocator figures are read only when
``torch.cuda.is_initialized()``; otherwise NVML answers (it needs no context).
"""
from __future__ import annotations

import os
import platform
from dataclasses import replace
from typing import Any

from ..common._torch import cuda_initialized, loaded_torch
from ..common.errors import OomMagicError
from .nvml import (Nvml, NvmlDevice, default_nvml, format_pci_bus_id, nvml_device_for_torch, ordering_note,
                   visible_nvml_devices)
from ..records.device import DeviceReading, ProcessInfo
from .processes import NOTE_HOST_PID, NOTE_SELF_HOST_PID, describe_processes, recognise_self


def available_devices(nvml: Nvml | None = None) -> tuple[str, ...]:
    """The devices present: ``cuda:N`` for each visible GPU (torch's or NVML's count), ``mps``, ``cpu``."""
    found: list[str] = [f"cuda:{i}" for i in range(max(_torch_cuda_count(), _nvml_cuda_count(nvml)))]
    torch = loaded_torch()
    if torch is not None and _mps_available(torch):
        found.append("mps")
    found.append("cpu")
    return tuple(found)


def default_device(nvml: Nvml | None = None) -> str:
    """Where the user's tensors go by default: the current CUDA device when torch can use one, else mps or cpu.

    Decided without a context: torch's device count when torch is imported, NVML's otherwise.
    """
    torch = loaded_torch()
    count = _torch_cuda_count() if torch is not None else _nvml_cuda_count(nvml)
    if count == 0:
        return "mps" if torch is not None and _mps_available(torch) else "cpu"
    if torch is not None and cuda_initialized():
        try:
            return f"cuda:{torch.cuda.current_device()}"
        except Exception:
            pass
    return "cuda:0"


def resolve_device(spec: str | None, nvml: Nvml | None = None) -> str:
    """Turn ``None``/"cuda"/"cuda:1"/"cpu"/"mps" into a present device, or say which exist."""
    if spec is None or str(spec).strip() == "":
        return default_device(nvml)
    text = str(spec).strip().lower()
    wants_cuda = text.startswith(("cuda", "gpu")) or text.isdigit()
    if wants_cuda:
        nvml = nvml or default_nvml()
        if nvml.status.available:
            nvml.clear_errors()  # the message below names only this lookup's failures
    present = available_devices(nvml)
    if text == "cuda" or text == "gpu":
        cuda = [d for d in present if d.startswith("cuda")]
        if cuda:
            return default_device(nvml)
    elif text.isdigit() and f"cuda:{text}" in present:
        return f"cuda:{text}"
    elif text in present:
        return text
    message = f"unknown device {spec!r}: this machine has {', '.join(present)}"
    if wants_cuda and not any(d.startswith("cuda") for d in present):
        why = _no_cuda_reason(nvml)
        if why:
            message += f" (no CUDA device found: {why})"
    raise OomMagicError(message)


def _no_cuda_reason(nvml: Nvml | None) -> str | None:
    """Why NVML lists no GPU (not started, or a call failed), for the unknown-device message."""
    nvml = nvml or default_nvml()
    status = nvml.status
    if not status.available:
        return f"NVML unavailable: {status.reason}"
    failed = nvml.errors_text()
    return f"NVML failed: {failed}" if failed else None


def cuda_index(device: str) -> int | None:
    """The ordinal of a ``cuda`` / ``cuda:N`` device string (``cuda`` is 0); None for any other kind."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    return int(index) if index.isdigit() else 0


def read_device(device: str, nvml: Nvml | None = None) -> DeviceReading:
    """Read one device (``cuda:N``, ``mps`` or ``cpu``) without creating a CUDA context."""
    index = cuda_index(device)
    if index is not None:
        return _read_cuda(index, nvml or default_nvml())
    if device == "mps":
        return _read_mps()
    return _read_cpu()


def _torch_cuda_count() -> int:
    torch = loaded_torch()
    if torch is None:
        return 0
    try:
        # device_count() asks the driver (or NVML) without creating a context.
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def _nvml_cuda_count(nvml: Nvml | None) -> int:
    nvml = nvml or default_nvml()
    if not nvml.status.available:
        return 0
    return len(visible_nvml_devices(nvml))


def _mps_available(torch: Any) -> bool:
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        return False


def _read_cpu() -> DeviceReading:
    import psutil

    notes: list[str] = []
    total = available = rss = None
    try:
        vm = psutil.virtual_memory()
        total, available = int(vm.total), int(vm.available)
    except Exception as exc:
        notes.append(f"psutil could not read system memory: {exc}")
    try:
        rss = int(psutil.Process().memory_info().rss)
    except Exception as exc:
        notes.append(f"psutil could not read this process's memory: {exc}")
    used = total - available if total is not None and available is not None else None
    name = platform.machine() or None  # platform.processor() spawns `uname -p` on Linux
    return DeviceReading("cpu", name, total, available, used, rss, None, None, None, (), tuple(notes))


def _read_mps() -> DeviceReading:
    import psutil

    torch: Any = loaded_torch()  # None without torch: the calls below fail into the note
    notes: list[str] = []
    allocated = driver = total = None
    try:
        allocated = int(torch.mps.current_allocated_memory())
        driver = int(torch.mps.driver_allocated_memory())
        total = int(torch.mps.recommended_max_memory())
    except Exception as exc:
        notes.append(f"torch.mps figures unavailable: {exc}")
    try:
        total = total or int(psutil.virtual_memory().total)
    except Exception:
        pass
    free = total - driver if total is not None and driver is not None else None
    return DeviceReading("mps", "Apple GPU (unified memory)", total, free, driver, driver,
                         allocated, driver, None, (), tuple(notes))


def _read_cuda(index: int, nvml: Nvml) -> DeviceReading:
    torch: Any = loaded_torch()  # used only when CUDA is initialized, so never None there
    notes: list[str] = []
    initialized = cuda_initialized()
    allocated = reserved = peak = None
    pci_bus_id = None
    if initialized:
        try:
            allocated = int(torch.cuda.memory_allocated(index))
            reserved = int(torch.cuda.memory_reserved(index))
            peak = int(torch.cuda.max_memory_allocated(index))
            pci_bus_id = _torch_pci_bus_id(torch, index)
        except Exception as exc:
            notes.append(f"PyTorch allocator figures unavailable: {exc}")
    else:
        # No context: PyTorch cannot hold anything on this device yet.
        allocated = reserved = peak = 0
        notes.append("CUDA is not initialized in this process: PyTorch holds nothing on it yet")
    name = total = free = used = process_used = None
    memory_query: str | None = None
    own_listed_pid: int | None = None
    others: tuple[ProcessInfo, ...] = ()
    status = nvml.status
    if status.available:
        nvml.clear_errors()
        dev: NvmlDevice | None = nvml_device_for_torch(nvml, index, pci_bus_id)
        failed = nvml.errors_text()
        if dev is None:
            notes.append(f"NVML has no device matching cuda:{index} (check CUDA_VISIBLE_DEVICES)"
                         + (f"; NVML failed: {failed}" if failed else ""))
        else:
            name, total, free, used = dev.name, dev.total, dev.free, dev.used
            memory_query = dev.memory_query
            if memory_query == "v1":
                notes.append("NVML memory read with the v1 query (this driver has no v2): its 'used' "
                             "includes the driver's reserved memory, so it reads above nvidia-smi's")
            if failed:
                notes.append(f"NVML could not read all of cuda:{index} ({failed}): what it did not give shows n/a")
            described = describe_processes(nvml.processes(dev), self_pid=os.getpid())
            if nvml.processes_note:
                notes.append(nvml.processes_note)
            described, host_note = _own_host_pid(described, reserved if initialized else None)
            if host_note:
                notes.append(host_note)
            mine = [p for p in described if p.is_self]
            own_listed_pid = mine[0].pid if mine else None
            others = tuple(p for p in described if not p.is_self)
            if mine:
                process_used = mine[0].used_bytes
            elif not initialized:
                process_used = 0
            else:
                notes.append("NVML does not list this process (a container's pid namespace hides it)")
        order = ordering_note(nvml)
        if order:
            notes.append(order)
    else:
        notes.append(f"NVML unavailable: {status.reason}")
        if initialized and not _has_primary_context(torch, index):
            notes.append(f"no CUDA context on cuda:{index} yet: its free memory is not read "
                         "(torch.cuda.mem_get_info would create one)")
        elif initialized:
            try:
                free_b, total_b = torch.cuda.mem_get_info(index)
                free, total, used = int(free_b), int(total_b), int(total_b) - int(free_b)
                memory_query = "torch"
                name = torch.cuda.get_device_name(index)
            except Exception as exc:
                notes.append(f"torch.cuda.mem_get_info failed: {exc}")
    return DeviceReading(f"cuda:{index}", name, total, free, used, process_used, allocated,
                         reserved, peak, others, tuple(notes), memory_query, own_listed_pid)


# A CUDA context and its libraries (cuBLAS, cuDNN, NCCL) take 0.3-2 GiB beside PyTorch's reserve.
_CONTEXT_ALLOWANCE = 4 << 30


def _own_host_pid(
    described: tuple[ProcessInfo, ...], reserved: int | None
) -> tuple[tuple[ProcessInfo, ...], str | None]:
    """Mark the listed process that is this kernel under a host pid (containers), with a note."""
    if any(p.is_self for p in described) or not reserved:
        return described, None  # found by our pid, or we hold nothing and cannot be listed
    pid = recognise_self(((p.pid, p.used_bytes) for p in described), reserved, reserved + _CONTEXT_ALLOWANCE)
    if pid is None:
        return described, None
    # NVML speaks in host pids here: a pid we cannot see is another container's, not an exited one.
    marked = tuple(replace(p, is_self=True, note=NOTE_SELF_HOST_PID) if p.pid == pid
                   else replace(p, note=NOTE_HOST_PID) if p.note == "process has exited" else p for p in described)
    return marked, f"pid {pid} in NVML's list is this kernel: {NOTE_SELF_HOST_PID}"


def _has_primary_context(torch: Any, index: int) -> bool:
    """Whether device ``index`` already has a CUDA primary context (asking creates none).

    CUDA initialized on cuda:0 says nothing about cuda:1, and mem_get_info(1) would create a
    context there (~300-500 MiB). Without the check (a torch without it), assume none exists.
    """
    check = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
    if check is None:
        return False
    try:
        return bool(check(index))
    except Exception:
        return False


def _torch_pci_bus_id(torch: Any, index: int) -> str | None:
    try:
        props = torch.cuda.get_device_properties(index)
        return format_pci_bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except Exception:
        return None
