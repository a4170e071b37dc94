"""Say which bytes of this process's memory are mapped from a file (not anonymous, resident memory).

On the cpu, ``from_pretrained`` of a safetensors file in its stored dtype leaves each weight a view
of the memory-mapped file: those bytes are not resident until read, the kernel can drop them
again, and freeing the tensor gives no resident memory back. ``mapped_bytes`` answers, for a set
of storages (address, size), how many of their bytes lie in file-backed mappings, from
``/proc/self/maps`` (Linux; elsewhere None); ``file_pages`` adds how many distinct file bytes those
views cover (two loads of one file count it once) and how much of that is in memory now
(``mincore``), and ``process_file_resident`` this process's resident file pages (``RssFile``).
It reads files of this process and asks the kernel about pages: no torch, no tensor kept, no page read.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

__all__ = ["FileMappings", "MappedViews", "file_mappings", "file_pages", "file_pages_of", "mapped_bytes",
           "process_file_resident"]

_MAPS = "/proc/self/maps"
_STATUS = "/proc/self/status"
_PAGE = mmap.PAGESIZE
# Pages asked of mincore per call: its answer vector is one byte a page (256 KiB here, for 1 GiB of 4 KiB pages).
_MINCORE_PAGES = 1 << 18
# Pages looked up at most (~0.3 µs each: 128 MiB of 4 KiB pages in ~10 ms); beyond it the kernel is
# not asked (a 14 GiB file took 0.7 s) and this process's resident file pages bound the figure instead.
EXACT_PAGES = 1 << 15


@dataclass(frozen=True)
class FileMappings:
    """This process's file-backed mappings at one moment: sorted (start, end, path) address ranges,
    each with where it starts in its file and which file it is (device and inode, or the path)."""

    starts: tuple[int, ...]
    ranges: tuple[tuple[int, int, str], ...]
    file_offsets: tuple[int, ...] = ()
    file_keys: tuple[Hashable, ...] = ()

    def overlap(self, address: int, size: int) -> int:
        """Bytes of [address, address + size) that lie in a file-backed mapping."""
        return sum(stop - start for _, start, stop in self.pieces(address, size))

    def pieces(self, address: int, size: int) -> Iterable[tuple[int, int, int]]:
        """(mapping index, start, stop) addresses of the parts of [address, address + size) in a mapping."""
        if size <= 0 or not self.ranges:
            return
        end = address + size
        i = max(bisect.bisect_right(self.starts, address) - 1, 0)
        while i < len(self.ranges) and self.ranges[i][0] < end:
            start, stop = max(self.ranges[i][0], address), min(self.ranges[i][1], end)
            if stop > start:
                yield i, start, stop
            i += 1


@dataclass(frozen=True)
class MappedViews:
    """What a set of storages holds of memory-mapped files (int bytes; ``resident`` None where unknown)."""

    mapped: tuple[int, ...]   # per storage, in the order given: its bytes that are views of a file
    file_bytes: int           # distinct file bytes those views cover, page-rounded (one file loaded twice: once)
    resident: int | None      # of file_bytes, the pages in memory now (mincore); None past EXACT_PAGES or off Linux
    files: int                # how many distinct files


def file_mappings(maps_text: str | None = None) -> FileMappings | None:
    """Read the file-backed mappings (``/proc/self/maps`` lines whose path is a file); None off Linux."""
    if maps_text is None:
        try:
            with open(_MAPS, encoding="utf-8", errors="replace") as f:
                maps_text = f.read()
        except OSError:
            return None
    found: list[tuple[int, int, str, int, Hashable]] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue  # anonymous: no path
        path = parts[5].strip()
        if not path.startswith("/") or path.startswith(("/dev/shm/", "/memfd:")):
            continue  # [heap], [stack], [anon:...], shared memory (tmpfs: resident): not a file's pages
        start_text, _, end_text = parts[0].partition("-")
        try:
            start, end, offset = int(start_text, 16), int(end_text, 16), int(parts[2], 16)
        except ValueError:
            continue
        key: Hashable = (parts[3], parts[4]) if parts[4] != "0" else path
        found.append((start, end, path, offset, key))
    found.sort(key=lambda r: r[0])
    return FileMappings(tuple(r[0] for r in found), tuple(r[:3] for r in found),
                        tuple(r[3] for r in found), tuple(r[4] for r in found))


def mapped_bytes(storages: Iterable[tuple[int, int]], mappings: FileMappings | None = None) -> int | None:
    """Bytes of the (address, nbytes) storages that are mapped from a file; None where unknown (not Linux)."""
    mappings = mappings if mappings is not None else file_mappings()
    if mappings is None:
        return None
    return sum(mappings.overlap(address, size) for address, size in storages)


def _near_a_mapping(mappings: FileMappings, addresses: list[int], sizes: list[int]) -> list[bool]:
    """For each storage (address, size), whether a file mapping may overlap it: the one starting last
    at or before it reaches past its address, or the next starts before its end. In C-level passes:
    most storages of a scan are anonymous memory, and no mapping is looked at for them."""
    starts, ranges = mappings.starts, mappings.ranges
    if not starts:
        return [False] * len(addresses)
    after = list(map(bisect.bisect_right, repeat(starts), addresses))  # mappings starting at or before each
    ends = [r[1] for r in ranges] + [0]  # ends[-1]: no mapping starts before the first
    following = list(starts) + [1 << 64]
    reaches_past = map(operator.gt, map(ends.__getitem__, map(operator.sub, after, repeat(1))), addresses)
    starts_before = map(operator.lt, map(following.__getitem__, after), map(operator.add, addresses, sizes))
    return list(map(operator.or_, reaches_past, starts_before))


def file_pages(storages: Iterable[tuple[int, int]], mappings: FileMappings | None = None) -> MappedViews | None:
    """Which bytes of the (address, nbytes) storages are views of files, how many distinct file bytes
    they cover and how much of those is in memory now; None where unknown (not Linux)."""
    storages = list(storages)
    return file_pages_of([a for a, _ in storages], [n for _, n in storages], mappings)


def file_pages_of(addresses: list[int], sizes: list[int], mappings: FileMappings | None = None) -> MappedViews | None:
    """``file_pages`` for storages given as two lists (a scan's 100,000 records: no tuple each)."""
    mappings = mappings if mappings is not None else file_mappings()
    if mappings is None:
        return None
    mapped: list[int] = []
    # (file, first page, end page, address of the first page): where each view lies in its file.
    spans: list[tuple[Hashable, int, int, int]] = []
    near = _near_a_mapping(mappings, addresses, sizes)
    if not any(near):
        addresses, sizes, mapped = [], [], [0] * len(near)
    for address, size, maybe in zip(addresses, sizes, near):
        if not maybe:
            mapped.append(0)
            continue
        total = 0
        for i, start, stop in mappings.pieces(address, size):
            total += stop - start
            base, offset = mappings.ranges[i][0], mappings.file_offsets[i] if mappings.file_offsets else 0
            key = mappings.file_keys[i] if mappings.file_keys else mappings.ranges[i][2]
            first, end = (start - base + offset) // _PAGE, -(-(stop - base + offset) // _PAGE)
            spans.append((key, first, end, base + first * _PAGE - offset))
        mapped.append(total)
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    files: set[Hashable] = set()
    covered: dict[Hashable, int] = {}
    distinct: list[tuple[int, int]] = []  # (address, pages) of file pages no other view counted yet
    for key, first, end, address in spans:
        files.add(key)
        begin = max(first, covered.get(key, first))
        if end <= begin:
            continue
        covered[key] = end
        distinct.append((address + (begin - first) * _PAGE, end - begin))
    total = sum(pages for _, pages in distinct)
    resident: int | None = None
    if total <= EXACT_PAGES:
        resident = 0
        for address, pages in distinct:
            here = _resident_pages(address, pages)
            if here is None:
                resident = None
                break
            resident += here
    return MappedViews(tuple(mapped), total * _PAGE, None if resident is None else resident * _PAGE, len(files))


def process_file_resident() -> int | None:
    """This process's resident pages that are file pages (``RssFile``): the kernel counts them as available."""
    try:
        with open(_STATUS, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_libc: Any = None


def _resident_pages(address: int, pages: int) -> int | None:
    """Pages of [address, address + pages) in memory now (mincore reads no page); None if it cannot say."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return None
    resident = 0
    while pages > 0:
        step = min(pages, _MINCORE_PAGES)
        answer = ctypes.create_string_buffer(step)
        if _libc.mincore(address, step * _PAGE, answer) != 0:
            return None  # unmapped since the scan, or not a mapping mincore knows
        raw = answer.raw
        resident += step - raw.count(0)
        address += step * _PAGE
        pages -= step
    return resident
