"""Read a GGUF file's header (llama.cpp's format): its metadata and each tensor's name, shape and ggml
type, with the bytes each takes summed by that type's block size; never the weights.

A bounded parser of our own, so the same code reads a local file and a remote one by growing range
reads: it parses from the start of what it has and, when that ends too soon, asks for four times as
much (64 KiB first, up to 64 MiB, tokenizer vocabularies included), so what it reads past the header
is less than three quarters of the last read, never the rest of the weights. Counts, strings and arrays are bounded; a type
the ``gguf`` package does not know is a one-line error. Block sizes come from ``gguf.constants``
(``GGML_QUANT_SIZES``), the ``gguf`` package being what writes and reads these files in llama.cpp.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import OomMagicError

__all__ = ["GgufHeader", "GgufTensor", "ggml_sizes", "parse_gguf_header", "read_gguf_growing", "read_gguf_header"]

_MAGIC = b"GGUF"
_MAX_HEADER_BYTES = 64 * 1024 * 1024  # a 256k-token vocabulary takes a few MiB
_MAX_TENSORS = 100_000
_MAX_KV = 100_000
_MAX_STRING = 16 * 1024 * 1024
_MAX_ARRAY = 16 * 1024 * 1024
_MAX_DIMS = 8
_FIRST_READ = 64 * 1024  # a header without a vocabulary fits; one with 150k tokens takes 4 reads
# GGUF value types (gguf.constants.GGUFValueType): fixed widths and struct codes of the scalars.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its ggml type and the bytes it takes by that type's block size."""

    name: str
    shape: tuple[int, ...]  # as GGUF stores it: the fastest-varying dimension first
    ggml_type: str  # 'Q4_K', 'Q6_K', 'F32', ...
    elements: int
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata (scalars and strings; arrays as their lengths) and its tensors."""

    version: int
    metadata: dict[str, object]
    tensors: tuple[GgufTensor, ...]
    header_bytes: int  # bytes parsed: the metadata and tensor infos, before the data


class _Short(Exception):
    """The bytes at hand end before the header does."""


class _Cursor:
    def __init__(self, data: bytes, label: str) -> None:
        self.data, self.at, self.label = data, 0, label

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise _Short()
        part = self.data[self.at:self.at + n]
        self.at += n
        return part

    def scalar(self, code: str) -> int | float | bool:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        length = int(self.scalar("Q"))
        if length > _MAX_STRING:
            raise OomMagicError(f"{self.label}: a string of {length} bytes in the header; not a GGUF file oom-magic "
                                "will parse")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> object:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            inner, count = int(self.scalar("I")), int(self.scalar("Q"))
            if count > _MAX_ARRAY:
                raise OomMagicError(f"{self.label}: an array of {count} values in the header, over {_MAX_ARRAY}")
            if inner in _SCALARS:  # skipped, not kept: a vocabulary's scores are not needed for sizing
                self.take(count * struct.calcsize(_SCALARS[inner]))
            else:
                for _ in range(count):
                    self.value(inner, depth + 1)
            return ("array", count)
        raise OomMagicError(f"{self.label}: metadata value type {kind} is not a GGUF type; the file is damaged")


def ggml_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type code -> (name, block elements, block bytes), from the gguf package."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise OomMagicError("sizing a GGUF file needs the gguf package (pip install gguf)") from None
    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


def parse_gguf_header(data: bytes, label: str) -> GgufHeader:
    """Parse a GGUF header from its first bytes; raises _Short when `data` ends before the header does."""
    cursor = _Cursor(data, label)
    if cursor.take(4) != _MAGIC:
        raise OomMagicError(f"{label}: not a GGUF file (it does not start with 'GGUF')")
    version = int(cursor.scalar("I"))
    if version not in (2, 3):
        raise OomMagicError(f"{label}: GGUF version {version}; oom-magic reads versions 2 and 3")
    n_tensors, n_kv = int(cursor.scalar("Q")), int(cursor.scalar("Q"))
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise OomMagicError(f"{label}: the header claims {n_tensors} tensors and {n_kv} metadata entries, over "
                            f"the {_MAX_TENSORS} oom-magic reads; the file is damaged")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(int(cursor.scalar("I")))
    table = ggml_sizes()
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = int(cursor.scalar("I"))
        if n_dims > _MAX_DIMS:
            raise OomMagicError(f"{label}: tensor {name[:80]!r} has {n_dims} dimensions; the file is damaged")
        shape = tuple(int(cursor.scalar("Q")) for _ in range(n_dims))
        code = int(cursor.scalar("I"))
        cursor.scalar("Q")  # its offset in the data region: not needed for sizes
        known = table.get(code)
        if known is None:
            raise OomMagicError(f"{label}: tensor {name[:80]!r} has ggml type {code}, which the gguf package does "
                                "not know (upgrade gguf)")
        type_name, block, block_bytes = known
        elements = math.prod(shape)
        if shape and shape[0] % block:
            raise OomMagicError(f"{label}: tensor {name[:80]!r} of type {type_name} has a first dimension "
                                f"{shape[0]} that is not a multiple of its block of {block}; the file is damaged")
        tensors.append(GgufTensor(name, shape, type_name, elements, elements // block * block_bytes))
    return GgufHeader(version, metadata, tuple(tensors), cursor.at)


def read_gguf_growing(read: Callable[[int], bytes], label: str, size: int | None = None) -> GgufHeader:
    """Parse a header from `read(n)` (the first n bytes), asking for 4x more until it is whole (bounded)."""
    want = _FIRST_READ if size is None else min(_FIRST_READ, size)
    while True:
        data = read(want)
        try:
            return parse_gguf_header(data, label)
        except _Short:
            if len(data) < want or (size is not None and want >= size):
                raise OomMagicError(f"{label}: the file ends inside its header; it is truncated") from None
            if want >= _MAX_HEADER_BYTES:
                raise OomMagicError(f"{label}: header over {_MAX_HEADER_BYTES} bytes; not a GGUF file oom-magic "
                                    "will parse") from None
            want = min(want * 4, _MAX_HEADER_BYTES if size is None else min(size, _MAX_HEADER_BYTES))


def read_gguf_header(path: Path) -> GgufHeader:
    """Read a local GGUF file's header (never its tensor data)."""
    try:
        with open(path, "rb") as handle:
            def first(n: int) -> bytes:
                handle.seek(0)
                return handle.read(n)

            return read_gguf_growing(first, path.name, path.stat().st_size)
    except OSError as exc:
        raise OomMagicError(f"{path.name}: cannot read it ({exc.strerror or exc})") from None
