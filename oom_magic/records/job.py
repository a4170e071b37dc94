"""What a model is loaded to do (the job) and what that job holds on the device, part by part.

Made by ``sizing.parts`` from a checkpoint's sizes and the job's probe; held by the fit check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .shown import Shown

__all__ = ["TRAIN_KINDS", "DeviceSplit", "GpuShare", "Job", "JobFit", "JobParts", "TrainKind"]

TrainKind = Literal["adamw", "sgd", "adamw8bit", "lora", "qlora"]
TRAIN_KINDS: tuple[TrainKind, ...] = ("adamw", "sgd", "adamw8bit", "lora", "qlora")


@dataclass(frozen=True)
class Job:
    """Inference at a context length, or a fine-tune: what the model is loaded to do."""

    context: int                   # tokens the cache holds at its largest (prompt + generated)
    batch: int = 1
    prompt: int | None = None      # tokens arriving in one forward; None: the whole context (the worst case)
    train: TrainKind | None = None  # None: inference
    lora_r: int = 16               # the LoRA rank, for "lora" / "qlora"
    lora_targets: tuple[str, ...] = ()  # LoraConfig.target_modules; empty: peft's default for the model
    gpus: int = 1                  # devices the job is split over (device_map="auto" / FSDP)
    gradient_checkpointing: bool = False  # activations recomputed per layer in the backward (train only)
    mixed_precision: str | None = None  # "bf16"/"fp16": float32 weights, autocast compute (train only)

    @property
    def prompt_tokens(self) -> int:
        """The tokens of the first forward: the prompt, or the whole context when none was given."""
        return self.context if self.prompt is None else min(self.prompt, self.context)


@dataclass(frozen=True)
class GpuShare:
    """What one GPU holds of an inference job when ``device_map="auto"`` splits the model over several."""

    weights: int               # the parameters and buffers the map puts on it
    kv_cache: int              # the cache of the decoder layers it holds, at its peak
    activations: int | None    # the prompt's forward passing through its modules (0 on a GPU the map leaves empty)
    layers: tuple[int, ...]    # the decoder layers it holds (cache layer i lives with decoder layer i)

    @property
    def total(self) -> int:
        """What this GPU needs (activations counted as 0 where unknown)."""
        return self.weights + self.kv_cache + (self.activations or 0)


@dataclass(frozen=True)
class DeviceSplit:
    """An inference job over several GPUs, split as ``from_pretrained(device_map="auto")`` splits it."""

    shares: tuple[GpuShare, ...]       # GPU 0, 1, ...
    spilled: int = 0                   # bytes of weights the map puts on the cpu or disk (the job does not fit)
    spilled_modules: tuple[str, ...] = ()  # "module -> cpu|disk", in the map's order


@dataclass(frozen=True)
class JobParts(Shown):
    """The bytes a job holds on its devices, by part (0 where the part is not in the job)."""

    weights: int
    kv_cache: int      # at its peak: after the prompt, or at the whole context, whichever is larger
    activations: int | None  # the transient peak of one forward, or of a training step (probe.TrainStep); None: not sized
    gradients: int
    optimizer: int     # optimizer state on the device (AdamW's step counters live on the host)
    adapters: int      # LoRA parameters
    per_device: tuple[int, ...] = ()  # each device's share when split over several (empty: one device)
    split: DeviceSplit | None = None  # inference over several GPUs: what device_map="auto" puts on each
    weight_casts: int = 0  # autocast's low-precision weight copies (mixed precision): in activations while live at the peak
    optimizer_step: int = 0  # what the optimizer's step allocates for a moment (foreach AdamW's sqrt of its state)

    @property
    def held(self) -> int:
        """What the job holds throughout: every part but the two transients (activations, the optimizer's step)."""
        return self.weights + self.kv_cache + self.gradients + self.optimizer + self.adapters

    @property
    def total(self) -> int:
        """The job's peak: what it holds plus the larger of its two transients, which never meet (the
        forward/backward's activations are freed before the optimizer's step); unknown activations count 0."""
        return self.held + max(self.activations or 0, self.optimizer_step)


@dataclass(frozen=True)
class JobFit(Shown):
    """Whether a job fits the GPUs it is checked against, and how far it could go there."""

    checkpoint: str
    job: Job
    parts: JobParts
    target: str                  # the GPU as named ("A10G"); several: job.gpus of them
    usable: int                  # what PyTorch can hold on one of them
    fits: bool
    largest_context: int | None  # at job.batch; None: not bounded by the cache (a fixed state) or training
    largest_batch: int | None    # at job.context; None where not sized (training: activations not sized)
    gpus_needed: int | None      # of the target GPU, when more than job.gpus; None when it fits or > 64
    gpus_tried: int = 0          # inference: the most GPUs a device_map="auto" split was tried over (0: none)

    @property
    def needed(self) -> int:
        """The bytes the busiest device needs."""
        return max(self.parts.per_device) if self.parts.per_device else self.parts.total
