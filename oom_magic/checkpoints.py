"""Find the files of a checkpoint the user named (a local path, or a hub id in the local HF cache)
and read their structure (shard indexes, configs, a torch.save zip's top-level keys) without loading
a tensor.

Nothing here goes online or imports huggingface_hub: a hub id is looked up in the cache layout
huggingface_hub writes (``<cache>/models--org--name/refs/main`` -> ``snapshots/<rev>/``), so an
id that was never downloaded is an error, not a download. A torch.save zip's ``data.pkl`` is
walked opcode by opcode with ``pickletools``, never unpickled, within fixed bounds.
"""
from __future__ import annotations

import json
import os
import pickletools
import re
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from .errors import OomMagicError

__all__ = ["CheckpointFiles", "CheckpointKeys", "check_zip_directory", "find_checkpoint_files", "hub_cache_dir", "one_line",
           "read_checkpoint_keys", "resolve_checkpoint"]

# A hub id: "name" or "org/name" (letters, digits, '-', '_', '.'), as the hub allows.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
# An index names hundreds of shards at most; anything this big is not an index.
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_MAX_CONFIG_BYTES = 16 * 1024 * 1024
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Files a Trainer writes beside the weights; they are not the model.
_NOT_WEIGHTS = re.compile(
    r"^(training_args\.bin|optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state.*\.pth)$"
)


@dataclass(frozen=True)
class CheckpointFiles:
    """The files that hold one checkpoint and how they are stored, found without reading tensors."""

    path: Path
    format: str  # 'safetensors' | 'safetensors-sharded' | 'torch-zip' | 'torch-zip-sharded' | 'config-only'
    files: tuple[Path, ...]  # weight files (config.json for 'config-only'), in index order
    config: Path | None  # the config.json beside the weights, when there is one
    index: Path | None = None
    # tensor name -> shard file name, from the index; None when not sharded
    weight_map: dict[str, str] | None = field(default=None, hash=False, compare=False, repr=False)


