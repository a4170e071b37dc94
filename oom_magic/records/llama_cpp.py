"""What a llama.cpp load of a GGUF file holds: weights by ggml type, the KV cache, the GPU/CPU split."""
from __future__ import annotations

from dataclasses import dataclass

from .hub import HubRead
from .shown import Shown
from .target import Target

__all__ = ["LlamaCppLoad"]


@dataclass(frozen=True, repr=False)
class LlamaCppLoad(Shown):
    """A GGUF file loaded by llama.cpp at `n_ctx` with `n_gpu_layers` on the GPU; int bytes."""

    file: str
    layers: int  # repeating blocks (blk.N)
    n_ctx: int
    n_gpu_layers: int  # as asked; -1 = all
    type_k: str
    type_v: str
    parameters: int
    weights_bytes: int  # every tensor by its ggml type's block size
    by_type: tuple[tuple[str, int], ...]  # (ggml type, bytes), most bytes first
    kv_cache_bytes: int  # K and V of every layer at n_ctx
    gpu_bytes: int  # offloaded layers' weights and KV cache (and the output layer when every layer is offloaded)
    cpu_bytes: int  # the rest: the token embeddings always, the layers left on the CPU
    target: Target | None = None  # --target: the GPU checked against
    gpu_budget: int | None = None  # usable GPU memory after headroom; None when not checked
    hub: HubRead | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the GPU share fits the budget; None when no budget was checked."""
        return None if self.gpu_budget is None else self.gpu_bytes <= self.gpu_budget

    def __repr__(self) -> str:
        return (f"LlamaCppLoad({self.file!r}, weights={self.weights_bytes}, kv_cache={self.kv_cache_bytes}, "
                f"gpu={self.gpu_bytes}, cpu={self.cpu_bytes})")
