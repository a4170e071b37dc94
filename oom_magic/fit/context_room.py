"""How much context the model a cell just loaded has room for: free memory now over the KV cache's growth per token.

After a guarded load of a transformers model whose config is known, the guard asks this once with
the device's free memory after the load. The growth per token is the job sizing's
(``sizing.parts.size_job``: the model's config run on the meta device in a bounded child, never torch
in the user's process): at the cell's job's batch for inference, which is the probe the preflight
already ran (kept, so not run again), else at batch 1. A cache of fixed size (a state-space model's
state) has no growth per token, so no room figure.
"""
from __future__ import annotations

from ..checkpoints.files import find_checkpoint_files, resolve_checkpoint, uncached_hub_id
from ..checkpoints.hub import hub_options
from ..common.errors import OomMagicError
from ..records.guard import ContextRoom
from ..records.job import Job
from ..records.preflight import FitCheck, Preflight
from ..sizing.parts import size_job
from .job_check import job_dtypes

__all__ = ["context_room"]

_HF_LOADS = ("from_pretrained", "pipeline")
_FLOATS = ("float32", "float16", "bfloat16")


def _loaded(preflight: Preflight) -> FitCheck | None:
    """The cell's first transformers load whose weights were sized and whose config.json is there."""
    for check in preflight.checks:
        path = check.call.checkpoint
        if check.call.kind not in _HF_LOADS or path is None or check.estimate is None or check.need is None:
            continue
        if uncached_hub_id(path) is not None:
            return check  # its config comes from the hub, as the weights' headers did
        try:
            if find_checkpoint_files(resolve_checkpoint(path)).config is not None:
                return check
        except OomMagicError:
            continue
    return None


def context_room(preflight: Preflight | None, free: int | None, device: str) -> ContextRoom | None:
    """Tokens of KV cache that fit in ``free`` bytes, at the job's batch (inference) or batch 1; None when the
    cell loaded no transformers model with a config, or its cache does not grow per token.

    Raises OomMagicError with one line when transformers cannot size the model's cache.
    """
    if preflight is None or free is None:
        return None
    check = _loaded(preflight)
    if check is None:
        return None
    job = check.call.job if check.call.job is not None and not check.call.job.train else Job(context=1)
    dtype, quantization = job_dtypes(check, False)
    with hub_options(token=check.call.token):
        sizing = size_job(str(check.call.checkpoint), job, dtype=dtype, quantization=quantization)
    if sizing.kv_growth_per_token <= 0:
        return None
    declared = getattr(check.estimate, "declared_dtype", None)
    # the cache's dtype as size_job computes in it: the load's float dtype, else the config's, else
    # bfloat16 under bitsandbytes and float32 without
    shown = dtype or (declared if declared in _FLOATS else "bfloat16" if quantization else "float32")
    return ContextRoom(tokens=int(max(free, 0) // sizing.kv_growth_per_token), batch=job.batch, dtype=shown,
                       free=free, per_token=sizing.kv_growth_per_token, device=device)
