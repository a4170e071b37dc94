"""Read NVIDIA device memory and its processes through NVML, without a CUDA context or a raise.

A UI-free layer in the manner of nvitop's ``api/libnvml.py``: every NVML call goes through
``Nvml.query``, which never raises and returns a default (None) instead; memory is int bytes and
anything NVML cannot tell is None. ``visible_nvml_devices`` answers "which NVML device is torch's
``cuda:N``" from CUDA_VISIBLE_DEVICES, and ``ordering_note`` says when that answer may be wrong.
This module never imports torch; pynvml is imported on first use, never at import time.
It runs past 600 lines because each NVML query has its own never-raise wrapper and fallback;
the cuda:N-to-NVML device mapping is the part to move out next.
"""
from __future__ import annotations

import enum
import importlib
import os
import re
import threading
from dataclasses import dataclass, field
from types import ModuleType
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "Nvml",
    "NvmlDevice",
    "NvmlProcess",
    "NvmlStatus",
    "default_nvml",
    "format_pci_bus_id",
    "normalize_pci_bus_id",
    "nvml_device_for_torch",
    "ordering_note",
    "use",
    "visible_nvml_devices",
]

# NVML's "value not available" for unsigned long long fields (e.g. usedGpuMemory under WDDM).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

# Error codes from nvml.h (the same numbers nvidia-ml-py exposes as NVML_ERROR_*).
_ERR_NO_PERMISSION = 4
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_LIB_RM_VERSION_MISMATCH = 18
_MIG_ENABLED = 1
_MEMORY_V2 = 0x02000028  # nvidia-ml-py's nvmlMemory_v2 (sizeof(nvmlMemory_v2_t) | 2 << 24)


@dataclass(frozen=True)
class NvmlDevice:
    """One NVIDIA device as NVML sees it: a physical GPU or one MIG instance of it."""

    index: int  # NVML index; for a MIG instance, its MIG device index within the parent
    uuid: str | None  # "GPU-..." or "MIG-..."
    pci_bus_id: str | None  # "00000000:3B:00.0"; a MIG instance carries its parent's
    name: str | None
    total: int | None
    free: int | None
    used: int | None
    is_mig: bool
    parent_index: int | None  # the parent GPU's NVML index, for a MIG instance
    mig_enabled: bool = False  # a physical GPU in MIG mode (CUDA runs on its instances)
    gpu_instance_id: int | None = None  # MIG instance only: the "gi" of MIG-GPU-<uuid>/gi/ci
    compute_instance_id: int | None = None  # MIG instance only: the "ci"
    # Which NVML memory query gave total/free/used: "v2" (used excludes the driver's reserved
    # memory, as nvidia-smi prints it) or "v1" (deprecated: used includes it); None: no reading.
    memory_query: str | None = field(default=None, compare=False)
    reserved: int | None = field(default=None, compare=False)  # the driver's reserved memory (v2 only)
    # CUDA compute capability (major, minor); a MIG instance has its parent's; None where NVML cannot say
    compute_capability: tuple[int, int] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class NvmlProcess:
    """A process NVML lists on a device, with the device memory it holds."""

    pid: int
    used_bytes: int | None  # None where NVML cannot say (WDDM, MIG parent, not supported)


@dataclass(frozen=True)
class NvmlStatus:
    """Whether NVML readings are available here, and in one line why not."""

    available: bool
    reason: str | None
    driver_version: str | None


class _Env(enum.Enum):
    """Sentinel: read the value from os.environ at call time."""

    VALUE = 0


_FROM_ENV = _Env.VALUE


def _text(value: Any) -> str | None:
    """NVML strings come back as str (nvidia-ml-py >= 11.5) or bytes (older); both become str."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        value = value.strip("\x00").strip()
        return value or None
    return None


def _bytes(value: Any) -> int | None:
    """An NVML memory figure as int bytes, or None for missing / NVML_VALUE_NOT_AVAILABLE."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if value < 0 or value >= NVML_VALUE_NOT_AVAILABLE:
        return None
    return int(value)


def _int(value: Any) -> int | None:
    """A ctypes-ish integer (int or object with .value) as int, else None."""
    value = getattr(value, "value", value)
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, int) else None


