"""FAKE pynvml module: stands in for absent NVIDIA hardware; value shapes copied from real nvidia-ml-py 13 return types.

This is a fake, for tests only. It mirrors what nvidia-ml-py 13.x (``pynvml.py``) hands back:
- ``nvmlDeviceGetMemoryInfo(handle)`` -> a ctypes structure with int ``.total/.free/.used``
  (c_nvmlMemory_t, v1: ``used`` includes the driver's reserved memory on R510+ drivers);
  ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)`` -> c_nvmlMemory_v2_t with
  ``.version/.total/.reserved/.free/.used`` (``used`` excludes ``reserved``, as nvidia-smi prints);
  a driver without ``nvmlDeviceGetMemoryInfo_v2`` (``missing=``) raises FUNCTION_NOT_FOUND;
- ``nvmlDeviceGetPciInfo`` -> a structure with ``.busIdLegacy`` and ``.busId`` (nvmlPciInfo_t),
  str in nvidia-ml-py >= 11.5, bytes in older releases (``FakeNvml(strings_as_bytes=True)``);
- ``nvmlDeviceGetComputeRunningProcesses`` / ``...Graphics...`` (the v3 call behind the
  unversioned name) -> a list of objects with ``.pid``, ``.usedGpuMemory``, ``.gpuInstanceId``,
  ``.computeInstanceId``; nvidia-ml-py turns NVML_VALUE_NOT_AVAILABLE (2**64-1) into None, and a
  process given here with that raw value is passed through as-is, as older bindings did;
- errors are ``NVMLError`` subclasses chosen by code through ``NVMLError.__new__`` with a
  ``.value``; a missing versioned symbol behind an unversioned call raises
  ``NVMLLibraryMismatchError`` (the ``throwOnVersionMismatch`` wrapper);
- every call before ``nvmlInit`` raises NVMLError_Uninitialized, as the real library does.
Where real behaviour is not pinned down (PCI info on a MIG handle), the fake answers
NOT_SUPPORTED and the code under test must not depend on it.
"""
from __future__ import annotations

import ctypes
import string
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar
from collections.abc import Callable, Iterable

# Constants copied from nvidia-ml-py 13.615 pynvml.py.
NVML_SUCCESS = 0
NVML_ERROR_CODES = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_ALREADY_INITIALIZED": 5,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_INSUFFICIENT_POWER": 8,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_IRQ_ISSUE": 11,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_CORRUPTED_INFOROM": 14,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_OPERATING_SYSTEM": 17,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_MEMORY": 20,
    "NVML_ERROR_NO_DATA": 21,
    "NVML_ERROR_UNKNOWN": 999,
}
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_VALUE_NOT_AVAILABLE = ctypes.c_ulonglong(-1).value  # 2**64 - 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_PCI_BUS_ID_FMT = "%08X:%02X:%02X.0"

# The messages nvidia-ml-py's NVMLError.__str__ gives for these codes.
_ERROR_STRINGS = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    9: "Driver Not Loaded",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    18: "RM has detected an NVML/RM version mismatch.",
    999: "Unknown Error",
}

GiB = 1024**3
MiB = 1024**2


@dataclass
class FakeMig:
    """A MIG instance on a FakeGpu (a GPU instance + compute instance pair)."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    total: int = 40 * GiB
    used: int = 0
    reserved: int = 0  # the driver's reserved memory (v2's ``reserved``; v1 folds it into ``used``)
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    slot: int | None = None  # MIG device index; default: position in FakeGpu.mig


@dataclass
class FakeGpu:
    """A physical GPU; ``mig=None`` means MIG is unsupported, a list means MIG mode is on."""

    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GiB
    used: int = 0
    reserved: int = 0  # the driver's reserved memory (v2's ``reserved``; v1 folds it into ``used``)
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:07:00.0"
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    graphics_processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig: list[FakeMig] | None = None
    max_mig_devices: int = 7
    compute_capability: tuple[int, int] = (8, 0)  # nvmlDeviceGetCudaComputeCapability (A100: 8.0)


class _Struct(ctypes.Structure):
    """Like nvidia-ml-py's _PrintableStructure: char arrays read back as str."""

    _decode = True

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if isinstance(value, bytes) and type(self)._decode:
            return value.decode()
        return value


class c_nvmlMemory_t(_Struct):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class c_nvmlMemory_v2_t(_Struct):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


nvmlMemory_v2 = 0x02000028  # nvidia-ml-py's version tag for c_nvmlMemory_v2_t


class nvmlPciInfo_t(_Struct):
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class _BytesPciInfo(nvmlPciInfo_t):
    """Old bindings (< 11.5) returned char arrays as bytes."""

    _decode = False


