"""Size a vLLM ``LLM(model=...)`` for one GPU: its share of the weights and one sequence of KV cache.

vLLM reserves ``gpu_memory_utilization`` of each GPU when it starts (and refuses to start when
less than that is free), loads its share of the weights into the reservation, and needs room left
there for the KV cache of at least one ``max_model_len``-token sequence. The KV cache per token is
2 (key and value) × layers × key-value heads × head dim × the cache dtype's bytes, from config.json;
``tensor_parallel_size`` GPUs split the weights and the heads. Activations and CUDA graphs, which
vLLM profiles at startup, come out of what is left and are not counted here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoints.files import read_config, resolve_checkpoint
from ..common.dtypes import FLOAT_BYTES
from ..common.errors import OomMagicError
from ..records.request import LoadRequest

__all__ = ["VllmSizes", "vllm_sizes"]


@dataclass(frozen=True)
class VllmSizes:
    """What one GPU of a vLLM engine holds in its reservation (int bytes)."""

    dtype: str  # the dtype vLLM serves in ("auto": float16 for float32/float16 checkpoints, else bfloat16)
    weights: int  # this GPU's share of the weights
    kv_per_token: int  # this GPU's KV cache for one token
    max_model_len: int  # the tokens of the one sequence the KV cache must hold

    @property
    def kv_cache(self) -> int:
        return self.kv_per_token * self.max_model_len

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache


def _served_dtype(request: str | None, declared: str | None, stored: str | None) -> str:
    """vLLM's dtype="auto": float16 for float32 and float16 models, bfloat16 for bfloat16 ones."""
    if request in FLOAT_BYTES and request != "float64":
        return request
    source = declared or stored
    return "bfloat16" if source == "bfloat16" else "float16"


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs nest it under text_config)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def vllm_sizes(call: LoadRequest, estimate: Any, stored_float: str | None) -> VllmSizes:
    """The weights and KV cache one GPU of ``LLM(...)`` holds; OomMagicError when config.json cannot say."""
    assert call.checkpoint is not None
    folder = resolve_checkpoint(call.checkpoint)
    config_path = (folder if folder.is_dir() else folder.parent) / "config.json"
    if not config_path.is_file():
        raise OomMagicError(f"{call.checkpoint} has no config.json: vLLM's KV cache cannot be sized")
    config = _text_config(read_config(config_path))
    dtype = _served_dtype(call.dtype, estimate.declared_dtype, stored_float)
    parallel = max(call.tensor_parallel, 1)
    if call.quantization == "fp8":  # online fp8: one byte per Linear weight plus a scale per row, like int8
        weights = estimate.bytes_for("int8", unquantized_dtype=dtype)
    else:  # pre-quantized checkpoints (awq, gptq, ...) keep their packed integers; floats are served in dtype
        weights = estimate.bytes_for(dtype)
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(config, "num_attention_heads", "n_head")
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or (hidden is None and _int(config, "head_dim") is None):
        raise OomMagicError(f"{config_path}: no num_hidden_layers / num_attention_heads / hidden_size to size "
                            "vLLM's KV cache from")
    kv_heads = _int(config, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _int(config, "head_dim") or (hidden or 0) // heads
    length = call.max_model_len or _int(config, "max_position_embeddings", "n_positions", "max_seq_len")
    if length is None:
        raise OomMagicError(f"{config_path}: no max_position_embeddings; pass max_model_len= to size the KV cache")
    # Heads split over the GPUs; with fewer key-value heads than GPUs each GPU keeps one replica.
    per_gpu_heads = max(kv_heads // parallel, 1)
    kv_per_token = 2 * layers * per_gpu_heads * head_dim * FLOAT_BYTES[dtype]
    return VllmSizes(dtype, -(-weights // parallel), kv_per_token, length)
