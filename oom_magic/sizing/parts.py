"""Put a checkpoint's weights and a job together into the parts it holds on its devices.

The weights come from the checkpoint's headers (``checkpoints.estimate``: bitsandbytes' nf4 figures
for QLoRA's base); everything else from the job's meta-device probe: the KV cache at its peak for
inference; gradients and optimizer state as torch.optim creates them for a fine-tune, only for the
adapters with LoRA, and the activations of one training step (``probe.TrainStep``: with or without
gradient checkpointing; under mixed precision the weights, gradients and AdamW state are float32).
Over several GPUs a fine-tune is sharded as FSDP / ZeRO-3 does it: each device holds 1/N of the
parameters, gradients and state, plus the largest layer gathered whole, and the activations of its
own batch. Inference over several GPUs is split as ``from_pretrained(device_map="auto")`` splits it
(``sizing.device_split``): each GPU holds the modules the map puts there and the cache of its decoder layers.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoints.estimate import estimate_checkpoint
from ..checkpoints.files import find_checkpoint_files, resolve_checkpoint, uncached_hub_id
from ..common.dtypes import QUANTIZED, canonical_dtype
from ..common.errors import OomMagicError
from ..records.job import TRAIN_KINDS, Job, JobParts
from .device_split import MOST_GPUS, device_split
from .probe import JobProbe, SplitFigures, TrainStep, probe_job
from .training import gradient_bytes, optimizer_bytes, optimizer_step_bytes

__all__ = ["MIXED_PRECISIONS", "JobSizing", "check_job", "size_job"]

_FLOATS = ("float32", "float16", "bfloat16")
_OPTIMIZER = {"adamw": "adamw", "sgd": "sgd", "adamw8bit": "adamw8bit", "lora": "adamw", "qlora": "adamw"}
MIXED_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class JobSizing:
    """A job's parts and how its KV cache scales, for the verdict's largest context and batch."""

    parts: JobParts
    kv_growth_per_token: float  # bytes the peak cache grows per token of context at this batch
    kv_per_sequence: int        # the peak cache divided by the batch (every cache tensor has a batch row)
    largest_layer: int          # bytes of the largest repeated block: what FSDP gathers whole on each device
    splits: tuple[SplitFigures, ...] = ()  # inference sized with usable=: device_map="auto" over job.gpus, then more
    activations_per_sequence: int = 0  # training: how a step's activations grow per sequence (sized at batch, batch + 1)


def check_job(job: Job) -> Job:
    """Return ``job`` if its numbers make sense; OomMagicError with the fix otherwise."""
    for name in ("context", "batch", "gpus", "lora_r"):
        value = getattr(job, name)
        if type(value) is not int or value < 1:
            raise OomMagicError(f"{name} must be a whole number of at least 1, not {value!r}")
    if job.prompt is not None and (type(job.prompt) is not int or job.prompt < 1):
        raise OomMagicError(f"prompt must be a whole number of at least 1 (or left out), not {job.prompt!r}")
    if job.train is not None and job.train not in TRAIN_KINDS:
        raise OomMagicError(f"unknown training kind {job.train!r}: use one of {', '.join(TRAIN_KINDS)}")
    _check_train_step(job)
    return job


def _check_train_step(job: Job) -> None:
    """How a fine-tune's step runs: gradient checkpointing and mixed precision apply to training only."""
    if type(job.gradient_checkpointing) is not bool:
        raise OomMagicError(f"gradient_checkpointing must be True or False, not {job.gradient_checkpointing!r}")
    if job.mixed_precision is not None and job.mixed_precision not in MIXED_PRECISIONS:
        raise OomMagicError(f"unknown mixed precision {job.mixed_precision!r}: use bf16 or fp16 (or leave it out)")
    for name, given in (("gradient_checkpointing", job.gradient_checkpointing),
                        ("mixed_precision", job.mixed_precision is not None)):
        if given and job.train is None:
            raise OomMagicError(f"{name} applies to a fine-tune: also give train (adamw, sgd, adamw8bit, lora or "
                                f"qlora), or leave {name} out")
    if job.mixed_precision is not None and job.train == "qlora":
        raise OomMagicError("qlora computes in its 4-bit base's compute dtype (dtype=, default bfloat16): "
                            "leave out mixed_precision")