class nvmlFriendlyObject:
    """nvidia-ml-py's plain attribute bag for process records."""

    def __init__(self, dictionary: dict[str, Any]) -> None:
        for key, value in dictionary.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return str(self.__dict__)


class _Handle:
    """Opaque device handle (the real one is a ctypes pointer)."""

    def __init__(self, gpu: FakeGpu, mig: FakeMig | None = None) -> None:
        self.gpu = gpu
        self.mig = mig


class FakeNvml:
    """A configurable fake NVML; ``.module`` is the pynvml-shaped module to inject.

    ``init_error``: an NVML error code nvmlInit raises (e.g. 12 library not found, 18 mismatch).
    ``unsupported``: function names that raise NVMLError_NotSupported.
    ``failing``: function name -> NVML error code to raise.
    ``missing``: versioned symbols the "driver" lacks (e.g. "nvmlDeviceGetComputeRunningProcesses_v3").
    ``strings_as_bytes``: return bytes for strings, as bindings before 11.5 did.
    """

    def __init__(
        self,
        devices: Iterable[FakeGpu] = (),
        *,
        init_error: int | None = None,
        unsupported: Iterable[str] = (),
        failing: dict[str, int] | None = None,
        missing: Iterable[str] = (),
        driver_version: str = "550.54.15",
        strings_as_bytes: bool = False,
    ) -> None:
        self.devices = list(devices)
        self.init_error = init_error
        self.unsupported = set(unsupported)
        self.failing = dict(failing or {})
        self.missing = set(missing)
        self.driver_version = driver_version
        self.strings_as_bytes = strings_as_bytes
        self.initialised = False
        self.init_calls = 0
        self.calls: list[str] = []
        self.module = self._build_module()

    # -- module construction ----------------------------------------------------------------

    def _build_module(self) -> ModuleType:
        module = ModuleType("pynvml", "FAKE pynvml (tests/fakes/fake_pynvml.py): no real NVML.")
        module.NVML_SUCCESS = NVML_SUCCESS
        for name, code in NVML_ERROR_CODES.items():
            setattr(module, name, code)
        module.NVML_VALUE_NOT_AVAILABLE_ulonglong = ctypes.c_ulonglong(-1)
        module.NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
        module.NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
        module.NVML_DEVICE_PCI_BUS_ID_FMT = NVML_DEVICE_PCI_BUS_ID_FMT
        module.nvmlFriendlyObject = nvmlFriendlyObject
        module.nvmlMemory_v2 = nvmlMemory_v2

        class NVMLError(Exception):
            _valClassMapping: ClassVar[dict[int, type]] = {}

            def __new__(typ, value: int):  # type: ignore[no-untyped-def]
                if typ is NVMLError:
                    typ = NVMLError._valClassMapping.get(value, typ)
                obj = Exception.__new__(typ)
                obj.value = value
                return obj

            def __init__(self, *args: Any) -> None:
                pass

            def __str__(self) -> str:
                return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")

            def __eq__(self, other: object) -> bool:
                return self.value == getattr(other, "value", None)

            __hash__ = Exception.__hash__

        for err_name, code in NVML_ERROR_CODES.items():
            class_name = "NVMLError_" + string.capwords(
                err_name.replace("NVML_ERROR_", ""), "_"
            ).replace("_", "")

            def gen_new(val: int) -> Callable[..., Any]:
                def new(typ: type, *args: Any) -> Any:
                    return NVMLError.__new__(typ, val)

                return new

            cls = type(class_name, (NVMLError,), {"__new__": gen_new(code)})
            cls.__module__ = "pynvml"
            setattr(module, class_name, cls)
            NVMLError._valClassMapping[code] = cls
        module.NVMLError = NVMLError

        class NVMLLibraryMismatchError(Exception):
            pass

        module.NVMLLibraryMismatchError = NVMLLibraryMismatchError

        for name in dir(self):
            if name.startswith("nvml") and callable(getattr(self, name)):
                setattr(module, name, self._wrap(name, getattr(self, name)))
        return module

    def _wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name not in ("nvmlInit", "nvmlInitWithFlags") and not self.initialised:
                raise self.module.NVMLError(NVML_ERROR_UNINITIALIZED)
            if name in self.unsupported:
                raise self.module.NVMLError(NVML_ERROR_NOT_SUPPORTED)
            if name in self.failing:
                raise self.module.NVMLError(self.failing[name])
            if name in self.missing:
                raise self.module.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            return func(*args, **kwargs)

        call.__name__ = name
        return call

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self.strings_as_bytes else text

    def _error(self, code: int) -> Exception:
        return self.module.NVMLError(code)

    def _migs(self, gpu: FakeGpu) -> dict[int, FakeMig]:
        return {(m.slot if m.slot is not None else i): m for i, m in enumerate(gpu.mig or [])}

    def _processes(self, pairs: list[tuple[int, int | None]], mig: FakeMig | None) -> list[Any]:
        return [
            nvmlFriendlyObject(
                {
                    "pid": pid,
                    "usedGpuMemory": used,
                    "gpuInstanceId": mig.gpu_instance_id if mig else 0xFFFFFFFF,
                    "computeInstanceId": mig.compute_instance_id if mig else 0xFFFFFFFF,
                }
            )
            for pid, used in pairs
        ]

    def _versioned(self, name: str, handle: _Handle, graphics: bool) -> list[Any]:
        # The unversioned call goes through throwOnVersionMismatch to the _v3 symbol.
        if f"{name}_v3" in self.missing:
            raise self.module.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib "
                f"version. Either use matching pyNVML and NVML lib versions or use a versioned "
                f"function such as {name}_v2"
            )
        return self._list_processes(handle, graphics)

    def _list_processes(self, handle: _Handle, graphics: bool) -> list[Any]:
        if handle.mig is not None:
            return [] if graphics else self._processes(handle.mig.processes, handle.mig)
        pairs = handle.gpu.graphics_processes if graphics else handle.gpu.processes
        return self._processes(pairs, None)

    # -- the fake NVML API (names as in nvidia-ml-py) ------------------------------------------

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self._error(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._str(self.driver_version)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.devices):
            raise self._error(2)  # NVML_ERROR_INVALID_ARGUMENT
        return _Handle(self.devices[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.devices:
            if gpu.uuid == text:
                return _Handle(gpu)
            for mig in gpu.mig or []:
                if mig.uuid == text:
                    return _Handle(gpu, mig)
        raise self._error(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        return self.devices.index(handle.gpu)

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:
        return self._str(handle.mig.name if handle.mig else handle.gpu.name)

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        return handle.gpu.compute_capability

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str | bytes:
        return self._str(handle.mig.uuid if handle.mig else handle.gpu.uuid)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> nvmlPciInfo_t:
        if handle.mig is not None:
            raise self._error(NVML_ERROR_NOT_SUPPORTED)
        domain_s, bus_s, rest = handle.gpu.bus_id.split(":")
        domain, bus, device = int(domain_s, 16), int(bus_s, 16), int(rest.split(".")[0], 16)
        info = (_BytesPciInfo if self.strings_as_bytes else nvmlPciInfo_t)()
        info.busIdLegacy = (b"%04X:%02X:%02X.0" % (domain, bus, device))
        info.busId = (NVML_DEVICE_PCI_BUS_ID_FMT % (domain, bus, device)).encode()
        info.domain, info.bus, info.device = domain, bus, device
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        owner: FakeGpu | FakeMig = handle.mig or handle.gpu
        free = owner.total - owner.used - owner.reserved
        if not version:
            return c_nvmlMemory_t(owner.total, free, owner.used + owner.reserved)
        if "nvmlDeviceGetMemoryInfo_v2" in self.missing:  # the driver predates the v2 symbol
            raise self._error(NVML_ERROR_FUNCTION_NOT_FOUND)
        return c_nvmlMemory_v2_t(version, owner.total, owner.reserved, free, owner.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._versioned("nvmlDeviceGetComputeRunningProcesses", handle, graphics=False)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._list_processes(handle, graphics=False)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._list_processes(handle, graphics=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._versioned("nvmlDeviceGetGraphicsRunningProcesses", handle, graphics=True)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._list_processes(handle, graphics=True)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._list_processes(handle, graphics=True)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        if handle.mig is not None or handle.gpu.mig is None:
            raise self._error(NVML_ERROR_NOT_SUPPORTED)
        return [NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> ctypes.c_uint:
        return ctypes.c_uint(1 if handle.mig is not None else 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        if handle.gpu.mig is None:
            raise self._error(NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        if handle.gpu.mig is None:
            raise self._error(NVML_ERROR_NOT_SUPPORTED)
        mig = self._migs(handle.gpu).get(index)
        if mig is None:
            raise self._error(NVML_ERROR_NOT_FOUND)
        return _Handle(handle.gpu, mig)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: _Handle) -> _Handle:
        if handle.mig is None:
            raise self._error(2)
        return _Handle(handle.gpu)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        if handle.mig is None:
            raise self._error(2)
        return handle.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        if handle.mig is None:
            raise self._error(2)
        return handle.mig.compute_instance_id
