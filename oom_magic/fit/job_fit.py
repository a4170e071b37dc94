"""The fit check of a job: its parts against the usable memory of one or several target GPUs.

``job_fit("path", Job(context=8192, batch=4), "2xA10G")`` sizes the job (``sizing.parts``) and
answers: does the busiest device fit, the largest context at this batch and the largest batch at
this context that would (a fine-tune's from how its step's activations grow per sequence), and how
many of that GPU the job needs when it does not. Inference over several GPUs is judged per GPU on
``device_map="auto"``'s split (``sizing.device_split``), and the GPUs it needs are the fewest
whose split fits.
"""
from __future__ import annotations

import math
import os
import re

from ..common.errors import OomMagicError
from ..records.job import DeviceSplit, Job, JobFit
from ..sizing.device_split import (MOST_GPUS, split_fits, split_gpus_needed, split_largest_batch,
                                   split_largest_context)
from ..sizing.parts import JobSizing, check_job, size_job
from .targets import parse_target

__all__ = ["job_fit", "sized_job_fit", "split_target"]

_COUNT = re.compile(r"^\s*(\d+)\s*[x×]\s*(\S.*)$", re.IGNORECASE)
_MOST_GPUS = MOST_GPUS


def split_target(text: str) -> tuple[int, str]:
    """'2xA10G' → (2, 'A10G'); 'T4' → (1, 'T4'). OomMagicError for a count below 1 or over 64."""
    match = _COUNT.match(str(text))
    if match is None:
        return 1, str(text).strip()
    count = int(match.group(1))
    if not 1 <= count <= _MOST_GPUS:
        raise OomMagicError(f"{text!r}: the GPU count must be between 1 and {_MOST_GPUS}")
    return count, match.group(2).strip()


def job_fit(path_or_id: str | os.PathLike[str], job: Job, target: str, *, dtype: str | None = None,
            quantization: str | None = None) -> JobFit:
    """Size ``job`` on the checkpoint (``quantization``: see sizing.parts.size_job) and check it against
    ``target`` ("T4", "2xA10G", "24GiB")."""
    count, name = split_target(target)
    if count > 1 and job.gpus == 1:
        job = Job(**{**job.__dict__, "gpus": count})
    check_job(job)
    usable = parse_target(name).usable
    sizing = size_job(path_or_id, job, dtype=dtype, quantization=quantization, usable=usable)
    return _verdict(str(path_or_id), job, sizing, name, usable)


def sized_job_fit(checkpoint: str, job: Job, sizing: JobSizing, where: str, budget: int) -> JobFit:
    """The verdict of a job already sized (``size_job``) against ``budget`` bytes of one device named ``where``:
    a cell's load checked against this machine's free memory, or its ``--target``, after headroom."""
    return _verdict(checkpoint, job, sizing, where, budget)


def _verdict(checkpoint: str, job: Job, sizing: JobSizing, name: str, usable: int) -> JobFit:
    parts = sizing.parts
    if parts.split is not None:
        return _split_verdict(checkpoint, job, sizing, parts.split, name, usable)
    budget = usable  # one GPU (several: the fine-tune's per-device shares, inference's split above)
    needed = max(parts.per_device) if parts.per_device else parts.total
    fits = needed <= budget
    largest_context = largest_batch = None
    if not job.train:
        # what the cache may take; a prompt that is the whole context shrinks with it, so its
        # forward's transient is left out there (the text says so), kept when the prompt is fixed
        prompt_forward = (parts.activations or 0) if job.prompt is None else 0
        room = budget - (parts.total - parts.kv_cache - prompt_forward)
        if sizing.kv_growth_per_token > 0:
            largest_context = max(job.context + math.floor((room - parts.kv_cache) / sizing.kv_growth_per_token), 0)
        largest_batch = max(room // sizing.kv_per_sequence, 0) if sizing.kv_per_sequence else None
    elif parts.activations is not None and sizing.activations_per_sequence > 0:
        # a step's activations grow linearly with the batch (sized at batch and batch + 1); what is held
        # and the optimizer step's temporary (which does not meet them) stay
        sharded = bool(parts.per_device)  # FSDP: each device holds 1/N and the largest layer gathered
        steady = math.ceil(parts.held / job.gpus) + sizing.largest_layer if sharded else parts.held
        step = math.ceil(parts.optimizer_step / job.gpus) if sharded else parts.optimizer_step
        room = budget - steady
        largest_batch = (0 if room < step else
                         max(job.batch + math.floor((room - parts.activations) / sizing.activations_per_sequence), 0))
    return JobFit(checkpoint, job, parts, name, usable, fits, largest_context, largest_batch,
                  None if fits else _gpus_needed(job, sizing, usable), _gpus_tried(sizing))


def _split_verdict(checkpoint: str, job: Job, sizing: JobSizing, split: DeviceSplit, name: str,
                   usable: int) -> JobFit:
    """Inference over several GPUs: device_map="auto"'s split judged per GPU."""
    parts = sizing.parts
    figures = next(f for f in sizing.splits if f.gpus == job.gpus)
    fits = split_fits(split, usable)
    return JobFit(checkpoint, job, parts, name, usable, fits, split_largest_context(split, figures, job, usable),
                  split_largest_batch(split, job, usable), None if fits else _gpus_needed(job, sizing, usable),
                  _gpus_tried(sizing))


def _gpus_tried(sizing: JobSizing) -> int:
    return max((figures.gpus for figures in sizing.splits), default=0)


def _gpus_needed(job: Job, sizing: JobSizing, usable: int) -> int | None:
    parts = sizing.parts
    if not job.train:  # the fewest GPUs whose device_map="auto" split fits
        return split_gpus_needed(sizing.splits, parts.activations, job, usable)
    for count in range(job.gpus + 1, _MOST_GPUS + 1):  # each device: 1/N of what is held, its own step's activations
        transient = max(parts.activations or 0, math.ceil(parts.optimizer_step / count))
        if math.ceil(parts.held / count) + sizing.largest_layer + transient <= usable:
            return count
    return None
