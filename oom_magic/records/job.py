"""What a model is loaded to do (the job) and what that job holds on the device, part by part.

Made by ``sizing.parts`` from a checkpoint's sizes and the job's probe; held by the fit check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .shown import Shown

__all__ = ["TRAIN_KINDS", "Job", "JobFit", "JobParts", "TrainKind"]

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
class JobParts(Shown):
    """The bytes a job holds on its devices, by part (0 where the part is not in the job)."""

    weights: int
    kv_cache: int      # at its peak: after the prompt, or at the whole context, whichever is larger
    activations: int | None  # the transient peak of one forward (and backward); None where not sized
    gradients: int
    optimizer: int     # optimizer state on the device (AdamW's step counters live on the host)
    adapters: int      # LoRA parameters
    per_device: tuple[int, ...] = ()  # each device's share when split over several (empty: one device)

    @property
    def total(self) -> int:
        """Every part added up (activations counted as 0 where unknown)."""
        return (self.weights + self.kv_cache + (self.activations or 0) + self.gradients + self.optimizer
                + self.adapters)


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
    largest_batch: int | None    # at job.context; None where not sized (training: activations unknown)
    gpus_needed: int | None      # of the target GPU, when more than job.gpus; None when it fits or > 64

    @property
    def needed(self) -> int:
        """The bytes the busiest device needs."""
        return max(self.parts.per_device) if self.parts.per_device else self.parts.total