def hub_cache_dir() -> Path:
    """Return the hub cache folder huggingface_hub would use (HF_HUB_CACHE, HF_HOME, XDG, ~)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_checkpoint(path_or_id: str | os.PathLike[str]) -> Path:
    """Turn a local file/folder or a cached hub id ("org/name") into a local path; never downloads.

    A local path wins over a hub id of the same spelling, as in transformers. A hub id resolves
    to the snapshot ``refs/main`` names, or to the only snapshot when ``refs/main`` is missing.
    """
    if not isinstance(path_or_id, (str, bytes, os.PathLike)):
        raise OomMagicError(f"a checkpoint is a path (str or pathlib.Path) or a hub id such as 'org/name', "
                            f"not a {type(path_or_id).__name__}")
    try:
        text = os.fsdecode(path_or_id)
    except Exception as exc:  # a PathLike whose __fspath__ fails or returns a non-path
        raise OomMagicError(f"cannot read the checkpoint path ({type(exc).__name__}: {one_line(str(exc))}): "
                            "pass a str or a pathlib.Path") from None
    if not text.strip():
        raise OomMagicError("empty checkpoint path: pass a file, a folder or a hub id such as 'org/name'")
    try:
        local = Path(text).expanduser()
        exists = local.exists()
    except (OSError, ValueError, RuntimeError) as exc:  # too long, an embedded NUL, "~nosuchuser"
        detail = getattr(exc, "strerror", None) or str(exc)
        raise OomMagicError(f"cannot use {one_line(text)} as a path ({one_line(detail)})") from None
    if exists:
        return local.absolute()
    broken = _broken_link(local)
    if broken is not None:
        raise OomMagicError(f"{one_line(text)} is a symbolic link {broken}: point it at the checkpoint")
    if not _HUB_ID.match(text):
        raise OomMagicError(f"no such file or folder: {one_line(text)}")
    cache = hub_cache_dir()
    repo_dir = cache / ("models--" + text.replace("/", "--"))
    snapshot = _cached_snapshot(repo_dir)
    if snapshot is None:
        raise OomMagicError(
            f"cannot find checkpoint {text!r}: it is not a local path and the hub cache has no "
            f"snapshot of it at {repo_dir} (set HF_HUB_CACHE or HF_HOME, or pass a local folder)"
        )
    return snapshot


def _broken_link(path: Path) -> str | None:
    """How a symlink that does not lead to a file fails ("that loops back on itself", "to X, which
    does not exist"), or None when the path is no symlink."""
    import errno

    try:
        if not path.is_symlink():
            return None
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "that loops back on itself"
        try:
            return f"to {one_line(os.readlink(path))}, which does not exist"
        except OSError:
            return "that leads nowhere"
    return None


def one_line(text: object, limit: int = 300) -> str:
    """An outside string (a file name, a path) fit for a one-line message: control characters
    and lone surrogates escaped, cut to ``limit`` characters."""
    text = str(text)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _cached_snapshot(repo_dir: Path) -> Path | None:
    """Return the snapshot folder refs/main points at (or the only one), else None."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    try:
        if ref.is_file():
            with open(ref, "rb") as handle:  # a ref is a 40-hex commit; read no more than that
                revision = handle.read(256).decode("utf-8", errors="replace").strip()
            # A ref is a commit hash; anything with a separator would escape the repo folder.
            if revision and "/" not in revision and "\\" not in revision and revision not in (".", ".."):
                candidate = snapshots / revision
                if candidate.is_dir():
                    return candidate.absolute()
        if snapshots.is_dir():
            found = [p for p in snapshots.iterdir() if p.is_dir()]
            if len(found) == 1:
                return found[0].absolute()
    except OSError:
        return None
    return None


def find_checkpoint_files(path: Path) -> CheckpointFiles:
    """Say which files hold the checkpoint at `path` and in which format, reading only indexes.

    In a folder: safetensors beat pickles (index, then ``model.safetensors``, then a sole other
    ``*.safetensors``), then torch files the same way, then a lone config.json (size from the
    architecture). A file is judged by its first bytes, not its suffix, except ``.safetensors``.
    """
    if path.is_dir():
        return _find_in_folder(path)
    if not path.is_file():
        raise OomMagicError(f"{path}: not a file or folder")
    config = _config_beside(path.parent)
    name = path.name
    if name.endswith(".index.json"):
        return _sharded(path, path.parent, config)
    if name == "config.json":
        return CheckpointFiles(path, "config-only", (path,), path)
    if name.endswith(".safetensors"):
        return CheckpointFiles(path, "safetensors", (path,), config)
    return CheckpointFiles(path, sniff_format(path), (path,), config)


def sniff_format(path: Path) -> str:
    """Tell 'torch-zip' from 'safetensors' by the first bytes; refuse legacy pickles and others."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError as exc:
        raise OomMagicError(f"{path.name}: cannot read it ({exc.strerror or exc})") from None
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        raise OomMagicError(
            f"{path.name}: legacy pickle checkpoint: re-save with torch.save (zip) or convert to safetensors"
        )
    raise OomMagicError(
        f"{path.name}: not a checkpoint oom-magic can read (neither safetensors nor a torch.save zip)"
    )


def _find_in_folder(folder: Path) -> CheckpointFiles:
    """Pick the checkpoint files in a folder: safetensors first, then torch files, then config."""
    config = _config_beside(folder)
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if _is_file(entry))
    except OSError as exc:
        raise OomMagicError(f"{folder}: cannot list it ({exc.strerror or exc})") from None
    present = set(names)
    for index_name, single_name, suffixes in (
        ("model.safetensors.index.json", "model.safetensors", (".safetensors",)),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", _TORCH_SUFFIXES),
    ):
        if index_name in present:
            return _sharded(folder / index_name, folder, config, root=folder)
        if single_name in present:
            return _single(folder, folder / single_name, config)
        indexes = [n for n in names if n.endswith(tuple(s + ".index.json" for s in suffixes))]
        if len(indexes) == 1:
            return _sharded(folder / indexes[0], folder, config, root=folder)
        weights = [n for n in names if n.endswith(suffixes) and not _NOT_WEIGHTS.match(n)]
        if len(weights) == 1:
            return _single(folder, folder / weights[0], config)
        if len(indexes) > 1 or len(weights) > 1:
            several = ", ".join((indexes or weights)[:6])
            raise OomMagicError(
                f"{folder}: holds several checkpoints ({several}); pass the file or index you mean"
            )
    if config is not None:
        return CheckpointFiles(folder, "config-only", (config,), config)
    raise OomMagicError(
        f"{folder}: no checkpoint here (no *.safetensors, *.bin/*.pt/*.pth or config.json)"
    )


