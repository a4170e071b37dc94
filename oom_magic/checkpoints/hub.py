"""Read a hub model that is not in the local cache: config.json and each safetensors header by range
requests through huggingface_hub (its endpoint, auth, proxies and offline setting), never the weights.

One read costs a few hundred kilobytes: a HEAD and a GET of config.json and of the shard index,
then for each shard (in parallel) a HEAD, a GET of its 8-byte header length and a GET of exactly
the header, so not one byte of weights is asked for. Everything received is bounded as for local files (safetensors_header's limits, the
index's and config's sizes, the shard count), the whole read by `timeout` seconds (default 10).
Answers are kept per (repo, revision) for the life of the process. Any failure is one OomMagicError
line that says how to fix it.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..common.errors import OomMagicError, one_line
from ..records.hub import HubRead
from .gguf import GgufHeader, read_gguf_growing
from .safetensors_header import MAX_READ_HEADER_BYTES as _MAX_HEADER_READ
from .safetensors_header import check_header_length, check_shards, parse_safetensors_header

__all__ = ["DEFAULT_TIMEOUT_S", "RemoteCheckpoint", "hub_options", "read_hub_checkpoint", "read_hub_gguf"]

DEFAULT_TIMEOUT_S = 10.0
_MAX_CONFIG_BYTES = 16 * 1024 * 1024  # as files.py's limit for a local config.json
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_MAX_SHARDS = 2048  # the largest public checkpoints have a few hundred shards
_PARALLEL = 8
_MAX_GGUF_HEADER = 64 * 1024 * 1024  # gguf.py's bound on a header


@dataclass(frozen=True)
class _Options:
    timeout: float = DEFAULT_TIMEOUT_S
    token: str | bool | None = None  # None: HF_TOKEN or the saved login, as huggingface_hub decides


_DEFAULT_OPTIONS = _Options()
_OPTIONS: contextvars.ContextVar[_Options | None] = contextvars.ContextVar("oom_magic_hub_options", default=None)


@contextlib.contextmanager
def hub_options(*, timeout: float | None = None, token: str | bool | None = None) -> Iterator[None]:
    """Within the block, hub reads are bounded by `timeout` seconds and authenticate with `token`."""
    if timeout is not None and not timeout > 0:
        raise OomMagicError(f"the hub timeout must be a positive number of seconds, not {timeout!r}")
    current = (_OPTIONS.get() or _DEFAULT_OPTIONS)
    handle = _OPTIONS.set(_Options(current.timeout if timeout is None else float(timeout),
                                   current.token if token is None else token))
    try:
        yield
    finally:
        _OPTIONS.reset(handle)


@dataclass(frozen=True)
class RemoteCheckpoint:
    """What the hub said about one repo at one commit: its tensors, config and what reading cost."""

    read: HubRead
    format: str  # 'safetensors' | 'safetensors-sharded'
    files: tuple[str, ...]  # weight files, in index order
    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, dtype, shape, nbytes)
    config: dict[str, object] | None


_CACHE: dict[tuple[str, str, str], RemoteCheckpoint] = {}


def read_hub_gguf(repo_id: str, filename: str, *, revision: str | None = None) -> tuple[GgufHeader, HubRead]:
    """Read one GGUF file's header from a hub repo by growing range reads, never its tensor data."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise OomMagicError(f"{repo_id}/{filename} is not read: HF_HUB_OFFLINE=1 is set, so nothing was checked")
    if not filename.endswith(".gguf") or filename.startswith(("/", ".")) or ".." in filename.split("/"):
        raise OomMagicError(f"--file {filename!r}: give the name of a .gguf file in the repo, such as model-Q4_K_M.gguf")
    reader = _Reader(repo_id, revision or "main", _OPTIONS.get() or _DEFAULT_OPTIONS)
    try:
        size = reader._size(filename)
        if size is None:
            raise OomMagicError(f"{repo_id} has no file {filename} at {reader.revision[:12]}: check the name in the "
                                "repo's file list")
        held = bytearray()

        def first(n: int) -> bytes:
            if n > len(held):  # only what is not held yet: the reads grow, never repeat
                held.extend(reader._get(filename, len(held), min(n, size) - len(held), _MAX_GGUF_HEADER))
            return bytes(held[:n])

        header = read_gguf_growing(first, filename, size)
    except OomMagicError:
        raise
    except Exception as exc:
        raise OomMagicError(reader.explain(exc)) from None
    cache, free = _cache_disk()
    return header, HubRead(repo_id, reader.revision, 1, reader.bytes_read, size, cache, free)


