"""Read the tensors a heap pass found into one set of figures per storage (``LiveTensors``).

A tensor is read through ``torch._C.TensorBase``'s own methods with subclass ``__torch_function__``
off, so a subclass's overrides and properties never run; in C-level passes (``map``) a chunk of
tensors at a time, one by one only where a read fails. Views and tied weights share one storage
and count once; sparse tensors count the bytes of their index and value storages; an
``UntypedStorage`` held on its own counts as one. Records are made once the holders are known
(``LiveTensors.records``).
"""
from __future__ import annotations

from bisect import bisect_right
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import chain, compress, repeat
import operator
from types import ModuleType
from functools import cached_property
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from ..records.snapshot import StorageRecord, storage_records

# Types whose tensors hold no real bytes of their own (fake/functional wrappers).
_BYTELESS_TYPE_NAMES = frozenset({"FakeTensor", "FunctionalTensor"})


@dataclass
class LiveTensors:
    """Tensors found by one heap pass, grouped by storage. Drop it after use: it holds them."""

    tensors: list[Any]
    storage_of: dict[int, int]  # id(tensor) -> storage key
    sizes: dict[int, int]  # storage key -> its bytes: which storages there are, for the attribution
    byteless: int  # meta/fake tensors seen (they hold no device bytes)
    unreadable: int = 0  # tensors whose storage raised when read (wrapper subclasses, broken ones)
    # Each storage's figures, a list each in ``storage_records``' order (key first); made into
    # records once the holders are known, each record whole in one pass (no second write to each).
    columns: tuple[Sequence[Any], ...] = ()

    def release(self) -> None:
        """Drop every strong reference to the tensors."""
        self.tensors.clear()

    def records(self, holders: Mapping[int, Any] | None = None) -> list[StorageRecord]:
        """A record per storage, in the order found, each held as ``holders`` (key -> a record with
        ``kind`` and ``path``) says, else by "other" with no path."""
        return storage_records(*self.columns, holders=holders) if self.columns else []

    def sizes_and_addresses(self) -> tuple[list[int], list[int]]:
        """Each storage's bytes and data address, in the order of ``records()``."""
        return (list(self.columns[2]), list(self.columns[6])) if self.columns else ([], [])

    @cached_property
    def storages(self) -> dict[int, StorageRecord]:
        """storage key -> its record, held by no one yet (made on first use: a scan makes its own with
        ``records(holders)``)."""
        return dict(zip(self.columns[0], self.records())) if self.columns else {}


def tensor_types(torch: ModuleType) -> frozenset[type]:
    """Return torch.Tensor and all its subclasses (Parameter, quantized and wrapper subclasses)."""
    return frozenset(_subclasses(torch.Tensor))


def _subclasses(base: type) -> list[type]:
    # Walked each scan (a few dozen classes): subclasses defined later are never missed. By id:
    # a subclass's metaclass may define __eq__ without __hash__.
    found: dict[int, type] = {id(base): base}
    stack: list[type] = [base]
    sub: type
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if id(sub) not in found:
                found[id(sub)] = sub
                stack.append(sub)
    return list(found.values())


def storage_types(torch: ModuleType) -> list[type]:
    """torch.UntypedStorage and its subclasses: a storage held on its own, without a tensor."""
    base = getattr(torch, "UntypedStorage", None)
    return _subclasses(base) if isinstance(base, type) else []


