"""Size a llama.cpp load of a GGUF file: its weights as stored, the KV cache at n_ctx, and what
n_gpu_layers puts on the GPU, as llama.cpp places them.

llama.cpp (src/llama-model.cpp) keeps the token embeddings on the CPU, offloads the last
n_gpu_layers repeating blocks, and the output layer only when n_gpu_layers exceeds the block count
(-1 offloads all). The KV cache (src/llama-kv-cache.cpp) holds, per layer, n_ctx rows of
n_embd_k_gqa = key_length x head_count_kv elements of type_k (f16 by default) and the same of V,
on the device of its layer.
"""
from __future__ import annotations

import re

from ..checkpoints.gguf import GgufHeader, ggml_sizes
from ..common.errors import OomMagicError
from ..records.hub import HubRead
from ..records.llama_cpp import LlamaCppLoad

__all__ = ["read_gguf", "size_llama_cpp"]

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_OUTPUT = ("output.weight", "output_norm.weight", "output_norm.bias", "output.bias")


def _int(metadata: dict[str, object], key: str) -> int | None:
    value = metadata.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _type_bytes(type_name: str, elements: int) -> int:
    """Bytes of `elements` values of a ggml type ('f16', 'q8_0', ...), by its block size."""
    for name, block, nbytes in ggml_sizes().values():
        if name.lower() == type_name.lower():
            return -(-elements // block) * nbytes
    raise OomMagicError(f"unknown KV cache type {type_name!r}: use f16, f32, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1")


def size_llama_cpp(header: GgufHeader, file: str, *, n_ctx: int | None = None, n_gpu_layers: int = -1,
                   type_k: str = "f16", type_v: str = "f16", hub: HubRead | None = None) -> LlamaCppLoad:
    """What llama.cpp holds for this GGUF at `n_ctx` (default: the model's context length) with
    `n_gpu_layers` blocks on the GPU (-1: all)."""
    meta = header.metadata
    arch = str(meta.get("general.architecture", ""))
    layers = _int(meta, f"{arch}.block_count")
    embd = _int(meta, f"{arch}.embedding_length")
    heads = _int(meta, f"{arch}.attention.head_count")
    if layers is None or embd is None or not heads:
        raise OomMagicError(f"{file}: the GGUF metadata lacks {arch or '?'}.block_count, embedding_length or "
                            "attention.head_count; cannot size its KV cache")
    heads_kv = _int(meta, f"{arch}.attention.head_count_kv") or heads
    key_length = _int(meta, f"{arch}.attention.key_length") or embd // heads
    value_length = _int(meta, f"{arch}.attention.value_length") or embd // heads
    ctx = n_ctx if n_ctx is not None and n_ctx > 0 else _int(meta, f"{arch}.context_length")
    if ctx is None:
        raise OomMagicError(f"{file}: no {arch}.context_length in its metadata: pass n_ctx")
    if n_gpu_layers < -1:
        raise OomMagicError(f"n_gpu_layers must be -1 (all) or 0 or more, not {n_gpu_layers}")
    offloaded = layers if n_gpu_layers == -1 else min(n_gpu_layers, layers)
    output_on_gpu = n_gpu_layers == -1 or n_gpu_layers > layers
    first_gpu = layers - offloaded
    gpu = cpu = 0
    by_type: dict[str, int] = {}
    for tensor in header.tensors:
        by_type[tensor.ggml_type] = by_type.get(tensor.ggml_type, 0) + tensor.nbytes
        block = _BLOCK.match(tensor.name)
        on_gpu = (int(block.group(1)) >= first_gpu) if block else (output_on_gpu and tensor.name in _OUTPUT)
        if on_gpu:
            gpu += tensor.nbytes
        else:
            cpu += tensor.nbytes
    per_layer = _type_bytes(type_k, key_length * heads_kv) * ctx + _type_bytes(type_v, value_length * heads_kv) * ctx
    kv = per_layer * layers
    gpu += per_layer * offloaded
    cpu += per_layer * (layers - offloaded)
    return LlamaCppLoad(
        file=file, layers=layers, n_ctx=ctx, n_gpu_layers=n_gpu_layers, type_k=type_k.lower(),
        type_v=type_v.lower(), parameters=sum(t.elements for t in header.tensors),
        weights_bytes=sum(t.nbytes for t in header.tensors),
        by_type=tuple(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))), kv_cache_bytes=kv,
        gpu_bytes=gpu, cpu_bytes=cpu, hub=hub)


def read_gguf(path_or_repo: str, file: str | None, revision: str | None) -> tuple[GgufHeader, HubRead | None, str]:
    """A GGUF header from a local file, or from `file` in hub repo `path_or_repo`; (header, what the hub sent, label)."""
    from pathlib import Path

    from ..checkpoints.gguf import read_gguf_header

    if file is not None:
        from ..checkpoints.hub import read_hub_gguf

        local_repo = Path(path_or_repo).expanduser() / file
        if local_repo.is_file():  # a folder holding the file (transformers' gguf_file= with a local folder)
            return read_gguf_header(local_repo), None, file
        header, hub = read_hub_gguf(path_or_repo, file, revision=revision)
        return header, hub, f"{path_or_repo}/{file}"
    local = Path(path_or_repo).expanduser()
    if not local.is_file():
        raise OomMagicError(f"no such GGUF file: {path_or_repo} (for a file in a hub repo, pass org/name --file "
                            "X.gguf)")
    return read_gguf_header(local), None, local.name
