"""The %gpumem record: what uses a device right now and who holds each live storage.

Also home of the holder kinds (who keeps a storage alive), which the heap attribution
(``holders``), cleanup and the renderers share.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

from .data import frozen_records, record_dict
from .shown import Shown

if TYPE_CHECKING:  # annotation only: the reading's record lives beside the code that reads it
    from .device import DeviceReading

HolderKind = Literal["user", "output-cache", "traceback", "garbage", "other"]
USER: Final = "user"
OUTPUT_CACHE: Final = "output-cache"
TRACEBACK: Final = "traceback"
GARBAGE: Final = "garbage"
OTHER: Final = "other"
# Held only by IPython's output cache, a stored traceback or garbage: safe to free.
STALE_KINDS: Final[tuple[HolderKind, ...]] = (OUTPUT_CACHE, TRACEBACK, GARBAGE)
HOLDER_KINDS: Final[tuple[HolderKind, ...]] = (USER, OUTPUT_CACHE, TRACEBACK, GARBAGE, OTHER)

View = Literal["table", "json"]
# The parts of a device the bar and tables show, in their fixed order (render.segments names them).
SegmentKey = Literal["user", "stale", "other", "process-rest", "untracked", "cache", "context", "others", "mapped",
                     "free"]


@dataclass(frozen=True)
class StorageRecord:
    """One tensor storage on a device: views and tied weights share one and count once."""

    key: int
    device: str
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    tensor_count: int
    holder_kind: HolderKind = "other"
    holder_path: str | None = None
    address: int = 0  # the storage's data pointer (0: not read): tells file-mapped bytes on the cpu
    mapped_bytes: int = 0  # cpu: of bytes, a view of a memory-mapped file (file pages, not anonymous memory)


def storage_records(keys: Iterable[int], devices: Iterable[str], sizes: Iterable[int], dtypes: Iterable[str],
                    shapes: Iterable[tuple[int, ...]], tensor_counts: Iterable[int], addresses: Iterable[int], *,
                    holders: Mapping[int, Any] | None = None) -> list[StorageRecord]:
    """A ``StorageRecord`` per key, held as ``holders`` (key -> a record with ``kind`` and ``path``) says,
    else by "other" with no path. Made column by column, each record whole at once (``frozen_records``:
    no call per record): a scan of 100,000 tensors makes 100,000 of them, and writing the holders into
    them afterwards cost as much again (each record fetched back from memory)."""
    held = (holders or {}).get
    fields = [{"key": key, "device": device, "bytes": nbytes, "dtype": dtype, "shape": shape,
               "tensor_count": count, "holder_kind": OTHER if (holder := held(key)) is None else holder.kind,
               "holder_path": None if holder is None else holder.path, "address": address, "mapped_bytes": 0}
              for key, device, nbytes, dtype, shape, count, address
              in zip(keys, devices, sizes, dtypes, shapes, tensor_counts, addresses)]
    return frozen_records(StorageRecord, fields)


@dataclass(frozen=True)
class KernelInfo:
    """A process that is a kernel of this user's Jupyter server: its notebook and how to stop it."""

    notebook_path: str | None  # relative to the server's root, as Jupyter shows it; None: no session
    kernel_id: str
    server_url: str            # the server's address, without its token
    stop_hint: str             # one line: the notebook's menu, or kill <pid>


@dataclass(frozen=True)
class HolderGroup:
    """Storages grouped under one holder path, for the top-N table."""

    kind: HolderKind
    path: str
    bytes: int
    storages: int
    dtype: str
    shape: tuple[int, ...]
    mapped_bytes: int = 0  # cpu: of bytes, views of a memory-mapped file


@dataclass(frozen=True)
class FilePages:
    """cpu: the tensors that are views of memory-mapped files (safetensors weights in their stored dtype).

    Those bytes are the file's pages, not this process's anonymous memory: in memory only once
    read, counted by the kernel as available (it can drop them), and freeing the tensors gives
    none of it back. The bar shows this process's file pages in memory now beside free, never as used.
    """

    mapped_by_kind: tuple[tuple[HolderKind, int], ...]  # tensor bytes that are views of a file, per holder kind
    file_bytes: int             # distinct file bytes those views cover (one file loaded twice counts once)
    resident: int | None        # of file_bytes, the pages in memory now; None where not looked up (too many pages)
    files: int                  # how many distinct files the views come from
    process_file_resident: int | None  # this process's resident set that is file pages (Linux RssFile)

    @property
    def mapped_bytes(self) -> int:
        """Tensor bytes, of every holder kind, that are views of a memory-mapped file."""
        return sum(b for _, b in self.mapped_by_kind)

    def kind_bytes(self, kind: HolderKind) -> int:
        """Of one holder kind's tensor bytes, those that are views of a file."""
        return dict(self.mapped_by_kind).get(kind, 0)