def group_storages(tensors: list[Any], types: frozenset[type], device: str | None = None) -> LiveTensors:
    """Group ``tensors`` (emptied on return) into one record per storage on ``device`` (all when None).

    ``tensors`` may also hold bare ``UntypedStorage`` objects (a storage held without a tensor).
    """
    torch = sys.modules.get("torch")
    reader = _Reader(torch) if torch is not None else None
    byteless_types = frozenset(id(t) for t in types if t.__name__ in _BYTELESS_TYPE_NAMES)
    bare = frozenset(map(id, storage_types(torch))) if torch is not None else frozenset()
    kept: list[Any] = []
    storage_of: dict[int, int] = {}
    # storage key -> [device, bytes, tensor naming it, tensor count, that tensor's shape or None, address];
    # shapes and dtypes are read once per storage at the end, not once per tensor.
    groups: dict[int, list[Any]] = {}
    device_names: dict[Any, str] = {}
    counts = [0, 0]  # byteless, unreadable
    dense: list[Any] = []
    sparse: list[tuple[Any, str]] = []
    bare_storages: list[Any] = []
    claimed: dict[int, int] = {}  # a sparse tensor's index storage -> its record's key
    # Where every dense tensor has a storage of its own (and no sparse one came first): their groups
    # as columns (keys, devices, sizes, tensors, addresses, dtypes, shapes), not a row each (100,000 storages).
    bulk: list[list[Any]] = []
    if reader is None:
        tensors.clear()
        return LiveTensors(kept, storage_of, {}, 0, 0)
    with reader.no_subclass_code():
        figures = _sort_kinds(tensors, reader, byteless_types, bare, dense, sparse, bare_storages, device_names,
                              counts)
        tensors.clear()
        # Sparse first: the index and value tensors its parts were read through then join its
        # record (their storages are its bytes) rather than count again, unnamed, as 'other'.
        for tensor, where in sparse:
            if device is not None and where != device:
                continue
            try:
                parts = reader.sparse_parts(tensor)
            except Exception:
                counts[1] += 1
                continue
            nbytes = sum(b for k, b in parts if k not in groups and k not in claimed)
            if not parts or nbytes == 0:
                counts[0] += 1
                continue
            key = parts[-1][0]
            kept.append(tensor)
            storage_of[id(tensor)] = key
            groups[key] = [where, nbytes, tensor, 1, reader.shape(tensor), 0]
            for part_key, _ in parts[:-1]:
                claimed[part_key] = key
        sparse.clear()
        _group_dense(dense, figures, reader, device, groups, claimed, kept, storage_of, device_names, counts, bulk)
        dense.clear()
        del figures
        sizes = dict(zip(bulk[0], bulk[2])) if bulk else {}  # key -> bytes: the bulk groups' now, every one's at the end
        # A storage object counts only for a storage no tensor views (one held on its own); the
        # ones a tensor's storage() call left behind are not holders.
        # A storage sliced into others counts only the bytes no counted storage covers: each byte
        # once. On the cpu such a base is a file mapping (safetensors maps the whole file, then
        # views each tensor's range) that the views keep alive from C++: its other bytes are file
        # pages, not memory anything uses, and freeing them is freeing the views: not counted.
        # Reading a tensor's storage leaves that storage's object alive (torch keeps it while the
        # tensor lives): one per counted storage after a scan, skipped by its key before other reads.
        counted: _Ranges | None = None
        try:  # most are the storage objects of counted tensors: dropped by key in one pass
            storage_keys = list(map(reader.cdata, bare_storages))
            for grouped in (sizes, groups):
                unseen = list(map(operator.not_, map(grouped.__contains__, storage_keys)))
                bare_storages[:] = compress(bare_storages, unseen)
                storage_keys[:] = compress(storage_keys, unseen)
        except Exception:
            pass  # read one by one below
        for storage in bare_storages:
            try:
                key = int(reader.cdata(storage))
                if key in groups or key in claimed or key in sizes:
                    continue
                key, nbytes, where = reader.bare_storage(storage, device_names)
            except Exception:
                counts[1] += 1
                continue
            try:
                address = reader.data_ptr(storage) if nbytes else 0
            except Exception:
                continue  # no data of its own (a wrapper subclass's storage): no bytes to count
            if not nbytes or (device is not None and where != device):
                continue
            if counted is None:
                counted = _Ranges(chain(((g[5], g[1], g[0]) for g in groups.values() if g[5]),
                                        ((a, n, w) for w, n, a in (zip(*bulk[1:3], bulk[4]) if bulk else ()) if a)))
            covered = counted.overlap(address, nbytes, where) if address else 0
            nbytes = 0 if covered and where == "cpu" else nbytes - covered
            if nbytes <= 0:
                continue
            kept.append(storage)
            storage_of[id(storage)] = key
            groups[key] = [where, nbytes, None, 0, (nbytes,), address]
        bare_storages.clear()
        columns = _columns(groups, reader, bulk)
    bulk.clear()
    sizes.update((key, group[1]) for key, group in groups.items())
    groups.clear()
    return LiveTensors(kept, storage_of, sizes, counts[0], counts[1], columns)