def size_job(path_or_id: str | os.PathLike[str], job: Job, *, dtype: str | None = None,
             quantization: str | None = None, usable: int | None = None) -> JobSizing:
    """The parts ``job`` holds when the checkpoint is loaded as ``dtype`` (default: its config's dtype).

    ``quantization`` ('int8', 'nf4', 'fp4': bitsandbytes, inference only) sizes the weights as
    transformers quantizes them; the weights it leaves alone and the KV cache are in the compute
    dtype: ``dtype``, else the config's, else bfloat16.

    ``usable`` (bytes on one GPU) sizes inference over ``job.gpus`` GPUs as ``device_map="auto"``
    splits it, and when that does not fit (on one GPU, too), the splits over more GPUs up to the
    first that fits (``JobSizing.splits``).

    Needs the config.json beside the weights (the cache and the layers come from it). Raises
    OomMagicError with one line for a bad job, a checkpoint without a config, or a model that
    transformers (or peft, for LoRA) cannot build.
    """
    check_job(job)
    if dtype is not None:
        dtype = canonical_dtype(dtype)
        if dtype not in _FLOATS:
            raise OomMagicError(f"unknown dtype {dtype!r} for a job: use one of {', '.join(_FLOATS)} "
                                "(--train qlora for a 4-bit base)")
    if job.mixed_precision is not None:
        if dtype not in (None, "float32"):
            raise OomMagicError(f"mixed precision ({job.mixed_precision}) holds the weights in float32 and computes "
                                f"in {job.mixed_precision} under autocast: leave out dtype {dtype}")
        dtype = "float32"
    qlora = job.train == "qlora"
    if quantization is not None:
        quantization = canonical_dtype(quantization)
        if quantization not in QUANTIZED:
            raise OomMagicError(f"unknown quantization {quantization!r} for a job: use int8, nf4 or fp4")
        if job.train:
            raise OomMagicError("a quantized fine-tune is sized as --train qlora (a 4-bit base with LoRA adapters); "
                                "leave out --quantization")
    with _config_file(path_or_id) as config:
        estimate = estimate_checkpoint(path_or_id, "nf4" if qlora else None if quantization else (dtype or "auto"))
        compute = dtype or (estimate.declared_dtype if estimate.declared_dtype in _FLOATS
                            else ("bfloat16" if qlora or quantization else "float32"))
        if quantization is not None:  # the weights bitsandbytes leaves alone stay in the compute dtype
            estimate = replace(estimate, bytes=estimate.bytes_for(quantization, unquantized_dtype=compute))
        lora = job.train in ("lora", "qlora")
        split = _split_request(job, quantization, usable, estimate.bytes)
        step = TrainStep(job.gradient_checkpointing, job.mixed_precision) if job.train else None
        probe = probe_job(config, compute, batch=job.batch, prompt=job.prompt_tokens, context=job.context,
                          lora_r=job.lora_r if lora else 0, lora_targets=job.lora_targets if lora else (),
                          split=split, most_gpus=MOST_GPUS, train_step=step)
    return _sizing(estimate.bytes, probe, job)


@contextmanager
def _config_file(path_or_id: str | os.PathLike[str]) -> Iterator[Path]:
    """The checkpoint's config.json: beside its weights, or for a hub model not in the cache, the one
    the hub reader fetched (with the headers, never the weights), written to a temporary folder."""
    remote = uncached_hub_id(path_or_id)
    if remote is None:
        found = find_checkpoint_files(resolve_checkpoint(path_or_id))
        if found.config is None:
            raise OomMagicError(f"{found.path}: no config.json beside the weights; sizing a job (its KV cache, "
                                "its layers) needs the model's config")
        yield found.config
        return
    from ..checkpoints.hub import read_hub_checkpoint

    read = read_hub_checkpoint(remote)
    if read.config is None:
        raise OomMagicError(f"{remote}: the hub has no config.json for it; sizing a job (its KV cache, its layers) "
                            "needs the model's config")
    with tempfile.TemporaryDirectory(prefix="oom-magic-config-") as folder:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps(read.config))
        yield config


def _sizing(weights: int, probe: JobProbe, job: Job) -> JobSizing:
    kv = 0 if job.train else max(probe.kv_after_prompt, probe.kv_at_context)
    gradients = optimizer = adapters = step = 0
    if job.train:
        trained = probe.adapters if job.train in ("lora", "qlora") else probe.parameters
        adapters = sum(row[3] for row in probe.adapters)
        gradients = gradient_bytes(trained)
        optimizer = optimizer_bytes(trained, _OPTIMIZER[job.train])
        step = optimizer_step_bytes(trained, _OPTIMIZER[job.train])  # on a GPU: AdamW's foreach step
    activations = probe.train_activations if job.train else probe.activations
    per_device: tuple[int, ...] = ()
    if job.gpus > 1 and job.train:
        # each device runs the step on its own batch of job.batch sequences: its activations are not sharded
        sharded = weights + gradients + optimizer + adapters + kv
        # ... and steps its own shard of the state: 1/N of the step's temporary
        per_device = (math.ceil(sharded / job.gpus) + probe.largest_layer
                      + max(activations or 0, math.ceil(step / job.gpus)),) * job.gpus
    split = None
    if job.gpus > 1 and not job.train:  # device_map="auto"'s split, where the probe was asked for it
        figures = next((f for f in probe.splits if f.gpus == job.gpus), None)
        split = None if figures is None else device_split(figures, activations)
        per_device = () if split is None else tuple(share.total for share in split.shares)
    parts = JobParts(weights=weights, kv_cache=kv, activations=activations, gradients=gradients, optimizer=optimizer,
                     adapters=adapters, per_device=per_device, split=split,
                     weight_casts=probe.weight_casts if job.train else 0, optimizer_step=step)
    return JobSizing(parts, 0.0 if job.train else probe.kv_growth_per_token, kv // job.batch, probe.largest_layer,
                     probe.splits, probe.train_per_sequence if job.train else 0)


def _split_request(job: Job, quantization: str | None, usable: int | None, weights: int) -> tuple[int, int, int] | None:
    """What the probe is asked to split over GPUs: inference with a GPU's usable bytes (GPUs, usable, weights)."""
    if usable is None or job.train:
        return None
    if quantization is not None:
        if job.gpus > 1:  # the meta model is not quantized, so transformers' map of it would not be the real one
            raise OomMagicError("a quantized load is not sized over several GPUs yet: check it on one GPU "
                                "(--target without Nx), or the unquantized load over several")
        return None
    return job.gpus, usable, weights
