"""Inference over several GPUs as ``from_pretrained(device_map="auto")`` splits it: each GPU's share.

The probe's child (``sizing.probe``, its device_split section) asks transformers where
``device_map="auto"`` with each GPU's usable memory as ``max_memory`` puts every module; this module
turns those figures into what each GPU holds (``records.job.DeviceSplit``) and judges them per GPU:
a split fits when nothing spills to the cpu or disk and the busiest GPU holds its weights, the cache
of its layers and the prompt's forward. The forward runs through the GPUs in turn and peaks inside a
layer, where the hidden states it carries are on that GPU too, so every GPU the map puts modules on
is counted with the whole transient (an upper bound on a GPU that holds only the embeddings or the
head, so that a job that would not fit does not pass). The cache grows on each GPU in proportion to the
cache layers it holds, so the largest context and batch are the smallest over the GPUs.
"""
from __future__ import annotations

import math

from ..records.job import DeviceSplit, GpuShare, Job
from .probe import SplitFigures

MOST_GPUS = 64  # the most GPUs a job is split over or said to need

__all__ = ["MOST_GPUS", "device_split", "split_fits", "split_gpus_needed", "split_largest_batch", "split_largest_context"]


def device_split(figures: SplitFigures, activations: int | None) -> DeviceSplit:
    """What each GPU holds under ``figures``' map: weights, its layers' cache, the prompt's forward where it has modules."""
    shares = tuple(GpuShare(weights, kv, None if activations is None else activations if weights else 0, layers)
                   for weights, kv, layers in zip(figures.weights, figures.kv_cache, figures.layers, strict=True))
    return DeviceSplit(shares, figures.spilled, figures.spilled_modules)


def split_fits(split: DeviceSplit, usable: int) -> bool:
    """Whether the map keeps every weight on the GPUs and each GPU's share within ``usable``."""
    return not split.spilled and all(share.total <= usable for share in split.shares)


def _room(share: GpuShare, job: Job, usable: int) -> int:
    # what this GPU has for its cache; a prompt that is the whole context shrinks with it, so its
    # forward is left out there (as on one GPU), kept when the prompt is fixed
    return usable - share.weights - ((share.activations or 0) if job.prompt is not None else 0)


def split_largest_context(split: DeviceSplit, figures: SplitFigures, job: Job, usable: int) -> int | None:
    """The longest context at ``job.batch`` every GPU's cache has room for (0 when weights spill); None: no cache grows."""
    if split.spilled:
        return 0
    bounds = [job.context + math.floor((_room(share, job, usable) - share.kv_cache) / growth)
              for share, growth in zip(split.shares, figures.kv_growth_per_token, strict=True) if growth > 0]
    return max(min(bounds), 0) if bounds else None


def split_largest_batch(split: DeviceSplit, job: Job, usable: int) -> int | None:
    """The largest batch at ``job.context`` every GPU's cache has room for (0 when weights spill); None: no cache."""
    if split.spilled:
        return 0
    # every cache tensor has a row per sequence, so each GPU's cache divides evenly by the batch
    bounds = [_room(share, job, usable) // (share.kv_cache // job.batch)
              for share in split.shares if share.kv_cache // job.batch]
    return max(min(bounds), 0) if bounds else None


def split_gpus_needed(splits: tuple[SplitFigures, ...], activations: int | None, job: Job, usable: int) -> int | None:
    """The fewest GPUs, more than ``job.gpus``, whose ``device_map="auto"`` split fits; None when none the probe tried does."""
    for figures in splits:
        if figures.gpus > job.gpus and split_fits(device_split(figures, activations), usable):
            return figures.gpus
    return None
