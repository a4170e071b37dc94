"""Text and JSON of a job's fit check: the verdict, a table of parts, and how far the job could go."""
from __future__ import annotations

from typing import Any

from ..records.job import Job, JobFit, JobParts
from ..records.shown import renders
from .units import format_bytes

__all__ = ["GPU_ONLY_LINE", "job_fit_dict", "job_fit_text", "job_label", "job_sum", "parts_dict"]

PART_NAMES = ("weights", "kv_cache", "activations", "gradients", "optimizer", "adapters")
_LABELS = {"weights": "weights", "kv_cache": "KV cache", "activations": "activations", "gradients": "gradients",
           "optimizer": "optimizer", "adapters": "adapters"}
GPU_ONLY_LINE = ("Not counted (only a GPU adds them): the CUDA context, cuBLAS/cuDNN handles and kernel "
                 "workspaces, and the caching allocator's rounding.")


def parts_dict(parts: JobParts) -> dict[str, int | None]:
    """The parts as int bytes under their JSON names (0 where not part of the job, None where not sized)."""
    return {name: getattr(parts, name) for name in PART_NAMES}


def job_label(job: Job) -> str:
    """'inference at context 4,096, batch 1' / 'fine-tune (lora, r=8) at context 512, batch 4'."""
    what = f"fine-tune ({job.train}" + (f", r={job.lora_r})" if job.train in ("lora", "qlora") else ")") \
        if job.train else "inference"
    prompt = "" if job.prompt is None or job.train else f", prompt {job.prompt:,}"
    return f"{what} at context {job.context:,}{prompt}, batch {job.batch}"


def job_sum(fit: JobFit) -> str:
    """The job and its parts added up: 'inference at context 9, batch 1: weights 412 KiB + KV cache 4.5 KiB = ...'."""
    parts = [f"{_LABELS[name]} {format_bytes(value)}" for name in PART_NAMES if (value := getattr(fit.parts, name))]
    unsized = " (activations not sized)" if fit.parts.activations is None else ""
    return f"{job_label(fit.job)}: {' + '.join(parts)} = {format_bytes(fit.parts.total)}{unsized}"


def _job_line(fit: JobFit) -> str:
    job = fit.job
    gpus = f"{job.gpus}x{fit.target}" if job.gpus > 1 else fit.target
    return f"{job_label(job)} on {gpus} ({format_bytes(fit.usable)} usable each)"


def job_fit_text(fit: JobFit) -> str:
    """The verdict, the parts table, the largest context and batch, and what only a GPU adds."""
    spare = fit.usable * (1 if fit.parts.per_device else fit.job.gpus) - fit.needed
    verdict = f"fits, {format_bytes(spare)} to spare" if fit.fits else f"will not fit: {format_bytes(-spare)} short"
    lines = [f"{fit.checkpoint}: {_job_line(fit)}", f"  {verdict}"]
    for name in PART_NAMES:
        value = getattr(fit.parts, name)
        shown = "not sized" if value is None else format_bytes(value)
        lines.append(f"    {_LABELS[name]:<12}{shown:>12}")
    lines.append(f"    {'total':<12}{format_bytes(fit.parts.total):>12}")
    if fit.parts.per_device:
        each = ", ".join(format_bytes(b) for b in fit.parts.per_device)
        lines.append(f"  per GPU (FSDP / ZeRO-3: 1/{fit.job.gpus} of everything plus the largest layer gathered): {each}")
    if fit.largest_context is not None:
        held = "the weights and the cache alone" if fit.job.prompt is None else \
            f"with the {fit.job.prompt:,}-token prompt's forward"
        lines.append(f"  largest context at batch {fit.job.batch}: {fit.largest_context:,} tokens ({held})")
    if fit.largest_batch is not None:
        lines.append(f"  largest batch at context {fit.job.context:,}: {fit.largest_batch}")
    if fit.gpus_needed is not None:
        lines.append(f"  needs {fit.gpus_needed}x{fit.target}")
    if fit.parts.activations is None:
        lines.append("  activations (the transient peak of a forward/backward) are not sized for this job")
    else:
        lines.append("  activations: the prompt's forward as eager attention holds it (batch x heads x prompt² "
                     "scores); an upper bound where sdpa/flash kernels run")
    lines.append(f"  {GPU_ONLY_LINE}")
    return "\n".join(lines)


def job_fit_dict(fit: JobFit) -> dict[str, Any]:
    """Every figure of a job's fit check, int bytes, for ``--json``."""
    job = fit.job
    return {"checkpoint": fit.checkpoint, "fits": fit.fits, "checks": [{
        "target": fit.target, "gpus": job.gpus, "usable": fit.usable, "needed": fit.needed, "fits": fit.fits,
        "job": {"context": job.context, "prompt": job.prompt, "batch": job.batch, "train": job.train,
                "lora_r": job.lora_r if job.train in ("lora", "qlora") else None},
        "parts": parts_dict(fit.parts), "per_device": list(fit.parts.per_device),
        "largest_context": fit.largest_context, "largest_batch": fit.largest_batch, "gpus_needed": fit.gpus_needed,
    }]}


renders(JobFit, job_fit_text)
renders(JobParts, lambda parts: ", ".join(f"{_LABELS[n]} {format_bytes(v)}" for n, v in parts_dict(parts).items()))