_PCI = re.compile(
    r"^\s*(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<device>[0-9a-fA-F]{1,2})(?:\.(?P<function>[0-7]))?\s*$"
)


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """Turn "0000:3b:00.0", "3B:00.0" or NVML's "00000000:3B:00.0" into "00000000:3B:00.0"."""
    text = _text(bus_id)
    if text is None:
        return None
    match = _PCI.match(text)
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16)
    function = int(match["function"] or "0")
    return f"{domain:08X}:{int(match['bus'], 16):02X}:{int(match['device'], 16):02X}.{function}"


def format_pci_bus_id(domain: int, bus: int, device: int) -> str:
    """Build the normalised bus id from integer parts (torch's pci_domain_id/pci_bus_id/pci_device_id)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _error_text(exc: BaseException) -> str:
    """str() of an NVMLError can itself call into NVML; never let that raise."""
    try:
        text = str(exc).strip()
    except Exception:
        text = ""
    if not text:
        code = _error_code(exc)
        text = f"NVML error {code}" if code is not None else type(exc).__name__
    return text.splitlines()[0]


def _init_failure_reason(exc: BaseException) -> str:
    """The one-line reason NVML could not start, phrased for the user."""
    code = _error_code(exc)
    if code == _ERR_LIBRARY_NOT_FOUND:
        return "NVML library not found (no NVIDIA driver)"
    if code == _ERR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded (NVML cannot reach a GPU)"
    if code == _ERR_LIB_RM_VERSION_MISMATCH:
        return (
            f"NVML driver/library version mismatch: {_error_text(exc)} "
            "(reboot, or reload the nvidia kernel module)"
        )
    if code == _ERR_NO_PERMISSION:
        return "NVML refused access (insufficient permissions)"
    return f"NVML failed to start: {_error_text(exc)}"


class Nvml:
    """NVML readings for this machine; every call degrades to None instead of raising.

    ``module`` is the pynvml module to use (tests inject a fake); by default ``pynvml`` from
    nvidia-ml-py is imported on first use. NVML is initialised once, on first use, under a lock.
    """

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module: ModuleType | None = module
        self._lock = threading.Lock()
        self._started = False
        self._status = NvmlStatus(available=False, reason="NVML not started", driver_version=None)
        self.last_error: str | None = None  # one line: the latest NVML call that failed, and why
        # Failed calls since clear_errors(), one line per function (at most one per NVML function).
        self.errors: dict[str, str] = {}
        self.processes_note: str | None = None  # why the latest processes() list is empty/partial

    # -- start-up -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            return
        with self._lock:
            if self._started:
                return
            self._status = self._init()
            self._started = True

    def _init(self) -> NvmlStatus:
        module = self._module
        if module is None:
            try:
                module = importlib.import_module("pynvml")
            except ImportError:
                return NvmlStatus(False, "nvidia-ml-py not installed", None)
            except Exception as exc:  # a broken install must not reach the user's cell
                return NvmlStatus(False, f"pynvml failed to import: {_error_text(exc)}", None)
            self._module = module
        init = getattr(module, "nvmlInit", None)
        if init is None:
            return NvmlStatus(False, "pynvml has no nvmlInit (not nvidia-ml-py?)", None)
        try:
            init()
        except Exception as exc:
            return NvmlStatus(False, _init_failure_reason(exc), None)
        driver, _ = self._call("nvmlSystemGetDriverVersion")
        return NvmlStatus(True, None, _text(driver))

    @property
    def status(self) -> NvmlStatus:
        """Whether NVML works here; starts NVML on first use."""
        self._start()
        return self._status

    # -- the one door to NVML -------------------------------------------------------------------

    def _call(self, func_name: str, *args: Any) -> tuple[Any, BaseException | None]:
        """Call a pynvml function by name; return (value, None) or (None, the exception)."""
        func: Callable[..., Any] | None = getattr(self._module, func_name, None)
        if func is None:
            exc: BaseException = AttributeError(f"{func_name} is not in this nvidia-ml-py")
            self.last_error = self.errors[func_name] = f"{func_name}: not in this nvidia-ml-py"
            return None, exc
        try:
            return func(*args), None
        except Exception as exc:  # NVMLError, NVMLLibraryMismatchError, ctypes errors alike
            self.last_error = self.errors[func_name] = f"{func_name}: {_error_text(exc)}"
            return None, exc

    def _probe(self, func_name: str, *args: Any) -> Any:
        """A call whose failure is an expected answer (no MIG here, empty MIG slot): not an error."""
        saved, logged = self.last_error, self.errors.get(func_name)
        value, exc = self._call(func_name, *args)
        self.last_error = saved
        if logged is None:
            self.errors.pop(func_name, None)
        else:
            self.errors[func_name] = logged
        return None if exc is not None else value

    def clear_errors(self) -> None:
        """Forget the failed calls logged in ``errors`` (call before a reading to see only its failures)."""
        self.errors = {}

    def errors_text(self) -> str | None:
        """The failed calls since ``clear_errors()`` in one line, or None when every call answered."""
        return "; ".join(self.errors[name] for name in sorted(self.errors)) or None

    def query(self, func_name: str, *args: Any, default: Any = None) -> Any:
        """Call ``pynvml.<func_name>(*args)``; on any failure or when NVML is unavailable, return default."""
        if not self.status.available:
            return default
        value, exc = self._call(func_name, *args)
        return default if exc is not None else value

    # -- devices --------------------------------------------------------------------------------

    def devices(self) -> tuple[NvmlDevice, ...]:
        """All physical GPUs in NVML order, each followed by its MIG instances; () without NVML."""
        if not self.status.available:
            return ()
        count = _int(self.query("nvmlDeviceGetCount")) or 0
        found: list[NvmlDevice] = []
        for index in range(count):
            handle = self.query("nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                continue
            device = self._read_device(handle, index=index, parent=None)
            found.append(device)
            if device.mig_enabled:
                found.extend(self._mig_instances(handle, device))
        return tuple(found)

    def _mig_instances(self, handle: Any, parent: NvmlDevice) -> list[NvmlDevice]:
        instances: list[NvmlDevice] = []
        slots = _int(self.query("nvmlDeviceGetMaxMigDeviceCount", handle)) or 0
        for slot in range(slots):
            # Empty slots answer NVML_ERROR_NOT_FOUND: instances need not be contiguous.
            mig_handle = self._probe("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig_handle is not None:
                instances.append(self._read_device(mig_handle, index=slot, parent=parent))
        return instances

    def _read_device(self, handle: Any, *, index: int, parent: NvmlDevice | None) -> NvmlDevice:
        memory, query = self._memory(handle)
        total = _bytes(getattr(memory, "total", None))
        free = _bytes(getattr(memory, "free", None))
        used = _bytes(getattr(memory, "used", None))
        reserved = _bytes(getattr(memory, "reserved", None)) if query == "v2" else None
        uuid = _text(self.query("nvmlDeviceGetUUID", handle))
        name = _text(self.query("nvmlDeviceGetName", handle))
        if parent is not None:
            return NvmlDevice(
                index=index,
                uuid=uuid,
                pci_bus_id=parent.pci_bus_id,
                name=name,
                total=total,
                free=free,
                used=used,
                is_mig=True,
                parent_index=parent.index,
                gpu_instance_id=_int(self.query("nvmlDeviceGetGpuInstanceId", handle)),
                compute_instance_id=_int(self.query("nvmlDeviceGetComputeInstanceId", handle)),
                memory_query=query,
                reserved=reserved,
                compute_capability=parent.compute_capability,
            )
        pci = self.query("nvmlDeviceGetPciInfo", handle)
        bus_id = normalize_pci_bus_id(getattr(pci, "busId", None)) or normalize_pci_bus_id(
            getattr(pci, "busIdLegacy", None)
        )
        mode = self._probe("nvmlDeviceGetMigMode", handle)  # [current, pending]; NotSupported pre-Ampere
        current = _int(mode[0]) if isinstance(mode, (list, tuple)) and mode else None
        return NvmlDevice(
            index=index,
            uuid=uuid,
            pci_bus_id=bus_id,
            name=name,
            total=total,
            free=free,
            used=used,
            is_mig=False,
            parent_index=None,
            mig_enabled=current == _MIG_ENABLED,
            memory_query=query,
            reserved=reserved,
            compute_capability=self._capability(handle),
        )

    def _capability(self, handle: Any) -> tuple[int, int] | None:
        """(major, minor) of a GPU; None where this nvidia-ml-py or driver cannot say (not an error)."""
        value = self._probe("nvmlDeviceGetCudaComputeCapability", handle)
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
            return int(value[0]), int(value[1])
        return None

    def _memory(self, handle: Any) -> tuple[Any, str | None]:
        """The v2 memory reading (nvidia-smi's figures) where the driver has it, else the v1 one."""
        if not self.status.available:
            return None, None
        version = getattr(self._module, "nvmlMemory_v2", _MEMORY_V2)
        # A driver before R510 lacks the v2 symbol: an expected answer, so probed, not logged.
        memory = self._probe("nvmlDeviceGetMemoryInfo", handle, version)
        if memory is not None and getattr(memory, "total", None) is not None:
            return memory, "v2"
        memory = self.query("nvmlDeviceGetMemoryInfo", handle)
        return memory, None if memory is None else "v1"

    def handle(self, device: NvmlDevice) -> Any:
        """pynvml's handle for a device record (a MIG instance's own), checked against its UUID; None if gone."""
        if not self.status.available:
            return None
        return self._handle_for(device)

    def _handle_for(self, device: NvmlDevice) -> Any:
        """A fresh handle for a device record, checked against its UUID (devices can change)."""
        if device.is_mig:
            parent = self.query("nvmlDeviceGetHandleByIndex", device.parent_index)
            handle = (
                None
                if parent is None
                else self.query("nvmlDeviceGetMigDeviceHandleByIndex", parent, device.index)
            )
        else:
            handle = self.query("nvmlDeviceGetHandleByIndex", device.index)
        if device.uuid is None:
            return handle
        if handle is not None and _text(self.query("nvmlDeviceGetUUID", handle)) == device.uuid:
            return handle
        return self.query("nvmlDeviceGetHandleByUUID", device.uuid)

    # -- processes ------------------------------------------------------------------------------

    def processes(self, device: NvmlDevice) -> tuple[NvmlProcess, ...]:
        """Compute and graphics processes on a device, one per pid; the reason for gaps is in processes_note."""
        self.processes_note = None
        if not self.status.available:
            self.processes_note = self._status.reason
            return ()
        handle = self._handle_for(device)
        if handle is None:
            self.processes_note = f"device {device.uuid or device.index} is no longer present"
            return ()
        by_pid: dict[int, int | None] = {}
        failures: list[str] = []
        for kind in ("Compute", "Graphics"):
            listed, exc = self._running_processes(kind, handle)
            if exc is not None:
                failures.append(f"{kind.lower()}: {_error_text(exc)}")
                continue
            for item in listed or ():
                pid = _int(getattr(item, "pid", None))
                if pid is None:
                    continue
                used = _bytes(getattr(item, "usedGpuMemory", None))
                # A pid listed twice (compute and graphics) holds one allocation: keep the larger.
                held = by_pid.get(pid)
                if pid not in by_pid or used is not None and (held is None or used > held):
                    by_pid[pid] = used
        if failures:
            self.processes_note = "NVML could not list processes (" + "; ".join(failures) + ")"
        return tuple(NvmlProcess(pid=pid, used_bytes=used) for pid, used in sorted(by_pid.items()))

    def _running_processes(self, kind: str, handle: Any) -> tuple[Any, BaseException | None]:
        """The v3 call, falling back to _v2 when the driver predates v3 (function not found)."""
        listed, exc = self._call(f"nvmlDeviceGet{kind}RunningProcesses", handle)
        if exc is None or not _is_version_gap(exc):
            return listed, exc
        return self._call(f"nvmlDeviceGet{kind}RunningProcesses_v2", handle)


def _is_version_gap(exc: BaseException) -> bool:
    """nvidia-ml-py newer than the driver: NVMLLibraryMismatchError or FUNCTION_NOT_FOUND."""
    return type(exc).__name__ == "NVMLLibraryMismatchError" or _error_code(exc) == _ERR_FUNCTION_NOT_FOUND


_DEFAULT: Nvml | None = None
_DEFAULT_LOCK = threading.Lock()


def default_nvml() -> Nvml:
    """The process-wide Nvml: the real pynvml (created on first call, NVML started lazily), or
    the one ``use`` put in place."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Nvml()
        return _DEFAULT


@contextmanager
def use(nvml: Nvml) -> Iterator[Nvml]:
    """Make ``nvml`` the process-wide reader inside the block, and put the previous one back after.

    The seam for callers that cannot pass an ``Nvml`` down (a magic reading the device deep
    inside): tests give a FAKE pynvml here (``use(Nvml(fake.module))``) instead of patching.
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        previous, _DEFAULT = _DEFAULT, nvml
    try:
        yield nvml
    finally:
        with _DEFAULT_LOCK:
            _DEFAULT = previous


# -- which NVML device is torch's cuda:N -------------------------------------------------------


def _env(value: str | None | _Env, name: str) -> str | None:
    if isinstance(value, _Env):  # _FROM_ENV, the only member
        return os.environ.get(name)
    return value


def _strtoul(text: str) -> int:
    """CUDA reads an index entry like strtoul: "1gpu" is 1, "" or "x" is invalid (-1)."""
    match = re.match(r"[+-]?\d+", text)
    return int(match.group()) if match else -1


def _unique_prefix(candidate: str, devices: list[NvmlDevice]) -> NvmlDevice | None:
    """The one device whose UUID starts with candidate (CUDA accepts unique prefixes)."""
    needle = candidate.lower()
    hits = [d for d in devices if d.uuid is not None and d.uuid.lower().startswith(needle)]
    return hits[0] if len(hits) == 1 else None


def _legacy_mig(entry: str, physical: list[NvmlDevice], migs: list[NvmlDevice]) -> NvmlDevice | None:
    """Resolve the pre-R470 form "MIG-GPU-<gpu uuid>/<gi>/<ci>"."""
    parts = entry[len("MIG-"):].split("/")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    parent = next(
        (d for d in physical if d.uuid is not None and d.uuid.lower() == parts[0].lower()), None
    )
    if parent is None:
        return None
    gi, ci = int(parts[1]), int(parts[2])
    return next(
        (
            m
            for m in migs
            if m.parent_index == parent.index
            and m.gpu_instance_id == gi
            and m.compute_instance_id == ci
        ),
        None,
    )


def _cuda_target(device: NvmlDevice, migs: list[NvmlDevice]) -> NvmlDevice | None:
    """A GPU in MIG mode runs CUDA on a MIG instance, not on itself: take its first one."""
    if not device.mig_enabled:
        return device
    return next((m for m in migs if m.parent_index == device.index), None)


def _resolve_entry(
    entry: str, physical: list[NvmlDevice], migs: list[NvmlDevice]
) -> tuple[NvmlDevice | None, bool]:
    """One CUDA_VISIBLE_DEVICES entry -> (device or None if invalid, whether it is a physical GPU)."""
    if entry.startswith("MIG-GPU-"):
        return _legacy_mig(entry, physical, migs), False
    if entry.startswith("MIG-"):
        return _unique_prefix(entry, migs), False
    if entry.startswith("GPU-"):
        return _unique_prefix(entry, physical), True
    index = _strtoul(entry)
    if index < 0 or index >= len(physical):
        return None, True
    return physical[index], True


def _visible(
    devices: tuple[NvmlDevice, ...], cuda_visible_devices: str | None
) -> tuple[tuple[NvmlDevice, ...], list[NvmlDevice]]:
    """(visible devices in cuda:N order, physical GPUs in MIG mode that stood in for a MIG instance)."""
    physical = [d for d in devices if not d.is_mig]
    migs = [d for d in devices if d.is_mig]
    if cuda_visible_devices is None:
        chosen = [(d, True) for d in physical]
    else:
        chosen = []
        for raw in cuda_visible_devices.split(","):
            device, is_physical = _resolve_entry(raw.strip(), physical, migs)
            if device is None:
                break  # CUDA's rule: the first invalid entry ends the list
            chosen.append((device, is_physical))
    visible: list[NvmlDevice] = []
    substituted: list[NvmlDevice] = []
    for device, is_physical in chosen:
        target = _cuda_target(device, migs) if is_physical else device
        if target is None:
            continue  # a GPU in MIG mode with no instances offers CUDA nothing
        if target in visible:
            return (), []  # CUDA: a repeated device makes the whole list invalid
        if target is not device:
            substituted.append(device)
        visible.append(target)
    return tuple(visible), substituted


def visible_nvml_devices(
    nvml: Nvml, cuda_visible_devices: str | None | _Env = _FROM_ENV
) -> tuple[NvmlDevice, ...]:
    """The NVML device behind each torch ``cuda:N``, in N order, honouring CUDA_VISIBLE_DEVICES.

    Entries may be indices ("1,0"), GPU UUIDs or unique prefixes ("GPU-8f3a"), MIG UUIDs
    ("MIG-<uuid>") or the legacy "MIG-GPU-<uuid>/<gi>/<ci>". As in CUDA, the first invalid entry
    ends the list, a repeated device empties it, and "" or "-1" means no device; unset means every
    GPU in NVML (PCI) order. A GPU in MIG mode stands for its first MIG instance. Indices follow
    NVML order: see ``ordering_note`` for when CUDA's order may differ.
    """
    visible, _ = _visible(nvml.devices(), _env(cuda_visible_devices, "CUDA_VISIBLE_DEVICES"))
    return visible


def ordering_note(
    nvml: Nvml,
    cuda_visible_devices: str | None | _Env = _FROM_ENV,
    cuda_device_order: str | None | _Env = _FROM_ENV,
) -> str | None:
    """One line saying why ``visible_nvml_devices`` may not match torch's numbering, or None.

    CUDA numbers devices FASTEST_FIRST unless CUDA_DEVICE_ORDER=PCI_BUS_ID; NVML numbers them in
    PCI order. The two agree when all GPUs are the same model; otherwise an index can name a
    different GPU, and we say so rather than guess CUDA's speed ranking.
    """
    devices = nvml.devices()
    visible_spec = _env(cuda_visible_devices, "CUDA_VISIBLE_DEVICES")
    order = (_env(cuda_device_order, "CUDA_DEVICE_ORDER") or "FASTEST_FIRST").strip().upper()
    notes: list[str] = []
    physical = [d for d in devices if not d.is_mig]
    uses_indices = visible_spec is None or any(
        not e.strip().startswith(("GPU-", "MIG-")) for e in visible_spec.split(",") if e.strip()
    )
    models = sorted({d.name or "unknown model" for d in physical})
    if order != "PCI_BUS_ID" and uses_indices and len(models) > 1:
        notes.append(
            f"CUDA_DEVICE_ORDER is {order or 'FASTEST_FIRST'} and the GPUs differ in model "
            f"({', '.join(models)}), so torch's cuda:N may not be NVML GPU N; "
            "set CUDA_DEVICE_ORDER=PCI_BUS_ID before CUDA starts to make them agree"
        )
    _, substituted = _visible(devices, visible_spec)
    for parent in substituted:
        notes.append(
            f"GPU {parent.index} is in MIG mode, so its cuda device is taken as its first MIG "
            "instance (CUDA may enumerate only one MIG instance per process)"
        )
    return "; ".join(notes) or None


def nvml_device_for_torch(
    nvml: Nvml,
    torch_index: int,
    pci_bus_id: str | None = None,
    *,
    cuda_visible_devices: str | None | _Env = _FROM_ENV,
) -> NvmlDevice | None:
    """The NVML device that torch's ``cuda:<torch_index>`` is; None when it cannot be found.

    Give ``pci_bus_id`` when CUDA is already initialised (build it with ``format_pci_bus_id`` from
    torch's device properties): it names the GPU for certain, whatever the device order. Without
    it the answer comes from CUDA_VISIBLE_DEVICES (``visible_nvml_devices``).
    """
    visible = visible_nvml_devices(nvml, cuda_visible_devices)
    candidate = visible[torch_index] if 0 <= torch_index < len(visible) else None
    bus = normalize_pci_bus_id(pci_bus_id)
    if bus is None:
        return candidate
    if candidate is not None and candidate.pci_bus_id == bus:
        return candidate
    devices = nvml.devices()
    migs = [d for d in devices if d.is_mig]
    for device in devices:
        if not device.is_mig and device.pci_bus_id == bus:
            return _cuda_target(device, migs)
    return None
