"""Find the files of a checkpoint the user named (a local path, or a hub id in the local HF cache)
and read their structure (shard indexes, configs, a torch.save zip's top-level keys) without loading
a tensor.

Nothing here goes online or imports huggingface_hub: a hub id is looked up in the cache layout
huggingface_hub writes (``<cache>/models--org--name/refs/main`` -> ``snapshots/<rev>/``); an id
that was never downloaded is told apart (``uncached_hub_id``) for hub.py to read its headers. A torch.save zip is read by torch_zip
(data.pkl walked opcode by opcode, never unpickled, within fixed bounds).
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..common.errors import OomMagicError, one_line
from .torch_zip import OPTIMIZER_KEY, open_torch_zip, top_level_keys

__all__ = ["CheckpointFiles", "CheckpointKeys", "find_checkpoint_files", "hub_cache_dir", "one_line",
           "read_checkpoint_keys", "resolve_checkpoint",
           "uncached_hub_id"]

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


def uncached_hub_id(path_or_id: object) -> str | None:
    """The hub id `path_or_id` names when it is no local path and the hub cache has no snapshot of it."""
    if not isinstance(path_or_id, str) or not _HUB_ID.match(path_or_id) or path_or_id.count("/") != 1:
        return None
    try:
        if Path(path_or_id).expanduser().exists() or Path(path_or_id).is_symlink():
            return None
    except (OSError, ValueError, RuntimeError):
        return None
    if _cached_snapshot(hub_cache_dir() / ("models--" + path_or_id.replace("/", "--"))) is not None:
        return None
    return path_or_id


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
    if "/" not in name and "\\" not in name and ":" not in name and name not in ("", ".", ".."):
        return folder / name  # a plain file name, as every hub checkpoint's shards are
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

_OPTIMIZER_KEY = OPTIMIZER_KEY
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module", "net", "model_state", "weights", "params")


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

    Walks data.pkl's opcodes symbolically (torch_zip); nothing is unpickled or imported. Returns
    None for files that are not zips or hold no top-level data.pkl; raises a one-line
    OomMagicError for a damaged or hostile one, or one past torch_zip's limits.
    """
    file = Path(path)
    try:
        if not zipfile.is_zipfile(file):
            return None
    except OSError as exc:
        raise OomMagicError(f"{one_line(file.name)}: cannot read it ({one_line(exc.strerror or exc, 100)})") from None
    found = open_torch_zip(file)
    if found is None:
        return None
    keys, locations, total = top_level_keys(found)
    return CheckpointKeys(keys, locations, total)
