"""A local Hugging Face hub for the tests: a real HTTP server on 127.0.0.1 speaking the hub's protocol
as huggingface_hub calls it, serving files that are real headers over sparse holes.

What it answers, as huggingface.co does (huggingface_hub/file_download.py, hf_api.py, utils/_http.py):
HEAD and GET ``/{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``ETag`` and
``Content-Length`` (``206`` with ``Content-Range`` for a ``Range``); ``/api/models/{repo}`` (also
``/revision/{rev}``) and ``/api/models/{repo}/tree/{rev}``; ``404`` with ``X-Error-Code:
RepoNotFound`` / ``EntryNotFound`` / ``RevisionNotFound``; ``401`` with ``GatedRepo`` for a gated repo
without the right token. ``stall = True`` accepts requests and never answers (a stalled proxy).
Every body byte sent is counted per file, so a test can assert that no weights were fetched.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GOOD_TOKEN = "hf_local_test_token"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Repo:
    """One model repo: its files on disk and whether it is gated."""

    files: dict[str, Path]
    gated: bool = False
    commit: str = field(default="")

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(repr(sorted(self.files)).encode()).hexdigest()


class HubServer:
    """A threaded HTTP server holding repos; ``url`` is what HF_ENDPOINT is set to."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.sent: dict[str, int] = {}  # "repo/file" -> body bytes sent
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.stall = False
        self._data_sent: dict[str, int] = {}  # "repo/file" -> bytes sent from past the header
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def reset_counts(self) -> None:
        """Count from zero again: what the next test makes the hub send is its own."""
        with self._lock:
            self.sent.clear()
            self._data_sent.clear()

    def weight_bytes_sent(self) -> int:
        """Bytes sent from the data region of every safetensors/gguf file (past its header)."""
        with self._lock:
            return sum(self._data_sent.values())

    def count(self, key: str, begin: int, end: int, header_end: int | None) -> None:
        """Count the body bytes [begin, end) sent of one file, and those past its header."""
        with self._lock:
            self.sent[key] = self.sent.get(key, 0) + end - begin
            if header_end is not None and end > header_end:
                self._data_sent[key] = self._data_sent.get(key, 0) + end - max(begin, header_end)


def header_end(path: Path) -> int | None:
    """Where a safetensors file's tensor data starts (8 + header length), else None."""
    if not path.name.endswith(".safetensors"):
        return None
    with open(path, "rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: tests read hub.requests instead
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            if hub.stall:
                hub._stop.wait(60)  # a proxy that accepts and never answers
                return
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/"):], body)
            match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not match:
                return self._error(404, "RepoNotFound", "not a hub path", body)
            repo_id, rev, name = match.groups()
            repo = self._repo(repo_id, rev, body)
            if repo is None:
                return None
            file = repo.files.get(name)
            if file is None:
                return self._error(404, "EntryNotFound", f"{name} not in {repo_id}", body)
            size = file.stat().st_size
            begin, end, status = 0, size, 200
            wanted = self.headers.get("Range")
            if wanted:
                m = _RANGE.match(wanted.strip())
                if m is None:
                    return self._error(416, None, "bad range", body)
                begin = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                status = 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", '"' + hashlib.sha1(f"{repo_id}/{name}".encode()).hexdigest() + '"')
            self.send_header("Content-Length", str(end - begin))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{size}")
            self.end_headers()
            if body:
                self._send_file(file, begin, end, f"{repo_id}/{name}")

        def _send_file(self, file: Path, begin: int, end: int, key: str) -> None:
            done = begin
            try:
                with open(file, "rb") as handle:
                    handle.seek(begin)
                    while done < end:
                        chunk = handle.read(min(1 << 20, end - done))
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        done += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client read what it wanted and left
            finally:
                hub.count(key, begin, done, header_end(file))

        def _repo(self, repo_id: str, rev: str, body: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found", body)
                return None
            if repo.gated and self.headers.get("Authorization") != f"Bearer {GOOD_TOKEN}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted", body)
                return None
            if rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
                return None
            return repo

        def _api(self, rest: str, body: bool) -> None:
            parts = rest.split("/")
            repo_id = "/".join(parts[:2])
            tail = parts[2:]
            rev = "main"
            if len(tail) >= 2 and tail[0] in ("revision", "tree"):
                rev = tail[1]
            repo = self._repo(repo_id, rev, body)
            if repo is None:
                return
            if tail[:1] == ["tree"]:
                data: object = [{"type": "file", "path": n, "size": p.stat().st_size,
                                 "oid": hashlib.sha1(n.encode()).hexdigest()} for n, p in sorted(repo.files.items())]
            else:
                data = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "gated": repo.gated, "private": False,
                        "siblings": [{"rfilename": n} for n in sorted(repo.files)]}
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if body:
                self.wfile.write(raw)

        def _error(self, status: int, code: str | None, message: str, body: bool) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if body:
                self.wfile.write(raw)

    return Handler


# --------------------------------------------------------------------------- checkpoints over sparse files


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Write a safetensors file with a real header and its data region a sparse hole; returns its size."""
    widths = {"BF16": 2, "F16": 2, "F32": 4}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * widths[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


LLAMA7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16", "tie_word_embeddings": False,
}
LLAMA7B_PARAMETERS = 6_738_415_616


def llama7b_repo(folder: Path, *, gated: bool = False) -> Repo:
    """Llama-2-7B's layout (two float16 shards, an index, config.json) as sparse files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    h, inter, vocab, layers = 4096, 11008, 32000, 32
    names: list[dict[str, tuple[str, tuple[int, ...]]]] = [{}, {}]
    names[0]["model.embed_tokens.weight"] = ("F16", (vocab, h))
    for i in range(layers):
        shard = names[0] if i < 24 else names[1]
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shard[p + f"self_attn.{proj}.weight"] = ("F16", (h, h))
        shard[p + "mlp.gate_proj.weight"] = ("F16", (inter, h))
        shard[p + "mlp.up_proj.weight"] = ("F16", (inter, h))
        shard[p + "mlp.down_proj.weight"] = ("F16", (h, inter))
        shard[p + "input_layernorm.weight"] = ("F16", (h,))
        shard[p + "post_attention_layernorm.weight"] = ("F16", (h,))
    names[1]["model.norm.weight"] = ("F16", (h,))
    names[1]["lm_head.weight"] = ("F16", (vocab, h))
    files: dict[str, Path] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(names):
        shard_name = f"model-{k + 1:05d}-of-00002.safetensors"
        total += sparse_safetensors(folder / shard_name, tensors)
        files[shard_name] = folder / shard_name
        weight_map.update({n: shard_name for n in tensors})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = folder / "config.json"
    config.write_text(json.dumps(LLAMA7B_CONFIG))
    files["model.safetensors.index.json"] = index
    files["config.json"] = config
    return Repo(files, gated=gated)
