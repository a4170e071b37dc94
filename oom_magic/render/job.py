"""Text and JSON of a job's fit check: the verdict, a table of parts, and how far the job could go."""
from __future__ import annotations

from typing import Any

from ..records.job import DeviceSplit, Job, JobFit, JobParts
from ..records.shown import renders
from .units import format_bytes

__all__ = ["GPU_ONLY_LINE", "job_fit_dict", "job_fit_text", "job_label", "job_sum", "parts_dict"]

PART_NAMES = ("weights", "kv_cache", "activations", "gradients", "optimizer", "adapters", "optimizer_step")
_LABELS = {"weights": "weights", "kv_cache": "KV cache", "activations": "activations", "gradients": "gradients",
           "optimizer": "optimizer", "adapters": "adapters", "optimizer_step": "optimizer step"}
_TRANSIENTS = ("activations", "optimizer_step")  # a job's two moments above what it holds
GPU_ONLY_LINE = ("Not counted (only a GPU adds them): the CUDA context, cuBLAS/cuDNN handles and kernel "
                 "workspaces, and the caching allocator's rounding.")


def parts_dict(parts: JobParts) -> dict[str, int | None]:
    """The parts as int bytes under their JSON names (0 where not part of the job, None where not sized)."""
    return {name: getattr(parts, name) for name in PART_NAMES}


def job_label(job: Job) -> str:
    """'inference at context 4,096, batch 1' / 'fine-tune (lora, r=8, gradient checkpointing) at context 512, batch 4'."""
    how = [f"r={job.lora_r}"] if job.train in ("lora", "qlora") else []
    how += [f"{job.mixed_precision} mixed precision"] if job.mixed_precision else []
    how += ["gradient checkpointing"] if job.gradient_checkpointing else []
    what = f"fine-tune ({', '.join([job.train, *how])})" if job.train else "inference"
    prompt = "" if job.prompt is None or job.train else f", prompt {job.prompt:,}"
    return f"{what} at context {job.context:,}{prompt}, batch {job.batch}"


def job_sum(fit: JobFit) -> str:
    """The job and its parts added up: 'inference at context 9, batch 1: weights 412 KiB + KV cache 4.5 KiB = ...'."""
    def term(name: str) -> str | None:
        value = getattr(fit.parts, name)
        return f"{_LABELS[name]} {format_bytes(value)}" if value else None

    both = bool(fit.parts.activations and fit.parts.optimizer_step)  # they never meet: the peak holds the larger
    parts = [t for name in PART_NAMES if not (both and name in _TRANSIENTS) and (t := term(name))]
    if both:
        parts.append(f"the larger of ({term('activations')}, {term('optimizer_step')})")
    unsized = " (activations not sized)" if fit.parts.activations is None else ""
    return f"{job_label(fit.job)}: {' + '.join(parts)} = {format_bytes(fit.parts.total)}{unsized}"


def _job_line(fit: JobFit) -> str:
    job = fit.job
    gpus = f"{job.gpus}x{fit.target}" if job.gpus > 1 else fit.target
    return f"{job_label(job)} on {gpus} ({format_bytes(fit.usable)} usable each)"


def _step_line(fit: JobFit) -> str:
    """What a fine-tune's activations are: one step, how it ran, and what they hold."""
    job = fit.job
    line = (f"  activations: one training step of {job.batch} x {job.context:,} tokens, gradient checkpointing "
            f"{'on' if job.gradient_checkpointing else 'off'}: its forward and backward's peak beyond the gradients "
            "(with the loss's float32 logits), eager attention (sdpa/flash hold less)")
    if job.gpus > 1:
        line += f"; each GPU runs its own batch of {job.batch}"
    if job.mixed_precision:
        line += (f"; autocast's {job.mixed_precision} copies of the weights it casts "
                 f"({format_bytes(fit.parts.weight_casts)}, held until the backward has used them) are counted "
                 "there as far as they are live at the peak; weights, gradients and AdamW state float32")
    return line


