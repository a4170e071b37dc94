"""A load checked with the job it is for: the job's parts against the budget its weights were checked against.

``preflight.check_requests`` hands in each load's ``FitCheck``. When its request carries a job
(``LoadRequest.job``: read from the cell by ``cell_job``, or set by ``%%guardload``'s flags) and it is
a transformers load whose weights were sized, the job is sized (``sizing.parts.size_job``: the model's
config run on the meta device in a bounded child, never torch in this process) and checked against
the same budget: this machine's free memory after the CUDA context and headroom, or the ``--target``
GPU's usable memory after headroom. The check's ``peak_need`` then counts the job, so its verdict,
margin and ``--strict`` refusal are the job's. A job that cannot be sized leaves the weights' verdict
and says why in one line.
"""
from __future__ import annotations

from dataclasses import replace

from ..checkpoints.hub import hub_options
from ..common.errors import OomMagicError
from ..records.preflight import FitCheck
from ..sizing.parts import size_job
from .job_fit import sized_job_fit

__all__ = ["job_dtypes", "with_job"]

_FLOATS = ("float32", "float16", "bfloat16")
_QUANTIZED = ("int8", "nf4", "fp4")
_HF_LOADS = ("from_pretrained", "pipeline")


def job_dtypes(check: FitCheck, train: bool) -> tuple[str | None, str | None]:
    """(dtype, quantization) to size a job on this load: its float load dtype, or its bitsandbytes kind
    for inference (a fine-tune of a 4-bit load is QLoRA, which sizes its own base)."""
    dtype = check.dtype if check.dtype in _FLOATS else None
    quantization = check.dtype if check.dtype in _QUANTIZED and not train else None
    return dtype, quantization


def with_job(check: FitCheck) -> FitCheck:
    """The check with its request's job sized against its budget (unchanged when the request has no job)."""
    request, job = check.call, check.call.job
    if job is None:
        return check
    if request.kind not in _HF_LOADS or request.checkpoint is None:
        return replace(check, job_unsized="only a transformers load's job (from_pretrained, pipeline) is sized")
    budget = check.budget
    if check.verdict == "unknown" or budget is None or check.need is None:
        return check  # the weights were not checked: their reason is the check's
    if len(check.split) > 1:
        return replace(check, job_unsized="device_map spreads the model over several places; a job is checked on "
                                          "one device (size it with --target GPU)")
    quantized = request.quantization
    if job.train == "lora" and quantized in ("nf4", "fp4"):
        job = replace(job, train="qlora")  # LoRA on a 4-bit load is QLoRA: its base is sized as bitsandbytes holds it
    elif job.train in ("adamw", "sgd", "adamw8bit", "lora") and quantized is not None:
        return replace(check, job_unsized=f"a fine-tune ({job.train}) of a {quantized} load is not sized (--train qlora "
                                          "sizes LoRA on a 4-bit base)")
    dtype, quantization = job_dtypes(check, bool(job.train))
    try:
        with hub_options(token=request.token):  # an uncached hub model: its config, read as the weights' headers were
            sizing = size_job(request.checkpoint, job, dtype=dtype, quantization=quantization)
    except OomMagicError as exc:
        return replace(check, job_unsized=str(exc))
    where = check.target.name if check.target is not None else check.device
    fit = sized_job_fit(request.checkpoint, job, sizing, where, budget)
    checked = replace(check, job=fit)
    if check.verdict == "will-not-fit":  # the weights alone do not fit: their options stand
        return checked
    return replace(checked, verdict="fits" if (checked.peak_need or 0) <= budget else "will-not-fit")
