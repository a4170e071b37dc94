"""Read a torch.save zip checkpoint (.pt / .pth / .bin) without loading it: its storages and keys.

The one reader of torch's zip format in the package. Member sizes come from the zip's central
directory (no tensor data is read or inflated); ``data.pkl`` is walked opcode by opcode with
``pickletools.genops``, never unpickled: a symbolic machine that tracks strings, numbers, tuples,
globals, calls and containers, and records the persistent ids torch.save writes
(``('storage', <torch.XStorage | UntypedStorage>, key, location, numel)``), the dtype argument of
``_rebuild_tensor_v3`` and the name each rebuilt tensor is stored under. Work is bounded whatever
the bytes say (the limits below); a hostile or damaged file is a one-line OomMagicError naming
the file and the fix.
"""
from __future__ import annotations

import os
import pickletools
import re
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ..common.dtypes import DTYPE_BITS, STORAGE_DTYPES
from ..common.errors import OomMagicError, one_line

__all__ = ["FIX", "MAX_PICKLE_BYTES", "MAX_PICKLE_OPS", "PickleWalk", "TensorView", "TorchZip", "ZipStorage",
           "OPTIMIZER_KEY", "check_zip_directory", "open_torch_zip", "optimizer_storage_keys", "storages",
           "top_level_keys"]

_MIB = 1024 * 1024
# data.pkl, stored or inflated, is read only up to this: a 70B Llama's is 86 KB (120 bytes a tensor),
# so 8 MiB holds ~70,000 tensors; low because a pickle string of N bytes decodes to up to 4N of str.
MAX_PICKLE_BYTES = 8 * _MIB
# Inflation reads this much at a time, so a zip bomb stops one chunk past MAX_PICKLE_BYTES.
_READ_CHUNK = _MIB
# Opcodes bound the walk's time (~1 s at ~1.5 us each): torch.save writes ~30 a tensor, so this
# walks a 20,000-tensor state dict or a 4,800-parameter AdamW training checkpoint.
MAX_PICKLE_OPS = 600_000
# The estimated bytes of what the walk builds bound its memory (a real tensor costs ~1.5 KiB).
_MAX_WALK_BYTES = 48 * _MIB
# Links followed when summing the bytes under each top-level key: shared objects make it quadratic.
_MAX_KEY_VISITS = 2_000_000
# A torch.save zip holds one member per storage plus ~6, and its directory ~100 bytes a member.
_MAX_ZIP_MEMBERS = 100_000
# A top-level key of a training checkpoint that holds optimizer, scheduler or scaler state, not the model.
OPTIMIZER_KEY = re.compile(r"optim|sched|^scaler$|^grad_scaler$|^amp$", re.IGNORECASE)
_MAX_ZIP_DIRECTORY = 16 * _MIB
_ZIP_ENCRYPTED = 0x1  # zip general-purpose flag bit 0: zipfile refuses to open the member without a password
_COMPRESSION = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}  # torch.load reads stored and deflated only
FIX = "re-save it with torch.save or pass a safetensors file"  # the fix every refusal of a torch zip names
# What the walk builds, in bytes as CPython 3.11 lays it out (64-bit, GC header included), rounded
# up: a stack slot, a tuple or an empty container, one memo entry (its share of the dict at the
# worst fill), one dict entry's (key, value) pair.
_SLOT, _OBJECT, _MEMO_ENTRY, _PAIR = 8, 64, 112, 72


class TensorView(NamedTuple):
    """One region of a storage that data.pkl rebuilds as a tensor, and the names it is stored under."""

    offset: int
    shape: tuple[int, ...]
    names: tuple[str, ...]


class ZipStorage(NamedTuple):
    """One storage of a torch.save zip: its dtype (None when data.pkl does not say), elements and bytes."""

    key: str
    dtype: str | None
    elements: int | None  # None with dtype None
    nbytes: int
    views: tuple[TensorView, ...] = ()


class _Global(NamedTuple):
    module: str
    name: str


@dataclass(frozen=True)
class _Ref:
    """A storage data.pkl names: its member key under data/ and the device it was saved from."""

    key: str
    location: str