def _is_file(entry: os.DirEntry[str]) -> bool:
    """Whether a folder entry is a file; a looping or broken symlink is not one (and no reason to
    refuse the whole folder)."""
    try:
        return entry.is_file()
    except OSError:
        return False


def _single(root: Path, file: Path, config: Path | None) -> CheckpointFiles:
    """Describe a folder whose weights are one file."""
    fmt = "safetensors" if file.name.endswith(".safetensors") else sniff_format(file)
    return CheckpointFiles(root, fmt, (file,), config)


def _sharded(index: Path, folder: Path, config: Path | None, root: Path | None = None) -> CheckpointFiles:
    """Read a shard index (``*.index.json``) and list its shard files in first-use order."""
    weight_map = read_index(index)
    shards: dict[str, Path] = {}
    for shard in weight_map.values():
        if shard not in shards:
            shards[shard] = _inside(folder, shard, index.name)
    if not shards:
        raise OomMagicError(f"{index.name}: the weight_map is empty; the index names no shard files")
    missing = [name for name, p in shards.items() if not p.is_file()]
    if missing:
        raise OomMagicError(
            f"{index.name}: names shard {missing[0]!r}, which is not in {folder}"
            + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
            + "; the download is incomplete"
        )
    first = next(iter(shards))
    fmt = "safetensors-sharded" if first.endswith(".safetensors") else "torch-zip-sharded"
    return CheckpointFiles(root or index, fmt, tuple(shards.values()), config, index, weight_map)


def read_index(index: Path) -> dict[str, str]:
    """Return the weight_map of a shard index, checked: tensor name -> shard file name."""
    data = _read_json(index, _MAX_INDEX_BYTES)
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise OomMagicError(f"{index.name}: not a shard index (no \"weight_map\" object)")
    weight_map = data["weight_map"]
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise OomMagicError(f"{index.name}: weight_map[{tensor!r}] is not a file name")
    return weight_map


def _inside(folder: Path, name: str, index_name: str) -> Path:
    """Join a shard name to its folder, refusing names that leave it (absolute, '..')."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise OomMagicError(f"{index_name}: shard name {name!r} points outside the checkpoint folder")
    return folder.joinpath(*parts)


def _config_beside(folder: Path) -> Path | None:
    """Return folder/config.json when it is a file."""
    config = folder / "config.json"
    return config if config.is_file() else None


def read_config(config: Path) -> dict[str, object]:
    """Read a config.json into a dict; OomMagicError when it is not a JSON object."""
    data = _read_json(config, _MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise OomMagicError(f"{config.name}: not a JSON object")
    return data


def _read_json(path: Path, limit: int) -> object:
    """Read a small JSON file, refusing files over `limit` bytes and bad UTF-8/JSON."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise OomMagicError(f"{path.name}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise OomMagicError(f"{path.name}: over {limit} bytes; not a config or index file")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise OomMagicError(f"{path.name}: not UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise OomMagicError(f"{path.name}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None


# --------------------------------------------------------------------------- torch checkpoint keys

_MIB = 1024 * 1024
# data.pkl, stored or inflated, is read whole only up to this: a 70B Llama state dict's is 86 KB
# (120 bytes a tensor), a training checkpoint's ~350 bytes a parameter, so 8 MiB holds ~70,000
# tensors. Kept this low because one pickle string of N bytes decodes to up to 4N bytes of str.
_MAX_PICKLE_BYTES = 8 * _MIB
_READ_CHUNK = _MIB
# The symbolic walk stops past these, whatever the bytes say. Opcodes bound the time (~1 s at
# ~1.5 us each): torch.save writes ~30 a tensor, ~125 a parameter with AdamW state, so 600,000
# walk a 20,000-tensor state dict or a 4,800-parameter training checkpoint (a 70B Llama's: 91,000).
# The estimated bytes of what the walk builds bound the memory (a real tensor costs ~1.5 KiB).
# Links followed bound the per-key pass, which shared objects could make quadratic.
_MAX_PICKLE_OPS = 600_000
_MAX_PICKLE_WALK_BYTES = 48 * _MIB
_MAX_KEY_VISITS = 2_000_000
# A torch.save zip holds one member per storage plus ~6; its directory ~100 bytes a member.
_MAX_ZIP_MEMBERS = 100_000
_MAX_ZIP_DIRECTORY = 16 * _MIB
_OPTIMIZER_KEY = re.compile(r"optim|sched|^scaler$|^grad_scaler$|^amp$", re.IGNORECASE)
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module", "net", "model_state", "weights", "params")
_COMPRESSION = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}
_FIX = "re-save it with torch.save or pass a safetensors file"
_ZIP_ENCRYPTED = 0x1  # zip general-purpose flag bit 0: zipfile refuses to open the member without a password