def _sort_kinds(tensors: list[Any], reader: _Reader, byteless_types: frozenset[int], bare: frozenset[int],
                dense: list[Any], sparse: list[tuple[Any, str]], bare_storages: list[Any],
                device_names: dict[Any, str], counts: list[int]) -> _Figures | None:
    """Sort the heap pass's finds into dense tensors, sparse ones (with their device), bare storages,
    and counts of byteless (meta, fake) and unreadable ones. In C-level passes where every read
    succeeds (the dense tensors' figures read on the way, returned); one by one (each failure
    counted) where one fails."""
    tids = list(map(id, map(type, tensors)))
    special = byteless_types | bare
    if special and not special.isdisjoint(tids):
        is_special = list(map(special.__contains__, tids))
        if byteless_types.isdisjoint(tids):  # the storage objects earlier scans' reads left: all bare
            bare_storages.extend(compress(tensors, is_special))
        else:
            for tensor, tid in zip(compress(tensors, is_special), compress(tids, is_special)):
                if tid in byteless_types:
                    counts[0] += 1
                else:
                    bare_storages.append(tensor)
        tensors = list(compress(tensors, map(operator.not_, is_special)))
    figures = _read_figures(tensors, reader, device_names, only_dense=True)
    if figures is not None:
        dense.extend(tensors)
        return figures
    for tensor in tensors:
        try:
            if reader.is_meta(tensor):
                counts[0] += 1
            elif reader.layout(tensor) is not reader.strided:
                sparse.append((tensor, _device_name(reader.device(tensor), device_names)))
            else:
                dense.append(tensor)
        except Exception:
            counts[1] += 1
    return None


# (storage keys, device names, storage sizes, addresses, dtypes, shapes): a list each, one item a tensor.
_Figures = tuple[list[int], list[str], list[int], list[int], list[Any], list[tuple[int, ...]]]
# Tensors read per chunk: its tensors stay in cache from one C-level pass to the next (each pass over
# 100,000 tensors lying scattered fetched every one from memory again: twice the time).
CHUNK = 2048


def _read_figures(tensors: list[Any], reader: _Reader, device_names: dict[Any, str], *,
                  only_dense: bool) -> _Figures | None:
    """Each tensor's figures, in C-level passes a chunk at a time; None where a read fails or
    (``only_dense``) a tensor is meta or not strided: the caller reads those one by one."""
    keys: list[int] = []
    sizes: list[int] = []
    addresses: list[int] = []
    devices: list[Any] = []
    dtypes: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    try:
        for at in range(0, len(tensors), CHUNK):
            chunk = tensors[at:at + CHUNK]
            if only_dense and (any(map(reader.is_meta, chunk))
                               or not all(map(operator.is_, map(reader.layout, chunk), repeat(reader.strided)))):
                return None
            keys += map(reader.key, chunk)
            storage_objects = list(map(reader.storage, chunk))
            sizes += map(reader.nbytes, storage_objects)
            addresses += map(reader.data_ptr, storage_objects)  # a wrapper subclass's storage has none: raises
            del storage_objects
            devices += map(reader.device, chunk)
            dtypes += map(reader.dtype, chunk)
            shapes += map(tuple, map(reader._shape, chunk))
        for where in set(devices):
            _device_name(where, device_names)
    except Exception:
        return None
    return keys, list(map(device_names.__getitem__, devices)), sizes, addresses, dtypes, shapes


def _group_dense(dense: list[Any], figures: _Figures | None, reader: _Reader, device: str | None,
                 groups: dict[int, list[Any]], claimed: dict[int, int], kept: list[Any], storage_of: dict[int, int],
                 device_names: dict[Any, str], counts: list[int], bulk: list[list[Any]]) -> None:
    """Group dense tensors by storage: the first tensor of each new storage by its ``figures`` (read
    in C-level passes where not given), the others one by one (``_group_each``). Where each has a
    storage of its own and no group was made before, their groups are ``bulk``'s columns."""
    if figures is None:
        figures = _read_figures(dense, reader, device_names, only_dense=False)
    if figures is None:
        _group_each(dense, reader, device, groups, claimed, kept, storage_of, device_names, counts)
        _drop_placeholders(groups)
        return
    keys, wheres, sizes, addresses, dtypes, shapes = figures
    if claimed:
        keys = [claimed.get(k, k) for k in keys]
    first = dict(zip(reversed(keys), reversed(range(len(keys)))))  # storage -> its first tensor's index
    for key in groups.keys() & first.keys():
        del first[key]  # a storage a sparse tensor counts: joined one by one
    heads, head_keys = dense, keys
    if len(first) != len(dense):
        at = sorted(first.values())
        heads, head_keys = [dense[i] for i in at], [keys[i] for i in at]
        wheres, sizes, addresses = [wheres[i] for i in at], [sizes[i] for i in at], [addresses[i] for i in at]
    counted = list(map(bool, sizes))  # an empty storage holds no bytes: byteless
    if device is not None:
        counted = list(map(operator.and_, counted, map(device.__eq__, wheres)))
    if all(counted):
        kept.extend(heads)
        storage_of.update(zip(map(id, heads), head_keys))
        if heads is dense and not groups:
            bulk[:] = [head_keys, wheres, sizes, list(heads), addresses, dtypes, shapes]  # the caller empties dense
            return
        groups.update(zip(head_keys, map(list, zip(wheres, sizes, heads, repeat(1), repeat(None), addresses))))
    else:
        for tensor, key, where, nbytes, address in zip(heads, head_keys, wheres, sizes, addresses):
            if nbytes == 0:
                counts[0] += 1
                groups[key] = _EMPTY
            elif device is None or where == device:
                kept.append(tensor)
                storage_of[id(tensor)] = key
                groups[key] = [where, nbytes, tensor, 1, None, address]
            else:
                groups[key] = _ELSEWHERE
    if heads is not dense:
        is_head = set(map(id, heads))
        _group_each([t for t in dense if id(t) not in is_head], reader, device, groups, claimed, kept,
                    storage_of, device_names, counts)
    _drop_placeholders(groups)


