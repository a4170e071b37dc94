"""How much context the model a cell just loaded has room for: free memory now over the KV cache's growth per token.

After a guarded load of a transformers model whose config is known, the guard asks this once with
the device's free memory after the load. The growth per token is the job sizing's
(``sizing.parts.size_job``: the model's config run on the meta device in a bounded child, never torch
in the user's process): at the cell's job's batch for inference, which is the probe the preflight
already ran (kept, so not run again), else at batch 1. A cache of fixed size (a state-space model's
state) has no growth per token, so no room figure. ``RoomProbe.start`` sizes it in a thread while the
cell runs (the guard does so for loads to a CUDA GPU; on the cpu or mps, whose memory is the RAM, the
child's memory would compete with the load, so it runs after).
"""
from __future__ import annotations

import threading

from ..checkpoints.files import find_checkpoint_files, resolve_checkpoint, uncached_hub_id
from ..checkpoints.hub import hub_options
from ..records.guard import ContextRoom
from ..records.job import Job
from ..records.preflight import FitCheck, Preflight
from ..sizing.parts import JobSizing, size_job
from .job_check import job_dtypes

__all__ = ["RoomProbe", "context_room"]

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
        except Exception:  # a folder that cannot be read now has no room figure; never an error in the cell
            continue
    return None


class RoomProbe:
    """The KV cache's growth per token for the cell's model, sized once: when asked, or in a thread started
    before the cell runs (its child works while the load does; the thread only waits on it)."""

    def __init__(self, preflight: Preflight | None) -> None:
        self.check = _loaded(preflight) if preflight is not None else None
        job = self.check.call.job if self.check is not None else None
        # an inference job's own batch (its probe already ran in the preflight); else batch 1
        self.job = job if job is not None and not job.train else Job(context=1)
        self._sizing: JobSizing | None = None
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Size it in a background thread; ``room`` waits for it (the child is bounded in time and memory)."""
        if self.check is not None and self._thread is None:
            self._thread = threading.Thread(target=self._size, name="oom-magic-kv-room", daemon=True)
            self._thread.start()

    def _size(self) -> None:
        assert self.check is not None
        dtype, quantization = job_dtypes(self.check, False)
        try:
            with hub_options(token=self.check.call.token):
                self._sizing = size_job(str(self.check.call.checkpoint), self.job, dtype=dtype,
                                        quantization=quantization)
        except Exception as exc:  # kept for room(), which raises it where the guard turns it into a note
            self._error = exc

    def room(self, free: int | None, device: str) -> ContextRoom | None:
        """Tokens of KV cache that fit in ``free`` bytes at this batch; None when the cell loaded no
        transformers model with a config, or its cache does not grow per token.

        Raises OomMagicError with one line when transformers cannot size the model's cache.
        """
        if self.check is None or free is None:
            return None
        if self._thread is None:
            self._size()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._sizing is not None
        if self._sizing.kv_growth_per_token <= 0:
            return None
        dtype, quantization = job_dtypes(self.check, False)
        declared = getattr(self.check.estimate, "declared_dtype", None)
        # the cache's dtype as size_job computes in it: the load's float dtype, else the config's, else
        # bfloat16 under bitsandbytes and float32 without
        shown = dtype or (declared if declared in _FLOATS else "bfloat16" if quantization else "float32")
        per_token = self._sizing.kv_growth_per_token
        return ContextRoom(tokens=int(max(free, 0) // per_token), batch=self.job.batch, dtype=shown, free=free,
                           per_token=per_token, device=device)


def context_room(preflight: Preflight | None, free: int | None, device: str) -> ContextRoom | None:
    """Tokens of KV cache that fit in ``free`` bytes, at the job's batch (inference) or batch 1, sized now
    (``RoomProbe``); None when the cell loaded no transformers model with a config."""
    return RoomProbe(preflight).room(free, device)
