"""The fit check on its own: will a checkpoint (or a load cell) fit a device or a target GPU.

``fit_check`` is ``%%guardload``'s preflight for scripts and pipelines: a checkpoint path (local
file or folder, sharded index, ``.bin``/``.pt``, or a hub id: from the local cache, else its
config and safetensors headers read from the hub) is turned into the load request it stands for
(``checkpoint_request``) and checked by the same pipeline as a cell's loads
(``preflight.check_requests``); code is checked as written. Headers only: no weight is loaded or
downloaded, nothing is run, and no CUDA context is created.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from ..common.errors import OomMagicError
from ..common.sizes import parse_headroom
from ..records.job import Job, JobFit
from ..records.request import LoadRequest
from ..records.target import Target
from ..sizing.parts import check_job
from .job_fit import job_fit
from .preflight import Preflight, check_requests, preflight_check
from .targets import parse_target

__all__ = ["QUANTIZATIONS", "DTYPES", "checkpoint_request", "fit_check"]

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "nf4", "fp4")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
_TORCH_FILES = (".bin", ".pt", ".pth", ".ckpt")
_LOAD_CALLS = ("from_pretrained(", "torch.load(", "load_file(", "pipeline(", "LLM(")


def _is_code(what: object) -> bool:
    """A string of code (a load call, or code that holds none), not a path or hub id."""
    # A path or hub id holds no "=", "(" or line break; code without a load call is checked as code,
    # which says in one line that it holds none.
    if not isinstance(what, str) or not any(mark in what for mark in (*_LOAD_CALLS, "=", "(", "\n")):
        return False
    try:
        return not Path(what).expanduser().exists()
    except (OSError, ValueError):
        return True


def _dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    text = str(dtype).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise OomMagicError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return text


def _quantization(quantization: str | None) -> str | None:
    if quantization is None:
        return None
    text = str(quantization).strip().lower()
    if text not in QUANTIZATIONS:
        raise OomMagicError(f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)} "
                            "(bitsandbytes' 8-bit and 4-bit loads)")
    return text


def checkpoint_request(path: str | os.PathLike[str], *, device: str, dtype: str | None = None,
                       quantization: str | None = None, target: Target | None = None,
                       runs_here: bool = True, revision: str | None = None) -> LoadRequest:
    """The load request a checkpoint named to the command or ``fit_check()`` stands for.

    A folder, shard index or hub id loads with ``from_pretrained``; a single ``.bin``/``.pt`` file
    with ``torch.load``, a ``.safetensors`` file with ``load_file`` (a dtype is a cast after the load).
    """
    from ..checkpoints.files import resolve_checkpoint, uncached_hub_id

    # A hub id not in the cache is read from the hub by the estimate; any other missing path fails here.
    local = None if uncached_hub_id(path) else resolve_checkpoint(path)
    text = os.fspath(path)
    dtype, quantization = _dtype(dtype), _quantization(quantization)
    if local is not None and local.is_file() and not local.name.endswith(".index.json"):
        if quantization is not None:
            raise OomMagicError(f"quantization applies to a model folder or hub id (from_pretrained), not the single "
                                f"file {local.name}: pass the folder that holds it")
        if local.suffix in _TORCH_FILES:  # loaded as the guard advises: onto the device, tensors only
            return LoadRequest("torch.load", text, origin="checkpoint", device=device, map_location_given=True,
                               weights_only=True, cast_to=dtype, target=target, runs_here=runs_here)
        return LoadRequest("load_file", text, origin="checkpoint", device=device, cast_to=dtype, target=target,
                           runs_here=runs_here)
    folder = str(local.parent) if local is not None and local.is_file() else text  # a shard index names its folder
    return LoadRequest("from_pretrained", folder, origin="checkpoint", dtype=dtype, quantization=quantization,
                       device=device, target=target, runs_here=runs_here, revision=revision)


def fit_check(path_or_cell_or_call: str | os.PathLike[str], *, device: str | None = None, target: Any = None,
              dtype: str | None = None, quantization: str | None = None, headroom: str | int | None = None,
              namespace: Mapping[str, Any] | None = None, revision: str | None = None,
              token: str | None = None, hub_timeout: float | None = None, context: int | None = None,
              batch: int = 1, prompt: int | None = None, train: str | None = None,
              lora_r: int = 16, gradient_checkpointing: bool = False,
              mixed_precision: str | None = None) -> Preflight | JobFit:
    """Check whether a checkpoint, or the loads in some code, fit a device or a target GPU; runs nothing.

    ``path_or_cell_or_call`` is a checkpoint (file, folder, shard index or cached hub id ``org/name``)
    or code holding ``from_pretrained`` / ``torch.load`` / ``load_file`` calls (names in it resolve
    against ``namespace``). ``device`` is where the weights go ("cuda", "cuda:1", "cpu", "auto" for
    ``device_map="auto"``; default: the current CUDA device, else cpu); ``target`` ("T4", "16GiB")
    checks against that GPU's usable memory instead of this machine's (and against this machine
    too when ``device`` is given). ``dtype`` and ``quantization`` ("int8", "nf4", "fp4") say how a
    checkpoint path is loaded. Returns the ``Preflight`` record ``%%guardload`` prints (``.fits``:
    True, False, or None when nothing could be sized); raises ``OomMagicError`` with the fix for a
    missing path, unknown target or dtype.

    ``context`` / ``train`` ("adamw", "sgd", "adamw8bit", "lora", "qlora") size the job instead of the
    load alone, against ``target`` ("A10G", "2xA10G"), and return a ``JobFit`` (see fit.job_fit).
    A fine-tune's step may run with ``gradient_checkpointing`` (transformers' own) and
    ``mixed_precision`` ("bf16"/"fp16": float32 weights, gradients and AdamW state, autocast compute).

    A hub id not in the local cache is sized from its config.json and safetensors headers read from
    the hub at ``revision`` (``token``: else HF_TOKEN or the saved login), within ``hub_timeout``
    seconds (default 10); a failure to read them is an ``OomMagicError`` of one line.
    """
    job: Job | None = None
    if context is not None or train is not None or gradient_checkpointing or mixed_precision is not None:
        job = Job(context=1 if context is None else context, batch=batch, prompt=prompt, train=train,  # type: ignore[arg-type]
                  lora_r=lora_r, gradient_checkpointing=gradient_checkpointing, mixed_precision=mixed_precision)
        check_job(job)  # a step's options without train= are named before the target is asked for
        if target is None:
            raise OomMagicError("sizing a job needs target= (a GPU such as 'A10G', '2xA10G' or '24GiB')")
    from ..checkpoints.hub import hub_options

    with hub_options(timeout=hub_timeout, token=token):
        if job is not None:
            return job_fit(path_or_cell_or_call, job, str(target), dtype=dtype, quantization=quantization)
        return _fit_check(path_or_cell_or_call, device=device, target=target, dtype=dtype,
                          quantization=quantization, headroom=headroom, namespace=namespace, revision=revision)


def _fit_check(path_or_cell_or_call: str | os.PathLike[str], *, device: str | None, target: Any, dtype: str | None,
               quantization: str | None, headroom: str | int | None, namespace: Mapping[str, Any] | None,
               revision: str | None) -> Preflight:
    if target is not None and device not in (None, "cuda", "auto") and not str(device).startswith("cuda"):
        raise OomMagicError(f"target {target!r} is a GPU: leave out device (or use cuda or auto), not {device!r}")
    if _is_code(path_or_cell_or_call):
        if dtype is not None or quantization is not None:
            raise OomMagicError("dtype and quantization apply to a checkpoint path; in code, write them in the call")
        return preflight_check(str(path_or_cell_or_call), namespace or {}, device=device, headroom=headroom,
                               target=target)
    parse_headroom(headroom, 0)  # a bad spelling fails before any file is read
    rehearsed = parse_target(target) if target is not None else None
    from ..checkpoints.files import uncached_hub_id

    remote = uncached_hub_id(path_or_cell_or_call)
    if remote is not None:  # read the hub first: a failure is the command's one line, not a preflight
        from ..checkpoints.hub import read_hub_checkpoint

        read_hub_checkpoint(remote, revision=revision)  # kept per (repo, revision) for the estimate
    runs_here = device is not None  # a target alone: the load runs there, not on this machine
    if device is None:
        from ..device.reading import default_device

        device = "cuda" if rehearsed is not None else default_device()
    request = checkpoint_request(path_or_cell_or_call, device=str(device), dtype=dtype, quantization=quantization,
                                 target=rehearsed, runs_here=runs_here, revision=revision)
    return check_requests((request,), device=None if device == "auto" else str(device), headroom=headroom)
