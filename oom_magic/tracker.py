"""Find the live tensors of a device through gc, one record per storage.

The heap pass never calls isinstance/hasattr on arbitrary objects (lazy proxies and deprecated
modules warn or raise on ``__class__``): it selects by ``type(o)`` against the set of Tensor
subclasses, in C-level iteration (map/compress), which keeps it close to ``gc.get_objects()``.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress
from types import ModuleType
from typing import Any, Iterator

# Types whose tensors hold no real bytes of their own (fake/functional wrappers).
_BYTELESS_TYPE_NAMES = frozenset({"FakeTensor", "FunctionalTensor"})


@dataclass(frozen=True)
class StorageRecord:
    """One tensor storage on a device: views and tied weights share one and count once."""

    key: int
    device: str
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    tensor_count: int
    holder_kind: str = "other"  # user | output-cache | traceback | garbage | other
    holder_path: str | None = None


@dataclass
class LiveTensors:
    """Tensors found by one heap pass, grouped by storage. Drop it after use: it holds them."""

    tensors: list[Any]
    storage_of: dict[int, int]  # id(tensor) -> storage key
    storages: dict[int, StorageRecord]
    objects_scanned: int
    byteless: int  # meta/fake tensors seen (they hold no device bytes)
    unreadable: int = 0  # tensors whose storage raised when read (wrapper subclasses, broken ones)

    def release(self) -> None:
        """Drop every strong reference to the tensors."""
        self.tensors.clear()


def tensor_types(torch: ModuleType) -> frozenset[type]:
    """Return torch.Tensor and all its subclasses (Parameter, quantized and wrapper subclasses)."""
    # Walked each scan (a few dozen classes): subclasses defined later are never missed.
    found: set[type] = {torch.Tensor}
    stack = [torch.Tensor]
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return frozenset(found)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic collection off while a scan runs, back as it was afterwards.

    A scan allocates a record per storage and a queue entry per object walked; with the
    collector on, those allocations trigger collections that traverse the whole heap again
    (a 100,000-tensor heap: 0.6 s of grouping became 1.2 s). Nothing is collected or freed here.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def find_tensors(torch: ModuleType, device: str | None = None) -> LiveTensors:
    """Scan the gc heap for tensors (on ``device`` when given), grouped into storages."""
    types = tensor_types(torch)
    with gc_paused():
        objects = gc.get_objects()
        scanned = len(objects)
        tensors = list(compress(objects, map(types.__contains__, map(type, objects))))
        del objects
        return group_storages(tensors, types, device, scanned)


def group_storages(tensors: list[Any], types: frozenset[type], device: str | None = None,
                   objects_scanned: int = 0) -> LiveTensors:
    """Group ``tensors`` (emptied on return) into one record per storage on ``device`` (all when None)."""
    byteless_types = frozenset(t for t in types if t.__name__ in _BYTELESS_TYPE_NAMES)
    scanned = objects_scanned
    kept: list[Any] = []
    storage_of: dict[int, int] = {}
    # storage key -> [device, bytes, tensor naming it, tensor count, that tensor's shape or None];
    # shapes and dtypes are read once per storage at the end, not once per tensor.
    groups: dict[int, list[Any]] = {}
    device_names: dict[Any, str] = {}
    byteless = unreadable = 0
    for tensor in tensors:
        if type(tensor) in byteless_types:
            byteless += 1
            continue
        try:
            if tensor.is_meta:
                byteless += 1
                continue
            storage = tensor.untyped_storage()
            nbytes = int(storage.nbytes())
            if nbytes == 0:
                byteless += 1
                continue
            key = int(storage._cdata)
            where = _device_name(tensor.device, device_names)
        except Exception:
            # Wrapper subclasses have no storage of their own; their inner tensors are found too.
            unreadable += 1
            continue
        if device is not None and where != device:
            continue
        kept.append(tensor)
        storage_of[id(tensor)] = key
        group = groups.get(key)
        if group is None:
            groups[key] = [where, nbytes, tensor, 1, None]
        else:
            group[3] += 1
            # Prefer the largest view's shape so the table shows the weight, not a slice of it.
            best = group[4] if group[4] is not None else _shape(group[2])
            shape = _shape(tensor)
            if _numel(shape) > _numel(best):
                group[2], group[4] = tensor, shape
            else:
                group[4] = best
    tensors.clear()
    dtype_names: dict[Any, str] = {}
    storages = {
        key: StorageRecord(key, where, nbytes, _dtype_name(named, dtype_names),
                           shape if shape is not None else _shape(named), count)
        for key, (where, nbytes, named, count, shape) in groups.items()
    }
    groups.clear()
    return LiveTensors(kept, storage_of, storages, scanned, byteless, unreadable)


def _device_name(device: Any, names: dict[Any, str]) -> str:
    """``str(device)``, cached per device: formatting a torch.device costs more than the rest of a tensor."""
    try:
        return names[device]
    except KeyError:
        names[device] = text = str(device)
        return text
    except Exception:  # an unhashable device from an exotic subclass
        return str(device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shape(tensor: Any) -> tuple[int, ...]:
    try:
        return tuple(map(int, tensor.shape))
    except Exception:
        return ()


def _dtype_name(tensor: Any, names: dict[Any, str]) -> str:
    try:
        dtype = tensor.dtype
    except Exception:
        return "unknown"
    try:
        return names[dtype]
    except KeyError:
        pass
    except Exception:  # an unhashable dtype from an exotic subclass
        names = {}
    try:
        name = str(dtype).removeprefix("torch.")
    except Exception:
        return "unknown"
    try:
        names[dtype] = name
    except Exception:
        pass
    return name