def _cache_disk() -> tuple[str, int | None]:
    """The hub cache a download would go to, and the free bytes of its file system (of its nearest existing parent)."""
    from ..device.host import disk_free
    from .files import hub_cache_dir

    cache = hub_cache_dir()
    probe = cache
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return str(cache), disk_free(probe)


def read_hub_checkpoint(repo_id: str, *, revision: str | None = None) -> RemoteCheckpoint:
    """Size `repo_id` at `revision` from config.json and its safetensors headers, never its weights."""
    options = (_OPTIONS.get() or _DEFAULT_OPTIONS)
    key = (repo_id, revision or "main", _token_key(options.token))
    found = _CACHE.get(key)
    if found is not None:
        return found
    from huggingface_hub import constants

    if constants.is_offline_mode():
        from .files import hub_cache_dir

        raise OomMagicError(f"{repo_id} is not in the local hub cache ({hub_cache_dir()}) and HF_HUB_OFFLINE=1 is set, "
                            "so nothing was checked: unset HF_HUB_OFFLINE to read its headers from the hub, or "
                            "download it first")
    reader = _Reader(repo_id, revision or "main", options)
    try:
        found = reader.read()
    except OomMagicError:
        raise
    except Exception as exc:  # every network and protocol failure becomes one line
        raise OomMagicError(reader.explain(exc)) from None
    _CACHE[key] = found
    _CACHE[(repo_id, found.read.revision, key[2])] = found
    return found


def _token_key(token: str | bool | None) -> str:
    """Tells tokens apart in the cache's key without keeping one: what one token could read, another may not."""
    import hashlib

    return hashlib.sha256(str(token).encode()).hexdigest()[:16]