class _Box:
    """Something the pickle builds (a dict, list, object): its dict entries and its other parts."""

    __slots__ = ("entries", "parts")

    def __init__(self, *parts: object) -> None:
        self.entries: list[tuple[object, object]] | None = None  # made when first needed: most boxes have none
        self.parts: list[object] | None = list(parts) if parts else None

    def add_entries(self, pairs: list[object]) -> None:
        if self.entries is None:
            self.entries = []
        self.entries.extend(zip(pairs[0::2], pairs[1::2]))

    def add_parts(self, items: list[object]) -> None:
        if self.parts is None:
            self.parts = []
        self.parts.extend(items)


class _Call(_Box):
    """``func(*args)`` as REDUCE / NEWOBJ build it: how tensors and parameters are rebuilt."""

    __slots__ = ("args", "func")

    def __init__(self, func: object, args: object) -> None:
        super().__init__(func, args)
        self.func, self.args = func, args


@dataclass(frozen=True)
class PickleWalk:
    """What data.pkl says, read symbolically: storages, their v3 dtypes and named views, the top object."""

    top: object
    refs: tuple[_Ref, ...]  # every storage reference, in order
    storages: dict[str, tuple[_Global, int]]  # key -> (storage class, numel), first record wins
    v3_dtypes: dict[str, str]  # untyped storage key -> the dtype _rebuild_tensor_v3 gives it
    views: dict[str, dict[tuple[int, tuple[int, ...]], list[str]]]  # key -> (offset, shape) -> names
    problem: str | None  # the first record torch.save never writes (a non-storage persistent id)


@dataclass(frozen=True)
class TorchZip:
    """A torch.save zip's storage members and its data.pkl, walked (or why it was not)."""

    label: str  # the file name, fit for a one-line message
    members: dict[str, int]  # storage key -> bytes of data/<key>
    walk: PickleWalk | None
    too_big: str | None  # with walk None: the one-line reason, naming the limit it passed


class _TooBig(Exception):
    """The opcode stream is longer, or builds more, than the walk's budget; says which."""


def _detail(exc: BaseException) -> str:
    """An exception's first line, short, for a one-line message."""
    text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
    return one_line(text, 100)


def open_torch_zip(path: str | os.PathLike[str]) -> TorchZip | None:
    """Read a torch.save zip's directory and walk its data.pkl; None when it has no top-level data.pkl.

    Raises a one-line OomMagicError for a damaged, encrypted or hostile file. A data.pkl past the
    limits (MAX_PICKLE_BYTES read or inflated, MAX_PICKLE_OPS opcodes, 48 MiB built) is not an
    error here: ``walk`` is None and ``too_big`` says which limit, so callers choose.
    """
    file = Path(path)
    label = one_line(file.name, 300)
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            check_zip_directory(handle, label)
            with zipfile.ZipFile(handle) as archive:
                infos = archive.infolist()
                pickles = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
                if len(pickles) != 1:
                    return None
                info = pickles[0]
                prefix = info.filename[: -len("data.pkl")] + "data/"
                members: dict[str, int] = {}
                for member in infos:
                    key = member.filename[len(prefix):]
                    if not member.filename.startswith(prefix) or "/" in key:
                        continue
                    if member.header_offset + member.compress_size > size:
                        raise OomMagicError(f"{label}: member {one_line(member.filename, 100)!r} runs past the end of "
                                            f"the file; it is truncated: {FIX}")
                    members[key] = member.file_size
                raw, too_big = _read_pickle(archive, info, label)
    except OSError as exc:
        raise OomMagicError(f"{label}: cannot read it ({one_line(exc.strerror or exc, 100)})") from None
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, OverflowError, zlib.error,
            struct.error, IndexError, KeyError, RuntimeError) as exc:  # zipfile: unsupported or damaged members
        if isinstance(exc, OomMagicError):
            raise
        raise OomMagicError(f"{label}: damaged zip archive ({_detail(exc)}); {FIX}") from None
    if raw is None:
        return TorchZip(label, members, None, too_big)
    try:
        walk = _walk_pickle(raw)
    except _TooBig as exc:
        return TorchZip(label, members, None, f"{label}: data.pkl {exc}, past what oom-magic walks")
    except Exception as exc:  # noqa: BLE001 - genops on untrusted bytes: anything it trips on means damage
        raise OomMagicError(f"{label}: data.pkl is not a valid pickle ({_detail(exc)}); {FIX}") from None
    return TorchZip(label, members, walk, None)