@dataclass(frozen=True)
class CheckpointKeys:
    """A torch.save checkpoint's top-level keys with the bytes under each, and where it was saved."""

    keys: tuple[tuple[str, int], ...]  # (key, storage bytes reachable from it); () if not a dict
    locations: tuple[str, ...]  # devices the storages were saved from ('cuda:0', 'cpu')
    total: int

    def optimizer_keys(self) -> tuple[tuple[str, int], ...]:
        """Keys that hold optimizer, scheduler or scaler state."""
        return tuple((k, b) for k, b in self.keys if _OPTIMIZER_KEY.search(k))

    def model_key(self) -> tuple[str, int] | None:
        """The key that holds the model's weights: a usual name, else the largest other key."""
        rest = [(k, b) for k, b in self.keys if not _OPTIMIZER_KEY.search(k) and b > 0]
        named = [(k, b) for k, b in rest if k in _MODEL_KEYS]
        pool = named or rest
        return max(pool, key=lambda kb: kb[1]) if pool else None


def read_checkpoint_keys(path: str | os.PathLike[str]) -> CheckpointKeys | None:
    """Read a torch.save zip's top-level keys, the bytes under each, and the saved devices.

    Walks data.pkl's opcodes symbolically (pickletools.genops); nothing is unpickled or
    imported. Returns None for files that are not zips or hold no data.pkl; raises a one-line
    OomMagicError for a damaged or hostile one. Work is bounded whatever the file says: data.pkl
    is read (inflated, when deflated; other compressions are refused) in chunks up to 8 MiB, and
    the walk stops past 600,000 opcodes or 48 MiB of what it builds.
    """
    file = Path(path)
    label = one_line(file.name)
    try:
        if not zipfile.is_zipfile(file):
            return None
        with open(file, "rb") as handle:
            check_zip_directory(handle, label)
            with zipfile.ZipFile(handle) as archive:
                infos = archive.infolist()
                pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
                if not pickles:
                    return None
                info = pickles[0]
                prefix = info.filename[: -len("data.pkl")]
                raw = _read_pickle(archive, info, label)
                sizes = {i.filename[len(prefix) + len("data/"):]: i.file_size for i in infos
                         if i.filename.startswith(prefix + "data/")}
    except OSError as exc:
        raise OomMagicError(f"{label}: cannot read it ({one_line(exc.strerror or exc, 100)})") from None
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, OverflowError, zlib.error,
            struct.error, IndexError, KeyError, RuntimeError) as exc:
        if isinstance(exc, OomMagicError):
            raise
        raise OomMagicError(f"{label}: damaged zip archive ({_detail(exc)}); {_FIX}") from None
    try:
        top, refs = _walk_pickle(raw)
        keys = _keys_with_bytes(top, sizes)
    except _TooBig as exc:
        raise OomMagicError(f"{label}: data.pkl {exc}, past what oom-magic walks; keys not read: "
                            "pass a safetensors file to have them checked") from None
    except Exception as exc:  # genops on untrusted bytes: anything it trips on means damage
        raise OomMagicError(f"{label}: data.pkl is not a valid pickle ({_detail(exc)}); {_FIX}") from None
    locations = tuple(sorted({r.location for r in refs}))
    total = sum(sizes.get(k, 0) for k in {r.key for r in refs})
    return CheckpointKeys(keys, locations, total)


def _detail(exc: BaseException) -> str:
    """An exception's first line, short, for a one-line message."""
    text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
    return one_line(text, 100)


def check_zip_directory(handle: BinaryIO, label: str, fix: str = _FIX) -> None:
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