def _drop_placeholders(groups: dict[int, list[Any]]) -> None:
    for key in [k for k, g in groups.items() if g is _EMPTY or g is _ELSEWHERE]:
        del groups[key]


# Placeholders while grouping: a storage read as empty (its other tensors are byteless too), or on
# another device than the one asked about (its other tensors are left out too).
_EMPTY: list[Any] = ["empty"]
_ELSEWHERE: list[Any] = ["elsewhere"]


def _columns(groups: dict[int, list[Any]], reader: _Reader, bulk: list[list[Any]]) -> tuple[Sequence[Any], ...]:
    """Each storage group's figures as ``storage_records`` takes them: the bulk groups' as read (one
    tensor each), then the rows'."""
    if not groups and not bulk:
        return ()
    columns: tuple[Sequence[Any], ...] = ()
    if bulk:
        keys, wheres, sizes, _, addresses, dtypes, shapes = bulk
        columns = (keys, wheres, sizes, _dtype_names(dtypes), shapes, [1] * len(keys), addresses)
    if not groups:
        return columns
    rows = _row_columns(groups, reader)
    return tuple([*column, *row] for column, row in zip(columns, rows)) if columns else rows


def _row_columns(groups: dict[int, list[Any]], reader: _Reader) -> tuple[Sequence[Any], ...]:
    """The rows' figures as columns; the naming tensors' dtypes and shapes read in C-level passes
    where every row has one (a bare storage is uint8 of its size) and every read succeeds."""
    keys = list(groups)
    wheres, sizes, named, counts, shapes, addresses = zip(*groups.values())
    read_in_bulk = None
    if not any(map(operator.is_, named, repeat(None))):  # a bare storage has no tensor to read
        try:
            read_in_bulk = _dtype_names(list(map(reader.dtype, named))), list(map(tuple, map(reader._shape, named)))
        except Exception:
            pass
    if read_in_bulk is not None:
        dtype_names, read = read_in_bulk
        if not all(map(operator.is_, shapes, repeat(None))):  # the largest view's shape, kept while grouping
            read = [r if shape is None else shape for shape, r in zip(shapes, read)]
    else:  # one by one: a failing read gives that storage an unknown dtype or no shape
        cache: dict[Any, str] = {}
        dtype_names = [_dtype_name(t, cache, reader) if t is not None else "uint8" for t in named]
        read = [shape if shape is not None else reader.shape(t) for t, shape in zip(named, shapes)]
    return keys, wheres, sizes, dtype_names, read, counts, addresses


def _group_each(dense: list[Any], reader: _Reader, device: str | None, groups: dict[int, list[Any]],
                claimed: dict[int, int], kept: list[Any], storage_of: dict[int, int],
                device_names: dict[Any, str], counts: list[int]) -> None:
    """``_group_dense`` one tensor at a time: a read that fails counts that tensor alone as unreadable."""
    for tensor in dense:
        try:
            key = reader.key(tensor)
            key = claimed.get(key, key)
            group = groups.get(key)
            if group is _EMPTY:
                counts[0] += 1
                continue
            if group is _ELSEWHERE:
                continue
            if group is None:
                # Read once per storage (the storage object is made for it; the key was not).
                storage = reader.storage(tensor)
                nbytes = int(reader.nbytes(storage))
                if nbytes == 0:
                    groups[key] = _EMPTY
                    counts[0] += 1
                    continue
                address = reader.data_ptr(storage)  # a wrapper subclass's storage has none: it raises
                del storage
                where = _device_name(reader.device(tensor), device_names)
            else:
                where = group[0]
        except Exception:
            # Wrapper subclasses have no storage of their own; their inner tensors are found too.
            counts[1] += 1
            continue
        if device is not None and where != device:
            if group is None:
                groups[key] = _ELSEWHERE
            continue
        kept.append(tensor)
        storage_of[id(tensor)] = key
        if group is None:
            groups[key] = [where, nbytes, tensor, 1, None, address]
        else:
            group[3] += 1
            # Prefer the largest view's shape so the table shows the weight, not a slice of it.
            best = group[4] if group[4] is not None else reader.shape(group[2])
            shape = reader.shape(tensor)
            # Equal size: the view with more dimensions (load_file's 16000×512 weight, not its flat base).
            if (_numel(shape), len(shape)) > (_numel(best), len(best)):
                group[2], group[4] = tensor, shape
            else:
                group[4] = best


