"""Rehearse a load for the GPU it will be deployed on: that GPU's usable memory, and the cap that imitates it.

``parse_target("T4")`` or ``parse_target("16GiB")`` gives a :class:`Target`: the card's total as
its driver reports it, and what a process's PyTorch allocator can actually hold there
(``usable``). The known GPUs live in ``oom_magic/data/gpus.json``, each figure with the public
source it was read from; the file also states what is assumed for the driver's reservation and
the CUDA context (``context_reserve`` = total - usable).

On a CUDA device larger than the target, ``memory_fraction_for`` computes the
``torch.cuda.set_per_process_memory_fraction`` value that gives a cell the target's usable
memory on top of what this process already holds, and ``capped`` applies it for a block and puts
the previous fraction back afterwards, also when the block fails or is interrupted. This module
never imports torch: ``capped`` is handed ``torch.cuda``.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any
from collections.abc import Callable, Iterator

from ..common.errors import OomMagicError
from ..common.sizes import parse_size
from ..records.target import Cap, Target

__all__ = ["Cap", "Target", "capped", "known_targets", "memory_fraction_for", "parse_target"]

_DATA_FILE = "gpus.json"
# Vendor words people and drivers put in front of a model name ("NVIDIA A100-SXM4-80GB").
_VENDOR_PREFIXES = ("nvidia", "geforce", "tesla", "amd", "instinct")


@dataclass(frozen=True)
class _Table:
    targets: tuple[Target, ...]
    by_key: dict[str, Target]
    cuda_context: int
    cuda_context_size: str
    default_driver_reserved: int
    default_driver_reserved_size: str


def _key(text: str) -> str:
    """Compare names ignoring case, spaces, hyphens, underscores and vendor words."""
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    changed = True
    while changed:
        changed = False
        for prefix in _VENDOR_PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key, changed = key[len(prefix):], True
    return key


def _size(entry: dict[str, Any], field: str, where: str) -> int:
    try:
        return parse_size(str(entry[field]))
    except (KeyError, OomMagicError) as exc:
        raise RuntimeError(f"{_DATA_FILE}: {where} has no readable {field!r} ({exc})") from None


def _entry_target(entry: dict[str, Any], cuda_context: int, default_driver: int, default_size: str,
                  context_size: str) -> Target:
    name = str(entry.get("name") or "").strip()
    if not name or not entry.get("total_source"):
        raise RuntimeError(f"{_DATA_FILE}: every GPU needs a name, a total and a total_source ({entry!r})")
    total = _size(entry, "total", name)
    parts = [f"total: {entry['total_source']}"]
    if entry.get("device_total") is not None:
        if not entry.get("device_total_source"):
            raise RuntimeError(f"{_DATA_FILE}: {name} has a device_total without device_total_source")
        device_total = _size(entry, "device_total", name)
        parts.append(f"CUDA-visible total: {entry['device_total_source']}")
    else:
        device_total = total - default_driver
        parts.append(f"driver reservation assumed {default_size} (no CUDA-reported total recorded)")
    parts.append(f"CUDA context assumed {context_size}")
    reserve = total - device_total + cuda_context
    if device_total > total or reserve >= total:
        raise RuntimeError(f"{_DATA_FILE}: {name}'s figures are inconsistent (total {total}, device {device_total})")
    capability = None
    if entry.get("compute_capability") is not None:
        if not entry.get("compute_capability_source"):
            raise RuntimeError(f"{_DATA_FILE}: {name} has a compute_capability without compute_capability_source")
        major, _, minor = str(entry["compute_capability"]).partition(".")
        capability = (int(major), int(minor or 0))
        parts.append(f"compute capability {entry['compute_capability']}: {entry['compute_capability_source']}")
    return Target(name=name, total=total, usable=total - reserve, context_reserve=reserve, source="; ".join(parts),
                  compute_capability=capability)


@lru_cache(maxsize=1)
def _table() -> _Table:
    """The packaged GPU table, read once."""
    text = resources.files("oom_magic").joinpath("data").joinpath(_DATA_FILE).read_text(encoding="utf-8")
    data = json.loads(text)
    context_size = str(data["cuda_context"]["size"])
    default_size = str(data["default_driver_reserved"]["size"])
    cuda_context = parse_size(context_size)
    default_driver = parse_size(default_size)
    targets: list[Target] = []
    by_key: dict[str, Target] = {}
    for entry in data["gpus"]:
        target = _entry_target(entry, cuda_context, default_driver, default_size, context_size)
        targets.append(target)
        for spelling in [target.name, *entry.get("aliases", ())]:
            key = _key(str(spelling))
            if key in by_key and by_key[key] is not target:
                raise RuntimeError(f"{_DATA_FILE}: {spelling!r} names both {by_key[key].name} and {target.name}")
            by_key[key] = target
    return _Table(tuple(targets), by_key, cuda_context, context_size, default_driver, default_size)


def known_targets() -> tuple[Target, ...]:
    """Every GPU in the packaged table, in table order."""
    return _table().targets


def _names() -> str:
    return ", ".join(t.name for t in _table().targets)


def parse_target(text: str | Target) -> Target:
    """Read ``--target``: a known GPU name (any case, hyphens optional: "a100_80gb", "h100") or a size ("16GiB").

    A size is the card's total as nvidia-smi shows it; its usable memory subtracts the table's
    default driver reservation and the CUDA context. Anything else is an OomMagicError naming
    the known GPUs.
    """
    if isinstance(text, Target):
        return text
    raw = str(text).strip()
    table = _table()
    if not raw:
        raise OomMagicError(f"empty target: give a size such as 16GiB or one of {_names()}")
    key = _key(raw)
    if key in table.by_key:
        return table.by_key[key]
    if re.match(r"^[\d.]", raw):
        if re.fullmatch(r"\d+", raw):
            raise OomMagicError(f"target {raw!r} has no unit: write a size such as {raw}MiB or 16GiB, or a GPU name")
        return _size_target(raw, parse_size(raw), table)
    close = [t.name for t in table.targets if key and _key(t.name).startswith(key)]
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise OomMagicError(f"unknown target {raw!r}{hint}: give a size such as 16GiB or one of {_names()}")


def _size_target(raw: str, total: int, table: _Table) -> Target:
    reserve = table.default_driver_reserved + table.cuda_context
    name = re.sub(r"\s+", "", raw)
    if total <= reserve:
        raise OomMagicError(
            f"target {raw!r} is no more than what a GPU keeps for its driver and the CUDA context "
            f"({table.default_driver_reserved_size} + {table.cuda_context_size}): give the card's total, e.g. 16GiB"
        )
    source = (
        f"size given as the target (the card's total as nvidia-smi shows it); driver reservation "
        f"assumed {table.default_driver_reserved_size}; CUDA context assumed {table.cuda_context_size}"
    )
    return Target(name=name, total=total, usable=total - reserve, context_reserve=reserve, source=source)


def memory_fraction_for(target_usable: int, device_total: int, already_allocated: int = 0) -> float:
    """The ``set_per_process_memory_fraction`` value that leaves a cell ``target_usable`` bytes here.

    The fraction caps the allocator's *reserved* total for this process (every segment it has
    cudaMalloc'd, cache included) at ``fraction * device_total``, where ``device_total`` is CUDA's
    total for the device (``torch.cuda.get_device_properties(i).total_memory``, the figure the
    allocator multiplies by). What this process already holds counts against that cap, so the
    cap is ``already_allocated + target_usable``: pass ``torch.cuda.memory_allocated(i)`` (live
    tensors), not ``memory_reserved`` - cached blocks are reused by the cell, and counting them
    would give it more than the target has. The allocator truncates ``fraction * device_total``,
    so the cap comes out at the intended byte or one below, never above.

    1.0 means no cap is tighter than the device itself (the device is not larger than the target
    plus what is already held): rehearse with preflight only.
    """
    for label, value in (("target_usable", target_usable), ("device_total", device_total),
                         ("already_allocated", already_allocated)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OomMagicError(f"{label} must be a whole number of bytes >= 0, not {value!r}")
    if device_total == 0:
        raise OomMagicError("device_total is 0: read it from torch.cuda.get_device_properties(i).total_memory")
    limit = already_allocated + target_usable
    if limit >= device_total:
        return 1.0
    fraction = limit / device_total
    # Keep int(fraction * device_total) <= limit whatever the float rounding.
    while fraction > 0.0 and int(fraction * device_total) > limit:
        fraction = math.nextafter(fraction, 0.0)
    return fraction


def _current_fraction(torch_cuda: Any, device_index: int) -> float | None:
    """The fraction set now, where this torch can say (``get_per_process_memory_fraction``, torch 2.9+)."""
    getter = getattr(torch_cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    value = getter(device_index)
    return float(value)


def _add_note(exc: BaseException, note: str) -> None:
    adder = getattr(exc, "add_note", None)  # Python 3.11+
    if adder is not None:
        adder(note)


@contextmanager
def capped(torch_cuda: Any, device_index: int, fraction: float) -> Iterator[Cap]:
    """Cap this process's allocator on one device for the block, then put the previous fraction back.

    ``torch_cuda`` is ``torch.cuda`` (the caller's; this module never imports torch). The
    previous fraction is read with ``get_per_process_memory_fraction`` where torch has it; older
    torch has no public getter, so the default 1.0 (no cap) is restored and ``Cap.previous`` is
    None. The restore runs on success, on any exception and on KeyboardInterrupt; if the block
    failed and the restore fails too, the block's exception propagates with a note. Note that
    torch initialises CUDA to set a fraction: use this only where the cell uses CUDA anyway.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise OomMagicError(f"memory fraction must be between 0 and 1, not {fraction!r}")
    previous = _current_fraction(torch_cuda, device_index)
    restore_to = 1.0 if previous is None else previous
    cap = Cap(device_index=device_index, fraction=float(fraction), previous=previous, restore_to=restore_to)
    try:
        # Inside the try: a Ctrl-C landing right after the fraction is set still puts it back.
        torch_cuda.set_per_process_memory_fraction(float(fraction), device_index)
        yield cap
    except BaseException as exc:
        try:
            torch_cuda.set_per_process_memory_fraction(restore_to, device_index)
        except Exception as restore_exc:
            _add_note(exc, f"oom-magic could not restore the memory fraction {restore_to} on "
                           f"cuda:{device_index}: {restore_exc}")
        raise
    else:
        torch_cuda.set_per_process_memory_fraction(restore_to, device_index)


# Caps a guard set and has not put back yet, by guard: a Ctrl-C can land on the first instruction
# of the code that restores one (a with-block's __exit__), before any finally of ours runs; the
# extension's after-cell hook then puts it back, so the next cell runs uncapped as before.
_UNRELEASED: dict[int, Callable[[], object]] = {}


def hold_cap(owner: object, release: Callable[[], object]) -> None:
    """Remember how to put back a cap ``owner`` set, until it says it did (``cap_released``)."""
    _UNRELEASED[id(owner)] = release


def cap_released(owner: object) -> None:
    """The owner put its cap back: nothing left to do for it after the cell."""
    _UNRELEASED.pop(id(owner), None)


def release_interrupted_caps(*_: object) -> None:
    """After a cell: put back every cap an interrupted guard left set (an IPython post_execute hook)."""
    while _UNRELEASED:
        _owner, release = _UNRELEASED.popitem()
        try:
            release()
        except Exception:  # a hook never raises into the user's cell; the guard's report has the note
            pass
