"""Predict a load's host-memory (RSS) peak: what a ``from_pretrained`` onto the cpu holds while it runs.

A safetensors file is memory-mapped. Tensors loaded in their stored dtype stay views of the file:
mapped, not resident until something reads them (the kernel can drop those pages again). A tensor
that has to change becomes new memory *beside* the file pages read to make it: a dtype cast
(bf16 checkpoint loaded as float32) or a transformers-5 MoE fusion (per-expert weights stacked into
3-D parameters; cast first, when both, so the cast copies live until the stack is built).

    peak ≈ new bytes (cast or fused, at the load dtype) + their file pages + transient copies

Transient copies: cast experts all live until stacked; same-dtype experts are stacked per layer
into gate and up halves that are then concatenated (transformers' MergeModulelist +
Concatenate), so one layer's gate and up (two of each expert's three matrices) exist twice.

Measured against real loads on this cpu (transformers 5.24, safetensors, benchmarks/ESTIMATES.md):
a Llama saved bf16 and loaded as float32 peaks at 1.5x its loaded bytes; a Mixtral in bf16 holds
its fused experts twice (new + file pages) after the load. Pure arithmetic on a CheckpointEstimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common.dtypes import FLOAT_BYTES

__all__ = ["LoadPeak", "load_peak"]

_MAPPABLE = ("safetensors", "safetensors-sharded")


@dataclass(frozen=True)
class LoadPeak:
    """The host memory a cpu load takes: what it keeps, what it copies, and its peak while running."""

    loaded: int  # the weights once loaded (estimate.bytes_for(dtype))
    new_bytes: int  # of which copied into new memory: cast, or fused MoE experts
    file_bytes: int  # file pages read to make the copies (mapped from the file, counted in RSS)
    transient: int  # copies alive only during the load (cast experts before they are stacked)
    mapped: int  # weights left as views of the file: not resident until read

    @property
    def peak(self) -> int:
        """RSS growth at the load's peak (the file pages count: RSS includes them)."""
        return self.new_bytes + self.file_bytes + self.transient

    @property
    def ram_need(self) -> int:
        """RAM the load needs: its peak, and at least the weights once every one has been read."""
        return max(self.peak, self.loaded)


def load_peak(estimate: Any, dtype: str | None) -> LoadPeak | None:
    """The host-memory peak of loading ``estimate``'s checkpoint onto the cpu as ``dtype`` (None: as stored).

    None for a torch.save file (its pickle is read into memory whole: the peak is its size, said
    elsewhere) or a quantized load (bitsandbytes needs a GPU).
    """
    sizes = getattr(estimate, "_sizes", None)
    if sizes is None or estimate.format not in _MAPPABLE:
        return None
    if dtype is not None and dtype not in FLOAT_BYTES:
        return None
    loaded = estimate.stored_bytes if dtype is None else estimate.bytes_for(dtype)
    census = dict(estimate.stored_dtypes)
    cast = {} if dtype is None else {n: e for n, e in census.items() if n != dtype and n in FLOAT_BYTES}
    cast_elements = sum(cast.values())
    cast_stored = sum(e * FLOAT_BYTES[n] for n, e in cast.items())
    width = FLOAT_BYTES.get(dtype or "", 0)
    experts_cast = cast_elements > 0 and sizes.expert_elements > 0
    # Experts in the load dtype are still copied (stacked); cast experts are counted in the cast,
    # and their cast copies live until the stack is built.
    stacked = 0 if experts_cast else (sizes.expert_bytes if dtype is None else sizes.expert_elements * width)
    new_bytes = cast_elements * width + stacked
    file_bytes = cast_stored + (0 if experts_cast else sizes.expert_bytes)
    if experts_cast:
        transient = sizes.expert_elements * width
    elif sizes.expert_layers:  # one layer's gate + up stacks, before they are concatenated
        transient = stacked * 2 // (3 * sizes.expert_layers)
    else:
        transient = 0
    return LoadPeak(loaded, new_bytes, file_bytes, transient, max(loaded - new_bytes, 0))