class _Ranges:
    """Address ranges of storages already counted, per device: how much of a range they cover."""

    def __init__(self, ranges: Iterable[tuple[int, int, str]]) -> None:
        self._by_device: dict[str, tuple[list[int], list[int]]] = {}
        for address, nbytes, where in sorted(ranges):
            starts, ends = self._by_device.setdefault(where, ([], []))
            starts.append(address)
            ends.append(address + nbytes)

    def overlap(self, address: int, nbytes: int, where: str) -> int:
        starts, ends = self._by_device.get(where, ((), ()))
        end, covered, reach = address + nbytes, 0, address
        # Ranges are sorted by start; `reach` skips bytes two counted views share.
        for i in range(max(bisect_right(starts, address) - 1, 0), len(starts)):
            if starts[i] >= end:
                break
            lo, hi = max(starts[i], reach), min(ends[i], end)
            if hi > lo:
                covered += hi - lo
                reach = hi
        return covered


class _Reader:
    """A tensor's figures read through ``torch._C.TensorBase`` itself: no subclass override or
    property runs, and with subclass ``__torch_function__`` off, no user code at all."""

    def __init__(self, torch: ModuleType) -> None:
        base = torch._C.TensorBase
        storage = torch._C.StorageBase
        self.strided = torch.strided
        self._torch = torch
        self.is_meta = base.is_meta.__get__
        self.layout = base.layout.__get__
        self.device = base.device.__get__
        self.storage = base.untyped_storage
        self._shape = base.shape.__get__
        self.dtype = base.dtype.__get__
        self.nbytes = storage.nbytes
        self.data_ptr = storage.data_ptr
        self.cdata = storage._cdata.__get__
        self._storage_device = storage.device.__get__
        self._base = base
        address = getattr(torch._C, "_storage_address", None)  # the StorageImpl's address, no object made
        self.key = address if address is not None else (lambda t: int(self.cdata(self.storage(t))))

    def no_subclass_code(self) -> Any:
        disable = getattr(self._torch._C, "DisableTorchFunctionSubclass", None)
        return disable() if disable is not None else nullcontext()

    def shape(self, tensor: Any) -> tuple[int, ...]:
        try:
            return tuple(map(int, self._shape(tensor)))
        except Exception:
            return ()

    def bare_storage(self, storage: Any, names: dict[Any, str]) -> tuple[int, int, str]:
        return (int(self.cdata(storage)), int(self.nbytes(storage)),
                _device_name(self._storage_device(storage), names))

    def sparse_parts(self, tensor: Any) -> list[tuple[int, int]]:
        """(storage key, bytes) of a sparse tensor's index and value tensors, values last."""
        base, layout, torch = self._base, self.layout(tensor), self._torch
        if layout is torch.sparse_coo:
            parts: tuple[Any, ...] = (base._indices(tensor), base._values(tensor))
        elif layout is torch.sparse_csr or layout is torch.sparse_bsr:
            parts = (base.crow_indices(tensor), base.col_indices(tensor), base.values(tensor))
        elif layout is torch.sparse_csc or layout is torch.sparse_bsc:
            parts = (base.ccol_indices(tensor), base.row_indices(tensor), base.values(tensor))
        else:
            raise ValueError("unknown layout")
        result = []
        for part in parts:
            result.append((int(self.key(part)), int(self.nbytes(self.storage(part)))))
        return result


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


def _dtype_names(dtypes: list[Any]) -> list[str]:
    """``float32`` for ``torch.float32``, each distinct dtype formatted once."""
    names = {d: str(d).removeprefix("torch.") for d in set(dtypes)}
    return list(map(names.__getitem__, dtypes))


def _dtype_name(tensor: Any, names: dict[Any, str], reader: _Reader | None) -> str:
    try:
        dtype = reader.dtype(tensor) if reader is not None else tensor.dtype
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
