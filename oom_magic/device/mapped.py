"""Say which bytes of this process's memory are mapped from a file (not anonymous, resident memory).

On the cpu, ``from_pretrained`` of a safetensors file in its stored dtype leaves each weight a view
of the memory-mapped file: those bytes are not resident until read, the kernel can drop them
again, and freeing the tensor gives no resident memory back. ``mapped_bytes`` answers, for a set
of storages (address, size), how many of their bytes lie in file-backed mappings, from
``/proc/self/maps`` (Linux; elsewhere None). It reads a file of this process only: no torch, no tensor kept.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from collections.abc import Iterable

__all__ = ["FileMappings", "file_mappings", "mapped_bytes"]

_MAPS = "/proc/self/maps"


@dataclass(frozen=True)
class FileMappings:
    """This process's file-backed mappings at one moment: sorted (start, end, path) address ranges."""

    starts: tuple[int, ...]
    ranges: tuple[tuple[int, int, str], ...]

    def overlap(self, address: int, size: int) -> int:
        """Bytes of [address, address + size) that lie in a file-backed mapping."""
        if size <= 0 or not self.ranges:
            return 0
        end = address + size
        total = 0
        i = max(bisect.bisect_right(self.starts, address) - 1, 0)
        while i < len(self.ranges) and self.ranges[i][0] < end:
            start, stop, _ = self.ranges[i]
            total += max(0, min(stop, end) - max(start, address))
            i += 1
        return total


def file_mappings(maps_text: str | None = None) -> FileMappings | None:
    """Read the file-backed mappings (``/proc/self/maps`` lines whose path is a file); None off Linux."""
    if maps_text is None:
        try:
            with open(_MAPS, encoding="utf-8", errors="replace") as f:
                maps_text = f.read()
        except OSError:
            return None
    found: list[tuple[int, int, str]] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue  # anonymous: no path
        path = parts[5].strip()
        if not path.startswith("/") or path.startswith(("/dev/shm/", "/memfd:")):
            continue  # [heap], [stack], [anon:...], shared memory (tmpfs: resident): not a file's pages
        start_text, _, end_text = parts[0].partition("-")
        try:
            found.append((int(start_text, 16), int(end_text, 16), path))
        except ValueError:
            continue
    found.sort()
    return FileMappings(tuple(r[0] for r in found), tuple(found))


def mapped_bytes(storages: Iterable[tuple[int, int]], mappings: FileMappings | None = None) -> int | None:
    """Bytes of the (address, nbytes) storages that are mapped from a file; None where unknown (not Linux)."""
    mappings = mappings if mappings is not None else file_mappings()
    if mappings is None:
        return None
    return sum(mappings.overlap(address, size) for address, size in storages)