def job_fit_text(fit: JobFit) -> str:
    """The verdict, the parts table, the largest context and batch, and what only a GPU adds."""
    spare = fit.usable - fit.needed  # on the busiest GPU
    verdict = f"fits, {format_bytes(spare)} to spare" if fit.fits else f"will not fit: {format_bytes(-spare)} short"
    split = fit.parts.split
    if split is not None and split.spilled:
        verdict = (f"will not fit: device_map=\"auto\" puts {format_bytes(split.spilled)} of weights off the GPUs "
                   f"({', '.join(split.spilled_modules)})")
    lines = [f"{fit.checkpoint}: {_job_line(fit)}", f"  {verdict}"]
    for name in PART_NAMES if fit.job.train else PART_NAMES[:-1]:
        value = getattr(fit.parts, name)
        shown = "not sized" if value is None else format_bytes(value)
        lines.append(f"    {_LABELS[name]:<15}{shown:>12}")
    lines.append(f"    {'total':<15}{format_bytes(fit.parts.total):>12}"
                 + ("  (the activations and the optimizer step never meet: the peak holds the larger)"
                    if fit.parts.optimizer_step and fit.parts.activations else ""))
    if split is not None:
        lines += _split_lines(split)
    elif fit.parts.per_device:
        each = ", ".join(format_bytes(b) for b in fit.parts.per_device)
        step = " and its own step's activations" if fit.parts.activations else ""
        lines.append(f"  per GPU (FSDP / ZeRO-3: 1/{fit.job.gpus} of the rest plus the largest layer gathered{step}): {each}")
    if fit.largest_context is not None:
        held = "the weights and the cache alone" if fit.job.prompt is None else \
            f"with the {fit.job.prompt:,}-token prompt's forward"
        lines.append(f"  largest context at batch {fit.job.batch}: {fit.largest_context:,} tokens ({held})")
    if fit.largest_batch is not None:
        how = f" (the step sized at batch {fit.job.batch} and {fit.job.batch + 1}, grown linearly)" if fit.job.train else ""
        lines.append(f"  largest batch at context {fit.job.context:,}: {fit.largest_batch}{how}")
    if fit.gpus_needed is not None:
        lines.append(f"  needs {fit.gpus_needed}x{fit.target}")
    elif not fit.fits and fit.gpus_tried > fit.job.gpus:
        lines.append(f"  no device_map=\"auto\" split over up to {fit.gpus_tried}x{fit.target} fits (each GPU holds "
                     "whole decoder layers, their cache and the prompt's forward through them)")
    if fit.parts.activations is None:
        lines.append("  activations (the transient peak of a forward/backward) are not sized for this job")
    elif fit.job.train:
        lines.append(_step_line(fit))
    if fit.parts.optimizer_step:
        lines.append(f"  optimizer step: AdamW's foreach step (a GPU's default) takes the square root of its state, a "
                     f"tensor per parameter ({format_bytes(fit.parts.optimizer_step)}), for a moment after the backward")
    else:
        lines.append("  activations: the prompt's forward with the attention transformers picks for this model "
                     "(sdpa: a fused kernel, no batch x heads x prompt² scores; eager where it is the default)")
    lines.append(f"  {GPU_ONLY_LINE}")
    return "\n".join(lines)


def _layers(layers: tuple[int, ...]) -> str:
    if not layers:
        return "no layers"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ",".join(str(i) for i in layers)


def _split_lines(split: DeviceSplit) -> list[str]:
    """What device_map="auto" puts on each GPU: its layers, weights, their cache, the prompt's forward."""
    lines = ['  per GPU (device_map="auto": the modules it places there, the KV cache of its decoder layers, '
             "the prompt's forward through them):"]
    for index, share in enumerate(split.shares):
        forward = "not sized" if share.activations is None else format_bytes(share.activations)
        lines.append(f"    GPU {index}: {_layers(share.layers)}: weights {format_bytes(share.weights)}, "
                     f"KV cache {format_bytes(share.kv_cache)}, prompt's forward {forward} = {format_bytes(share.total)}")
    return lines


def _split_dict(split: DeviceSplit | None) -> dict[str, Any] | None:
    if split is None:
        return None
    return {"shares": [{"weights": s.weights, "kv_cache": s.kv_cache, "activations": s.activations,
                        "layers": list(s.layers), "total": s.total} for s in split.shares],
            "spilled": split.spilled, "spilled_modules": list(split.spilled_modules)}


def job_fit_dict(fit: JobFit) -> dict[str, Any]:
    """Every figure of a job's fit check, int bytes, for ``--json``."""
    job = fit.job
    return {"checkpoint": fit.checkpoint, "fits": fit.fits, "checks": [{
        "target": fit.target, "gpus": job.gpus, "usable": fit.usable, "needed": fit.needed, "fits": fit.fits,
        "job": {"context": job.context, "prompt": job.prompt, "batch": job.batch, "train": job.train,
                "lora_r": job.lora_r if job.train in ("lora", "qlora") else None,
                "gradient_checkpointing": job.gradient_checkpointing, "mixed_precision": job.mixed_precision},
        "parts": parts_dict(fit.parts), "per_device": list(fit.parts.per_device), "split": _split_dict(fit.parts.split),
        "weight_casts": fit.parts.weight_casts,
        "largest_context": fit.largest_context, "largest_batch": fit.largest_batch, "gpus_needed": fit.gpus_needed,
    }]}


renders(JobFit, job_fit_text)
renders(JobParts, lambda parts: ", ".join(f"{_LABELS[n]} {format_bytes(v)}" for n, v in parts_dict(parts).items()))