def check_zip_directory(handle: BinaryIO, label: str, fix: str = FIX) -> None:
    """Refuse zips whose central directory is too big to parse, before zipfile parses it."""
    size = os.fstat(handle.fileno()).st_size
    tail_len = min(size, 22 + 0xFFFF)
    handle.seek(size - tail_len)
    tail = handle.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise OomMagicError(f"{label}: no zip end-of-directory record; the file is truncated ({fix})")
    entries = int.from_bytes(tail[at + 10:at + 12], "little")
    directory = int.from_bytes(tail[at + 12:at + 16], "little")
    locator = at - 20
    if (entries == 0xFFFF or directory == 0xFFFFFFFF) and locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        offset = int.from_bytes(tail[locator + 8:locator + 16], "little")
        if offset + 56 <= size:
            handle.seek(offset)
            record = handle.read(56)
            if record[:4] == b"PK\x06\x06":
                entries = int.from_bytes(record[32:40], "little")
                directory = int.from_bytes(record[40:48], "little")
    if entries > _MAX_ZIP_MEMBERS or directory > _MAX_ZIP_DIRECTORY:
        raise OomMagicError(f"{label}: a zip directory of {entries} members / {directory} bytes is not a torch "
                            f"checkpoint's; {fix}")
    handle.seek(0)