def _read_pickle(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> bytes:
    """data.pkl's bytes, read (and inflated) a chunk at a time, never past _MAX_PICKLE_BYTES."""
    cap = _MAX_PICKLE_BYTES // _MIB
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        # torch.load (miniz) reads stored and deflated members only.
        method = _COMPRESSION.get(info.compress_type, f"method {info.compress_type}")
        raise OomMagicError(f"{label}: data.pkl is compressed with {method}, which torch.load cannot read; {_FIX}")
    if info.flag_bits & _ZIP_ENCRYPTED:
        raise OomMagicError(f"{label}: data.pkl is marked encrypted, which torch.load cannot read; {_FIX}")
    if info.compress_type == zipfile.ZIP_DEFLATED:
        too_big = (f"{label}: data.pkl is compressed past {cap} MiB (torch.save stores it uncompressed, and "
                   f"far smaller); keys not read: {_FIX}")
    else:
        too_big = f"{label}: data.pkl is over {cap} MiB, past what oom-magic reads; keys not read: {_FIX}"
    if info.file_size > _MAX_PICKLE_BYTES:
        raise OomMagicError(too_big)
    chunks: list[bytes] = []
    read = 0
    with archive.open(info) as member:
        while read <= _MAX_PICKLE_BYTES:
            chunk = member.read(_READ_CHUNK)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            read += len(chunk)
    raise OomMagicError(too_big)


class _TooBig(Exception):
    """The opcode stream is longer, or builds more, than the walk's budget; says which."""


class _Box:
    """Something the pickle builds (a dict, list, object): its dict entries and its other parts."""

    __slots__ = ("entries", "parts")

    def __init__(self, *parts: object) -> None:
        self.entries: list[tuple[object, object]] | None = None  # made when first needed: boxes are most objects
        self.parts: list[object] | None = list(parts) if parts else None

    def add_entries(self, pairs: list[object]) -> None:
        if self.entries is None:
            self.entries = []
        self.entries.extend(zip(pairs[0::2], pairs[1::2]))

    def add_parts(self, items: list[object]) -> None:
        if self.parts is None:
            self.parts = []
        self.parts.extend(items)


@dataclass(frozen=True, slots=True)
class _Ref:
    """A storage data.pkl names: its member key under data/ and the device it was saved from."""

    key: str
    location: str


_PUSH = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                   "SHORT_BINSTRING", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4",
                   "BINFLOAT", "FLOAT", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
# What the walk builds, in bytes as CPython 3.11 lays it out (64-bit, GC header included), rounded
# up: a stack or list slot, a tuple or an empty _Box, one memo entry (its share of the dict's
# tables at the worst fill, with an int key), one dict entry's (key, value) pair.
_SLOT, _OBJECT, _MEMO_ENTRY, _PAIR = 8, 64, 112, 72


def _walk_pickle(raw: bytes) -> tuple[object, list[_Ref]]:
    """A symbolic pickle machine: containers, strings and storage references; nothing executed.

    What it builds is costed as it goes (the _SLOT.._PAIR estimates, and sys.getsizeof of each
    argument genops decodes); past _MAX_PICKLE_WALK_BYTES of that, or _MAX_PICKLE_OPS opcodes, it
    raises _TooBig, so memory and time stay bounded whatever the bytes say.
    """
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[object, object] = {}
    refs: list[_Ref] = []
    spent = 0
    sizeof = sys.getsizeof

    def pop_mark() -> list[object]:
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    for ops, (opcode, arg, _) in enumerate(pickletools.genops(raw)):
        if ops >= _MAX_PICKLE_OPS:
            raise _TooBig(f"holds over {_MAX_PICKLE_OPS:,} pickle opcodes")
        if spent > _MAX_PICKLE_WALK_BYTES:
            raise _TooBig(f"builds over {_MAX_PICKLE_WALK_BYTES // _MIB} MiB of objects")
        name = opcode.name  # branches in the order torch.save's opcodes are most frequent
        if name in _PUT:
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            spent += _MEMO_ENTRY
        elif name in _GET:
            stack.append(memo[arg])
            spent += _SLOT
        elif name in _PUSH:
            stack.append(arg)
            spent += _SLOT + sizeof(arg)
        elif name == "MARK":
            marks.append(len(stack))
            spent += _SLOT + _OBJECT
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            stack.append(_Box(func, args))
            spent += 2 * _OBJECT
        elif name == "TUPLE":
            items = pop_mark()
            stack.append(tuple(items))
            spent += _OBJECT + _SLOT * len(items)
        elif name == "EMPTY_TUPLE":
            stack.append(())
            spent += _SLOT
        elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append(None if name == "NONE" else name == "NEWTRUE")
            spent += _SLOT
        elif name in ("BINPERSID", "PERSID"):
            pid = stack.pop() if name == "BINPERSID" else arg
            if isinstance(pid, tuple) and len(pid) >= 4 and pid[0] == "storage" and isinstance(pid[2], str):
                ref = _Ref(pid[2], pid[3] if isinstance(pid[3], str) else "unknown")
                refs.append(ref)
                stack.append(ref)
            else:
                stack.append(_Box())
            spent += 2 * _OBJECT
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise IndexError("stack underflow")
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
            spent += _OBJECT + _SLOT * n
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET"):
            stack.append(_Box())
            spent += _SLOT + _OBJECT
        elif name == "SETITEMS":
            items = pop_mark()
            if isinstance(stack[-1], _Box):
                stack[-1].add_entries(items)
                spent += _PAIR * (len(items) // 2) + _OBJECT
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            if isinstance(stack[-1], _Box):
                stack[-1].add_entries([key, value])
                spent += _PAIR + _OBJECT
        elif name in ("APPEND", "APPENDS", "ADDITEMS"):
            items = [stack.pop()] if name == "APPEND" else pop_mark()
            if isinstance(stack[-1], _Box):
                stack[-1].add_parts(items)
                spent += _SLOT * len(items) + _OBJECT
        elif name in ("DICT", "LIST", "FROZENSET"):
            items = pop_mark()
            box = _Box()
            if name == "DICT":
                box.add_entries(items)
            else:
                box.add_parts(items)
            stack.append(box)
            spent += 2 * _OBJECT + _PAIR * len(items)
        elif name == "GLOBAL":
            stack.append(_Box(arg))
            spent += 2 * _OBJECT + sizeof(arg)
        elif name == "STACK_GLOBAL":
            qual, mod = stack.pop(), stack.pop()
            stack.append(_Box(mod, qual))  # never joined: two memoized long strings would be copied per opcode
            spent += 2 * _OBJECT
        elif name == "NEWOBJ_EX":
            kwargs, args, cls = stack.pop(), stack.pop(), stack.pop()
            stack.append(_Box(cls, args, kwargs))
            spent += 2 * _OBJECT
        elif name == "BUILD":
            state = stack.pop()
            if isinstance(stack[-1], _Box):
                stack[-1].add_parts([state])
                spent += _OBJECT
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
            spent += _SLOT
        elif name in ("PROTO", "FRAME"):
            continue
        elif name == "STOP":
            break
        else:  # OBJ, INST, EXT*, BYTEARRAY8, NEXT_BUFFER...: keep the stack shape
            if pickletools.markobject in opcode.stack_before:
                pop_mark()
                for _ in range(opcode.stack_before.index(pickletools.markobject)):
                    stack.pop()
            else:
                for _ in opcode.stack_before:
                    stack.pop()
            stack.extend(_Box() for _ in opcode.stack_after)
            spent += (_SLOT + _OBJECT) * len(opcode.stack_after) + (sizeof(arg) if arg is not None else 0)
    return (stack[-1] if stack else None), refs


def _keys_with_bytes(top: object, sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """Each top-level string key with the stored bytes reachable under it; () if not a dict.

    Shared objects are walked once per key that reaches them, so the total is bounded by
    _MAX_KEY_VISITS: a pickle that hangs one huge list under every key would otherwise be quadratic.
    """
    if not isinstance(top, _Box) or not top.entries:
        return ()
    budget = [_MAX_KEY_VISITS]
    keys: list[tuple[str, int]] = []
    for key, value in top.entries:
        if isinstance(key, str):
            keys.append((key, sum(sizes.get(k, 0) for k in _refs_under(value, budget))))
    return tuple(keys)


def _refs_under(value: object, budget: list[int]) -> set[str]:
    """The storage keys reachable from ``value``, spending one of ``budget`` per object visited."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        budget[0] -= 1  # spent on every link followed, seen or not: one shared list under every key is quadratic
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