class _Reader:
    """One bounded read of a repo: the requests, their deadline and the bytes they brought."""

    def __init__(self, repo_id: str, revision: str, options: _Options) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.token = options.token
        self.timeout = options.timeout
        self.deadline = time.monotonic() + options.timeout
        self.bytes_read = 0

    def read(self) -> RemoteCheckpoint:
        config_size = self._size("config.json")
        config = None
        if config_size is not None:
            config = _json_object(self._get("config.json", 0, config_size, _MAX_CONFIG_BYTES), "config.json")
        index_size = self._size("model.safetensors.index.json")
        weight_map: dict[str, str] | None = None
        if index_size is not None:
            index = _json_object(self._get("model.safetensors.index.json", 0, index_size, _MAX_INDEX_BYTES),
                                 "model.safetensors.index.json")
            weight_map = _weight_map(index)
            shards = list(dict.fromkeys(weight_map.values()))
            if len(shards) > _MAX_SHARDS:
                raise OomMagicError(f"{self.repo_id}: its index names {len(shards)} shards, over the {_MAX_SHARDS} "
                                    "oom-magic reads")
        elif self._size("model.safetensors") is not None:
            shards = ["model.safetensors"]
        else:
            raise OomMagicError(
                f"{self.repo_id} has no model.safetensors or model.safetensors.index.json at {self.revision}, so "
                "nothing was checked: oom-magic sizes hub models from safetensors headers only (download it and "
                "check the folder, or pass a .gguf file)")
        with ThreadPoolExecutor(max_workers=min(_PARALLEL, len(shards))) as pool:
            headers = list(pool.map(self._header, shards))
        tensors = check_shards([(name, found) for name, (found, _) in zip(shards, headers)], weight_map,
                               "model.safetensors.index.json")
        download = sum(size for _, size in headers)
        cache, free = _cache_disk()
        read = HubRead(self.repo_id, self.revision, len(shards), self.bytes_read, download, cache, free)
        return RemoteCheckpoint(read, "safetensors-sharded" if weight_map is not None else "safetensors",
                                tuple(shards), tuple(tensors), config)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        return left

    def _url(self, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, name, revision=self.revision)

    def _size(self, name: str) -> int | None:
        """The file's size from a HEAD, or None when the repo has no such file; pins the commit."""
        from huggingface_hub import get_hf_file_metadata
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        try:
            meta = get_hf_file_metadata(self._url(name), token=self.token, timeout=self._left())
        except EntryNotFoundError:
            return None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        if meta.commit_hash and self.revision != meta.commit_hash:
            self.revision = meta.commit_hash  # every later read sees the same commit
        if meta.size is None:
            raise OomMagicError(f"{self.repo_id}: the hub did not say the size of {name}")
        return int(meta.size)

    def _get(self, name: str, begin: int, size: int, limit: int) -> bytes:
        """Bytes [begin, begin + size) of a file, refusing more than `limit`; counted in bytes_read."""
        if size > limit:
            raise OomMagicError(f"{self.repo_id}: {name} is {size} bytes, over the {limit} oom-magic reads; "
                                "not a config or index file")
        if size <= 0:
            return b""
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        headers = build_hf_headers(token=self.token)
        headers["Range"] = f"bytes={begin}-{begin + size - 1}"
        headers["Accept-Encoding"] = "identity"
        chunks: list[bytes] = []
        got = 0
        with get_session().stream("GET", self._url(name), headers=headers, timeout=self._left()) as response:
            hf_raise_for_status(response)
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                got += len(chunk)
                self._left()
                if got >= size:
                    break
        self.bytes_read += got
        data = b"".join(chunks)
        if response.status_code == 200 and begin > 0:
            data = data[begin:]  # a server that ignores Range; we stopped reading at `size`
        return data[:size]

    def _header(self, name: str) -> tuple[list[tuple[str, str, tuple[int, ...], int]], int]:
        """One shard's checked header and the shard's size, by growing range reads."""
        size = self._size(name)
        if size is None:
            raise OomMagicError(f"{self.repo_id}: the index names {name}, which the repo does not hold at "
                                f"{self.revision[:12]}")
        if size < 8:
            raise OomMagicError(f"{name}: the file is {size} bytes, too short for a safetensors header")
        # The length first, then exactly the header: not one byte of the weights is asked for.
        length = int.from_bytes(self._get(name, 0, 8, 8), "little")
        check_header_length(name, length, size)
        raw = self._get(name, 8, length, _MAX_HEADER_READ)
        if len(raw) != length:
            raise OomMagicError(f"{name}: the hub sent {len(raw)} of its {length} header bytes; try again")
        return parse_safetensors_header(name, raw, size - 8 - length), size

    def explain(self, exc: BaseException) -> str:
        """One line for a failed read, saying how to fix it."""
        from huggingface_hub import constants
        from huggingface_hub import errors as hub_errors

        repo = self.repo_id
        if isinstance(exc, hub_errors.GatedRepoError):
            return (f"{repo} is gated: accept its licence on {constants.ENDPOINT}/{repo} while logged in, then set "
                    "HF_TOKEN (or run `hf auth login`) to a token of that account; nothing was checked")
        if isinstance(exc, hub_errors.RevisionNotFoundError):
            return f"{repo} has no revision {self.revision!r} on the hub: pass a branch, tag or commit it has"
        if isinstance(exc, hub_errors.RepositoryNotFoundError):
            return (f"no model {repo} on the hub at {constants.ENDPOINT} (check the name; a private repo needs "
                    "HF_TOKEN set to a token with access)")
        if isinstance(exc, hub_errors.OfflineModeIsEnabled):
            return f"{repo} is not cached and HF_HUB_OFFLINE=1 is set, so nothing was checked"
        if isinstance(exc, hub_errors.HfHubHTTPError):
            status = getattr(exc.response, "status_code", "?")
            if status == 403:
                return (f"{repo}: the hub refused access (403): accept its licence on {constants.ENDPOINT}/{repo} "
                        "and set HF_TOKEN to a token with read access; nothing was checked")
            return f"{repo}: the hub answered {status}; nothing was checked ({one_line(str(exc), 120)})"
        name = type(exc).__name__
        if isinstance(exc, TimeoutError) or "Timeout" in name:
            return (f"{repo}: the hub at {constants.ENDPOINT} did not answer within {self.timeout:g} s, so nothing "
                    "was checked (check the network or proxy, or allow more time with the hub timeout setting)")
        return (f"{repo}: cannot reach the hub at {constants.ENDPOINT} ({name}: {one_line(str(exc), 100)}); "
                "nothing was checked (check the network, HF_ENDPOINT and proxy settings)")


def _json_object(raw: bytes, label: str) -> dict[str, Any]:
    """Parse a small JSON object read from the hub; one line when it is not one."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise OomMagicError(f"{label} from the hub is not valid JSON ({one_line(str(exc), 100)})") from None
    if not isinstance(data, dict):
        raise OomMagicError(f"{label} from the hub is not a JSON object")
    return data


def _weight_map(index: dict[str, Any]) -> dict[str, str]:
    """The checked weight_map of an index read from the hub: shard names are plain file names."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise OomMagicError("model.safetensors.index.json from the hub has no \"weight_map\" object")
    for tensor, shard in weight_map.items():
        if (not isinstance(shard, str) or not shard.endswith(".safetensors") or "/" in shard or "\\" in shard
                or shard.startswith(".")):
            raise OomMagicError(f"model.safetensors.index.json: weight_map[{str(tensor)[:80]!r}] is not a "
                                "safetensors file name beside the index")
    return weight_map
