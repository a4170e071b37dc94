"""Find the live tensors of a device through gc, one record per storage.

The heap pass never calls isinstance/hasattr on arbitrary objects (lazy proxies and deprecated
modules warn or raise on ``__class__``): it selects by ``type(o)`` against the set of Tensor
subclasses, in C-level iteration (map/compress), which keeps it close to ``gc.get_objects()``.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from itertools import compress
from types import ModuleType
from typing import Any

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


def find_tensors(torch: ModuleType, device: str | None = None) -> LiveTensors:
    """Scan the gc heap for tensors (on ``device`` when given), grouped into storages."""
    types = tensor_types(torch)
    objects = gc.get_objects()
    scanned = len(objects)
    tensors = list(compress(objects, map(types.__contains__, map(type, objects))))
    del objects
    kept: list[Any] = []
    storage_of: dict[int, int] = {}
    storages: dict[int, StorageRecord] = {}
    byteless = 0
    for tensor in tensors:
        info = _storage_info(tensor)
        if info is None:
            byteless += 1
            continue
        key, where, nbytes = info
        if device is not None and where != device:
            continue
        kept.append(tensor)
        storage_of[id(tensor)] = key
        record = storages.get(key)
        if record is None:
            storages[key] = StorageRecord(
                key=key, device=where, bytes=nbytes, dtype=_dtype_name(tensor),
                shape=_shape(tensor), tensor_count=1,
            )
        else:
            storages[key] = _with_count(record, record.tensor_count + 1, tensor)
    tensors.clear()
    return LiveTensors(kept, storage_of, storages, scanned, byteless)


def _storage_info(tensor: Any) -> tuple[int, str, int] | None:
    """(storage key, device string, storage bytes), or None when the tensor holds no bytes."""
    if type(tensor).__name__ in _BYTELESS_TYPE_NAMES:
        return None
    try:
        if tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        nbytes = int(storage.nbytes())
        if nbytes == 0:
            return None
        return int(storage._cdata), str(tensor.device), nbytes
    except Exception:
        # Wrapper subclasses have no storage of their own; their inner tensors are found too.
        return None


def _with_count(record: StorageRecord, count: int, tensor: Any) -> StorageRecord:
    # Prefer the largest view's shape so the table shows the weight, not a slice of it.
    shape = _shape(tensor)
    if _numel(shape) > _numel(record.shape):
        return StorageRecord(record.key, record.device, record.bytes, _dtype_name(tensor), shape, count)
    return StorageRecord(record.key, record.device, record.bytes, record.dtype, record.shape, count)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shape(tensor: Any) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in tensor.shape)
    except Exception:
        return ()


def _dtype_name(tensor: Any) -> str:
    try:
        return str(tensor.dtype).removeprefix("torch.")
    except Exception:
        return "unknown"