@dataclass(frozen=True)
class Snapshot(Shown):
    """What uses a device right now and who holds it; int bytes, None where unknown."""

    device: str
    reading: DeviceReading
    storages: tuple[StorageRecord, ...]
    bytes_by_kind: tuple[tuple[HolderKind, int], ...]
    scan_seconds: float
    objects_walked: int  # followed one by one from the roots (0: remembered paths or the counters answered)
    attribution_complete: bool
    notes: tuple[str, ...] = ()
    top_n: int = 10
    view: View = "table"  # how the notebook/terminal shows it
    heap_scan: bool = True  # False: the quick view (no heap pass; garbage and library-held not found)
    # Other processes that are kernels of this user's Jupyter servers: (pid, notebook and how to stop it).
    kernels: tuple[tuple[int, KernelInfo], ...] = ()
    # cpu: the tensors that are views of memory-mapped files, and this process's file pages;
    # None where not read (not Linux, a GPU).
    file_pages: FilePages | None = None
    heap_passed: bool = False  # the collector's whole heap was passed over (not the quick view or the counters)

    # Figures the user asks for by name.
    def kind_bytes(self, kind: HolderKind) -> int:
        """Bytes of storages held by one holder kind (user, output-cache, traceback, garbage, other)."""
        return dict(self.bytes_by_kind).get(kind, 0)

    @property
    def tracked_bytes(self) -> int:
        """Bytes in every live storage the heap scan found on this device."""
        return sum(b for _, b in self.bytes_by_kind)

    @property
    def user_bytes(self) -> int:
        """Bytes reachable from the user's variables."""
        return self.kind_bytes(USER)

    @property
    def stale_bytes(self) -> int:
        """Bytes only the output cache, a stored traceback or garbage holds: safe to free."""
        return sum(self.kind_bytes(k) for k in STALE_KINDS)

    @property
    def other_bytes(self) -> int:
        """Bytes held by something else (a library global, an object the walk could not name)."""
        return self.kind_bytes(OTHER)

    @property
    def user_mapped_bytes(self) -> int | None:
        """cpu: of user, bytes that are views of a memory-mapped file (not resident until read); None if not read."""
        return None if self.file_pages is None else self.file_pages.kind_bytes(USER)

    @property
    def untracked_bytes(self) -> int | None:
        """Allocator total minus tracked storages (autograd graph, workspaces); None without an allocator."""
        if self.reading.allocated is None or self.device == "cpu":
            return None
        return self.reading.allocated - self.tracked_bytes

    def parts(self) -> tuple[tuple[SegmentKey, int | None], ...]:
        """The device split into the bar's parts, in order: user | stale | other tensors | untracked |
        cache | context | other processes | free; None where unknown. They add up to the device.

        On the cpu the tensor parts are anonymous memory only: tensors that are views of a mapped
        file are its file pages, which the kernel counts as available; this process's file pages in
        memory now (those weights', its libraries') are ``mapped``, beside free (the rest of
        available). The rest of this process is its anonymous resident memory outside tensors, and
        other processes what is used beyond it, so user + stale + other + rest + others = used, and
        mapped + free = available.
        """
        r = self.reading
        if self.device != "cpu":
            return (("user", self.user_bytes), ("stale", self.stale_bytes), ("other", self.other_bytes),
                    ("untracked", self.untracked_bytes), ("cache", r.cache), ("context", r.context),
                    ("others", r.other_processes_used), ("free", r.free))
        pages = self.file_pages
        user = self.user_bytes - (pages.kind_bytes(USER) if pages else 0)
        stale = self.stale_bytes - (sum(pages.kind_bytes(k) for k in STALE_KINDS) if pages else 0)
        other = self.other_bytes - (pages.kind_bytes(OTHER) if pages else 0)
        in_tensors = user + stale + other
        anonymous = None
        if r.process_used is not None:
            anonymous = r.process_used - (pages.process_file_resident or 0 if pages else 0)
        rest = None if anonymous is None else max(anonymous - in_tensors, 0)
        elsewhere = None
        if r.used is not None and anonymous is not None:
            elsewhere = max(r.used - max(anonymous, in_tensors), 0)
        mapped = None if pages is None else pages.process_file_resident
        free = r.free
        if mapped is not None and free is not None:
            mapped = min(mapped, free)
            free -= mapped
        return (("user", user), ("stale", stale), ("other", other), ("process-rest", rest),
                ("others", elsewhere), ("mapped", mapped), ("free", free))

    def holders(self, kind: HolderKind | None = None) -> tuple[HolderGroup, ...]:
        """Storages grouped by holder path, largest first (optionally one kind only)."""
        groups = self._holder_groups
        return groups if kind is None else tuple(g for g in groups if g.kind == kind)

    @cached_property
    def _holder_groups(self) -> tuple[HolderGroup, ...]:
        # Grouped once per snapshot: every view of it (table, caption, details, exports) asks again.
        groups: dict[tuple[HolderKind, str], list[StorageRecord]] = {}
        for record in self.storages:
            groups.setdefault((record.holder_kind, record.holder_path or "?"), []).append(record)
        result = []
        for (k, path), rs in groups.items():
            largest = max(rs, key=lambda r: r.bytes)
            result.append(HolderGroup(k, path, sum(r.bytes for r in rs), len(rs), largest.dtype, largest.shape,
                                      sum(r.mapped_bytes for r in rs)))
        return tuple(sorted(result, key=lambda g: (-g.bytes, g.path)))

    def held_by(self, path_prefix: str) -> int:
        """Bytes of storages whose holder path starts with ``path_prefix`` (e.g. ``"model"``)."""
        return sum(r.bytes for r in self.storages
                   if r.holder_path is not None and _path_under(r.holder_path, path_prefix))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every figure (int bytes, None where unknown).

        The holders and storages lists are the ``top_n`` largest, as the table lists them (0: all),
        with how many there are in all: a big heap's every storage is ``%gpumem --json --all``.
        """
        reading = record_dict(self.reading)
        reading.update(cache=self.reading.cache, context=self.reading.context)
        holders, storages = self.holders(), self.storages  # storages are sorted largest first
        listed = (holders, storages) if self.top_n <= 0 else (holders[: self.top_n], storages[: self.top_n])
        return {
            "device": self.device,
            "reading": reading,
            "bytes_by_kind": dict(self.bytes_by_kind),
            "user_bytes": self.user_bytes,
            "stale_bytes": self.stale_bytes,
            "other_bytes": self.other_bytes,
            "tracked_bytes": self.tracked_bytes,
            "untracked_bytes": self.untracked_bytes,
            "user_mapped_bytes": self.user_mapped_bytes,  # cpu: of user, views of a memory-mapped file
            "file_pages": None if self.file_pages is None else {
                **record_dict(self.file_pages), "mapped_by_kind": dict(self.file_pages.mapped_by_kind)},
            "segments": dict(self.parts()),
            "holders_total": len(holders),
            "holders": record_dict(listed[0]),
            "storages_total": len(storages),
            "storages": record_dict(listed[1]),
            "scan_seconds": self.scan_seconds,
            "objects_walked": self.objects_walked,
            "heap_passed": self.heap_passed,
            "attribution_complete": self.attribution_complete,
            "notes": list(self.notes),
            "heap_scan": self.heap_scan,
            "jupyter_kernels": {str(pid): record_dict(info) for pid, info in self.kernels},
        }

    def scan_summary(self) -> str:
        """What the scan did and how long it took, in one line: ``scanned the heap and walked 4,210 objects
        in 95.3 ms``."""
        took = f"in {self.scan_seconds * 1000:.1f} ms"
        walked = f"walked {self.objects_walked:,} objects"
        if self.heap_passed:
            return f"scanned the heap and {walked} {took}" if self.objects_walked else f"scanned the heap {took}"
        return f"{walked} {took}" if self.objects_walked else f"checked {took}"

    def to_json_text(self) -> str:
        """The snapshot as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def __repr__(self) -> str:
        return (f"<Snapshot {self.device}: {len(self.storages)} storages, user={self.user_bytes} B, "
                f"stale={self.stale_bytes} B, untracked={self.untracked_bytes}>")


def _path_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "[", prefix + " "))