def _read_pickle(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> tuple[bytes | None, str | None]:
    """data.pkl's bytes, read (and inflated) a chunk at a time, never past MAX_PICKLE_BYTES.

    (None, why) when it is bigger: a deflated one that inflates past the limit is a zip bomb, or
    no torch checkpoint (torch.save stores data.pkl uncompressed, and far smaller).
    """
    cap = MAX_PICKLE_BYTES // _MIB
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        method = _COMPRESSION.get(info.compress_type, f"method {info.compress_type}")
        raise OomMagicError(f"{label}: data.pkl is compressed with {method}, which torch.load cannot read; {FIX}")
    if info.flag_bits & _ZIP_ENCRYPTED:
        raise OomMagicError(f"{label}: data.pkl is marked encrypted, which torch.load cannot read; {FIX}")
    if info.compress_type == zipfile.ZIP_DEFLATED:
        too_big = (f"{label}: data.pkl is compressed past {cap} MiB (torch.save stores it uncompressed, and "
                   "far smaller): a zip bomb or no torch checkpoint")
    else:
        too_big = f"{label}: data.pkl is over {cap} MiB, past what oom-magic reads"
    if info.file_size > MAX_PICKLE_BYTES:
        return None, too_big
    chunks: list[bytes] = []
    read = 0
    with archive.open(info) as member:
        while read <= MAX_PICKLE_BYTES:
            chunk = member.read(_READ_CHUNK)
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            read += len(chunk)
    return None, too_big


_PUSH = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                   "SHORT_BINSTRING", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4",
                   "BINFLOAT", "FLOAT", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_REBUILD_TENSOR = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"})
_REBUILD_PARAMETER = frozenset({"_rebuild_parameter", "_rebuild_parameter_with_state"})


class _Walker:
    """The symbolic pickle machine's state: stack, marks, memo, and what torch.save's records say."""

    def __init__(self) -> None:
        self.stack: list[object] = []
        self.marks: list[int] = []
        self.memo: dict[object, object] = {}
        self.refs: list[_Ref] = []
        self.storages: dict[str, tuple[_Global, int]] = {}
        self.v3_dtypes: dict[str, str] = {}
        self.views: dict[str, dict[tuple[int, tuple[int, ...]], list[str]]] = {}
        self.problem: str | None = None
        self.spent = 0

    def pop_mark(self) -> list[object]:
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def persistent(self, pid: object) -> object:
        """A persistent id: torch.save's storage record becomes a reference; anything else a placeholder."""
        self.spent += 2 * _OBJECT
        if not (isinstance(pid, tuple) and len(pid) >= 4 and pid[0] == "storage" and isinstance(pid[2], str)):
            self.problem = self.problem or "a persistent id that is not a storage"
            return _Box()
        ref = _Ref(pid[2], pid[3] if isinstance(pid[3], str) else "unknown")
        self.refs.append(ref)
        kind, numel = pid[1], pid[-1]
        if len(pid) == 5 and isinstance(kind, _Global) and type(numel) is int and numel >= 0:
            if ref.key not in self.storages:
                self.storages[ref.key] = (kind, numel)
                self.spent += _PAIR
        else:
            self.problem = self.problem or f"a storage record {one_line(repr(pid), 80)}"
        return ref

    def call(self, func: object, args: object) -> _Call:
        """func(*args); _rebuild_tensor_v3(storage, offset, size, stride, grad, hooks, dtype) names a dtype."""
        call = _Call(func, args)
        if (isinstance(func, _Global) and func.name == "_rebuild_tensor_v3" and isinstance(args, tuple)
                and len(args) >= 7 and isinstance(args[0], _Ref) and isinstance(args[6], _Global)
                and args[6].module == "torch"):
            self.v3_dtypes.setdefault(args[0].key, args[6].name)
        self.spent += 2 * _OBJECT
        return call

    def set_items(self, pairs: list[object]) -> None:
        """Dict entries: added to the dict, and each rebuilt tensor's name noted beside its storage."""
        for key, value in zip(pairs[0::2], pairs[1::2]):
            view = _tensor_view(value)
            if isinstance(key, str) and view is not None:
                ref, offset, shape = view
                self.views.setdefault(ref, {}).setdefault((offset, shape), []).append(key)
                self.spent += _PAIR + _OBJECT
        if isinstance(self.stack[-1], _Box):
            self.stack[-1].add_entries(pairs)
            self.spent += _PAIR * (len(pairs) // 2) + _OBJECT


def _walk_pickle(raw: bytes) -> PickleWalk:
    """Walk data.pkl's opcodes symbolically; nothing is executed or imported.

    What it builds is costed as it goes (the _SLOT.._PAIR estimates, and sys.getsizeof of each
    argument genops decodes); past _MAX_WALK_BYTES of that, or MAX_PICKLE_OPS opcodes, it raises
    _TooBig, so memory and time stay bounded whatever the bytes say.
    """
    w = _Walker()
    stack, memo = w.stack, w.memo
    sizeof = sys.getsizeof
    for ops, (opcode, arg, _) in enumerate(pickletools.genops(raw)):
        if ops >= MAX_PICKLE_OPS:
            raise _TooBig(f"holds over {MAX_PICKLE_OPS:,} pickle opcodes")
        if w.spent > _MAX_WALK_BYTES:
            raise _TooBig(f"builds over {_MAX_WALK_BYTES // _MIB} MiB of objects")
        name = opcode.name  # branches in the order torch.save's opcodes are most frequent
        if name in _PUT:
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            w.spent += _MEMO_ENTRY
        elif name in _GET:
            stack.append(memo[arg])
            w.spent += _SLOT
        elif name in _PUSH:
            stack.append(arg)
            w.spent += _SLOT + sizeof(arg)
        elif name == "MARK":
            w.marks.append(len(stack))
            w.spent += _SLOT + _OBJECT
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            stack.append(w.call(func, args))
        elif name == "TUPLE":
            items = w.pop_mark()
            stack.append(tuple(items))
            w.spent += _OBJECT + _SLOT * len(items)
        elif name == "EMPTY_TUPLE":
            stack.append(())
            w.spent += _SLOT
        elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append(None if name == "NONE" else name == "NEWTRUE")
            w.spent += _SLOT
        elif name in ("BINPERSID", "PERSID"):
            stack.append(w.persistent(stack.pop() if name == "BINPERSID" else arg))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise IndexError("stack underflow")
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
            w.spent += _OBJECT + _SLOT * n
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET"):
            stack.append(_Box())
            w.spent += _SLOT + _OBJECT
        elif name == "SETITEMS":
            w.set_items(w.pop_mark())
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            w.set_items([key, value])
        elif name in ("APPEND", "APPENDS", "ADDITEMS"):
            items = [stack.pop()] if name == "APPEND" else w.pop_mark()
            if isinstance(stack[-1], _Box):
                stack[-1].add_parts(items)
                w.spent += _SLOT * len(items) + _OBJECT
        elif name in ("DICT", "LIST", "FROZENSET"):
            items = w.pop_mark()
            box = _Box()
            if name == "DICT":
                box.add_entries(items)
            else:
                box.add_parts(items)
            stack.append(box)
            w.spent += 2 * _OBJECT + _PAIR * len(items)
        elif name == "GLOBAL":
            module, _, qual = str(arg).partition(" ")
            stack.append(_Global(module, qual))
            w.spent += 2 * _OBJECT + 2 * sizeof(arg)
        elif name == "STACK_GLOBAL":
            top, below = stack.pop(), stack.pop()
            # never joined: two memoized long strings would be copied per opcode
            stack.append(_Global(below, top) if isinstance(below, str) and isinstance(top, str) else _Box(below, top))
            w.spent += 2 * _OBJECT
        elif name == "NEWOBJ_EX":
            kwargs, args, cls = stack.pop(), stack.pop(), stack.pop()
            stack.append(_Box(cls, args, kwargs))
            w.spent += 2 * _OBJECT
        elif name == "BUILD":
            state = stack.pop()
            if isinstance(stack[-1], _Box):
                stack[-1].add_parts([state])
                w.spent += _OBJECT
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            w.pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
            w.spent += _SLOT
        elif name in ("PROTO", "FRAME"):
            continue
        elif name == "STOP":
            break
        else:  # OBJ, INST, EXT*, BYTEARRAY8, NEXT_BUFFER...: keep the stack shape
            if pickletools.markobject in opcode.stack_before:
                w.pop_mark()
                for _ in range(opcode.stack_before.index(pickletools.markobject)):
                    stack.pop()
            else:
                for _ in opcode.stack_before:
                    stack.pop()
            stack.extend(_Box() for _ in opcode.stack_after)
            w.spent += (_SLOT + _OBJECT) * len(opcode.stack_after) + (sizeof(arg) if arg is not None else 0)
    return PickleWalk(stack[-1] if stack else None, tuple(w.refs), w.storages, w.v3_dtypes, w.views, w.problem)


def _tensor_view(value: object, depth: int = 0) -> tuple[str, int, tuple[int, ...]] | None:
    """The (storage key, offset, shape) a rebuilt tensor or parameter views, else None."""
    if not isinstance(value, _Call) or not isinstance(value.func, _Global) or depth > 3:
        return None
    func, args = value.func, value.args
    if not isinstance(args, tuple) or not args or func.module != "torch._utils":
        return None
    if func.name in _REBUILD_PARAMETER:
        return _tensor_view(args[0], depth + 1)
    if func.name in _REBUILD_TENSOR and len(args) >= 3:
        ref, offset, shape = args[0], args[1], args[2]
        if (isinstance(ref, _Ref) and type(offset) is int and isinstance(shape, tuple)
                and all(type(d) is int and d >= 0 for d in shape)):
            return ref.key, offset, shape
    return None


def storages(found: TorchZip) -> list[ZipStorage]:
    """Each storage data.pkl names, checked against its zip member; every member when data.pkl was too big.

    The dtype is the typed storage's (``FloatStorage``...), or for an ``UntypedStorage`` the dtype
    ``_rebuild_tensor_v3`` gives it (bytes when none does); None when neither is a known dtype.
    """
    label, walk = found.label, found.walk
    if walk is None:
        return [ZipStorage(key, None, None, nbytes) for key, nbytes in found.members.items()]
    if walk.problem is not None:
        raise OomMagicError(f"{label}: data.pkl is not what torch.save writes ({walk.problem}); {FIX}")
    out: list[ZipStorage] = []
    for key, (kind, numel) in walk.storages.items():
        nbytes = found.members.get(key)
        if nbytes is None:
            raise OomMagicError(f"{label}: data.pkl names storage {one_line(key, 80)!r} but the zip has no "
                                f"data/{one_line(key, 80)}; the file is incomplete: {FIX}")
        untyped = kind.name == "UntypedStorage"
        dtype: str | None = walk.v3_dtypes.get(key, "uint8") if untyped else STORAGE_DTYPES.get(kind.name)
        bits = DTYPE_BITS.get(dtype) if dtype is not None else None
        expected = numel if untyped else (None if bits is None else numel * bits // 8)
        if expected is not None and expected != nbytes:
            raise OomMagicError(f"{label}: data.pkl says storage {one_line(key, 80)!r} is {expected} bytes but "
                                f"data/{one_line(key, 80)} holds {nbytes}; the file is damaged: {FIX}")
        if bits is None:
            out.append(ZipStorage(key, None, None, nbytes))
            continue
        elements = numel * 8 // bits if untyped else numel
        views = tuple(TensorView(offset, shape, tuple(names))
                      for (offset, shape), names in walk.views.get(key, {}).items())
        out.append(ZipStorage(key, dtype, elements, nbytes, views))
    return out


def top_level_keys(found: TorchZip) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], int]:
    """(each top-level string key with the storage bytes reachable under it, saved devices, total bytes).

    Keys are () when data.pkl's object is not a dict. Raises a one-line OomMagicError when data.pkl
    was past the walk's limits, or its keys link more objects than _MAX_KEY_VISITS.
    """
    walk = found.walk
    if walk is None:
        raise OomMagicError(f"{found.too_big}; keys not read: {FIX}")
    sizes = found.members
    keys: list[tuple[str, int]] = []
    if isinstance(walk.top, _Box) and walk.top.entries:
        budget = [_MAX_KEY_VISITS]
        for key, value in walk.top.entries:
            if isinstance(key, str):
                try:
                    under = _refs_under(value, budget)
                except _TooBig as exc:
                    raise OomMagicError(f"{found.label}: data.pkl {exc}, past what oom-magic walks; keys not "
                                        "read: pass a safetensors file to have them checked") from None
                keys.append((key, sum(sizes.get(k, 0) for k in under)))
    locations = tuple(sorted({r.location for r in walk.refs}))
    total = sum(sizes.get(k, 0) for k in {r.key for r in walk.refs})
    return tuple(keys), locations, total


def optimizer_storage_keys(found: TorchZip) -> frozenset[str]:
    """The storages only the optimizer, scheduler or scaler keys of a training checkpoint reach (empty otherwise).

    A storage the model's keys reach too is the model's. Empty when data.pkl was past the walk's
    limits or its object is not a dict: then every storage is counted as the model's.
    """
    walk = found.walk
    if walk is None or not isinstance(walk.top, _Box) or not walk.top.entries:
        return frozenset()
    budget = [_MAX_KEY_VISITS]
    optimizer: set[str] = set()
    model: set[str] = set()
    try:
        for key, value in walk.top.entries:
            if isinstance(key, str):
                (optimizer if OPTIMIZER_KEY.search(key) else model).update(_refs_under(value, budget))
    except _TooBig:
        return frozenset()
    return frozenset(optimizer - model)


def _refs_under(value: object, budget: list[int]) -> set[str]:
    """The storage keys reachable from ``value``, spending one of ``budget`` per link followed."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        budget[0] -= 1  # spent on every link, seen or not: one shared list under every key is quadratic
        if budget[0] < 0:
            raise _TooBig(f"links over {_MAX_KEY_VISITS:,} objects under its keys")
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, _Ref):
            found.add(item.key)
        elif isinstance(item, _Box):
            if item.parts:
                stack.extend(item.parts)
            if item.entries:
                for k, v in item.entries:
                    stack.extend((k, v))
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return found
