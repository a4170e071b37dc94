"""How the fixes are worded: a fit option's label, the code to paste and its table row; a target GPU's name.

Shared by the preflight text, the diagnosis and the guard's report.
"""
from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING
from collections.abc import Iterable, Sequence

from ..records.diagnosis import FitOption
from ..records.shown import renders
from .units import format_bytes

if TYPE_CHECKING:
    from ..records.target import Target

OPTION_LABELS = {
    "bfloat16": "bf16/fp16",
    "int8": "8-bit (bitsandbytes)",
    "nf4": "4-bit nf4, double quant (bitsandbytes)",
    "device-map-auto": "spread over device + RAM",
    "offload-folder": "spill the rest to disk",
    "map-location-cpu": "load on CPU first",
    "device-cpu": "load on CPU first",
    "mmap": "memory-map the file",
    "skip-optimizer": "model weights only",
}


def quantized_label(dtype: str, double_quant: bool) -> str:
    """A load dtype as a size assumes it: 4-bit says whether its absmax is double-quantized (the figures differ)."""
    if dtype in ("nf4", "fp4"):
        return f"{dtype} {'with' if double_quant else 'without'} double quantization"
    return dtype


def size_literal(nbytes: int) -> str:
    """A max_memory value accelerate reads, rounded down: '"8.2GiB"', '"512MiB"', '"96KiB"', or an int."""
    if nbytes <= 0:
        return "0"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            if unit == "GiB":
                value = math.floor(nbytes / factor * 10) / 10
                text = f"{value:.1f}".rstrip("0").rstrip(".")
            else:
                text = str(nbytes // factor)
            return f'"{text}{unit}"'
    return str(nbytes)


def _max_memory_literal(pairs: Iterable[tuple[int | str, int]]) -> str:
    parts = [f"{key if isinstance(key, int) else repr(key).replace(chr(39), chr(34))}: {size_literal(b)}" for key, b in pairs]
    return "{" + ", ".join(parts) + "}"


def option_code(option: FitOption) -> str:
    """The change to the load call, as code to paste."""
    rest = f"torch.{option.dtype}" if option.dtype else "torch.bfloat16"
    kind = option.kind
    if kind == "bfloat16":
        return f"dtype=torch.{option.dtype or 'bfloat16'}"
    if kind == "int8":
        return f"quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype={rest}"
    if kind == "nf4":
        return (f'quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
                f"bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype={rest}), dtype={rest}")
    if kind == "device-map-auto":
        return f'device_map="auto", max_memory={_max_memory_literal(option.max_memory)}'
    if kind == "offload-folder":
        return (f'device_map="auto", max_memory={_max_memory_literal(option.max_memory)}, '
                f'offload_folder="{option.offload_folder or "offload"}"')
    if kind == "map-location-cpu":
        return 'map_location="cpu", weights_only=True (then move the model with .to(device))'
    if kind == "device-cpu":
        return 'device="cpu" (then move the model with .to(device))'
    if kind == "mmap":
        return 'map_location="cpu", weights_only=True, mmap=True'
    if kind == "skip-optimizer":
        key = f"[{option.key!r}]" if option.key else ""
        return f'torch.load(path, map_location="cpu", weights_only=True, mmap=True){key}'
    return kind


def _option_sizes(option: FitOption, device: str) -> str:
    parts = [f"{format_bytes(option.device_bytes)} on {device}"]
    if option.cpu_bytes:
        parts.append(f"{format_bytes(option.cpu_bytes)} in RAM")
    if option.disk_bytes:
        parts.append(f"{format_bytes(option.disk_bytes)} on disk")
    return " + ".join(parts)


def target_place(target: Target) -> str:
    """The target as a place: 'T4', or '16GiB GPU' for a size."""
    return f"{target.name} GPU" if target.name[:1].isdigit() else target.name


def target_label(target: Target) -> str:
    """The target with its article: 'a T4', 'an A100-80GB', 'a 16GiB GPU', 'an 80GiB GPU'."""
    place = target_place(target)
    # Said aloud: letters A E F H I L M N O R S X and the numbers 8, 11, 18, 80... begin with a vowel sound.
    vowel = place[0] in "AEFHILMNORSX8" or place.startswith(("11", "18")) and not place[2:3].isdigit()
    return f"{'an' if vowel else 'a'} {place}"


# Where bitsandbytes runs, said once under the options that need it (its installation guide, v0.48+).
BITSANDBYTES_NOTE = ("8-bit and 4-bit loads need bitsandbytes, not installed here: pip install bitsandbytes "
                     "(NVIDIA GPUs of compute capability 6.0+, 7.5+ for 8-bit; CPUs and Intel XPUs from 0.48; "
                     "AMD ROCm experimental)")


def _verdict_word(option: FitOption) -> str:
    if option.needs:
        return f"needs {option.needs}"
    return "fits" if option.fits else "unknown" if option.fits is None else "too big"


def option_rows(options: Iterable[FitOption], device: str) -> list[tuple[str, str, str, str]]:
    """(label, sizes, fits, code) for each option."""
    return [(OPTION_LABELS.get(o.kind, o.kind), _option_sizes(o, device), _verdict_word(o), option_code(o))
            for o in options]


# Columns a plain-text line may take: JupyterLab breaks a longer output line wherever it runs out, mid-word.
TEXT_WIDTH = 100


def option_notes(options: Iterable[FitOption], indent: str = "") -> list[str]:
    """What the options' 'needs' mean, once each (where bitsandbytes runs and how to install it), wrapped."""
    if not any(o.needs == "bitsandbytes" for o in options):
        return []
    return textwrap.wrap(BITSANDBYTES_NOTE, TEXT_WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def aligned_rows(rows: Sequence[tuple[str, ...]], indent: str) -> list[str]:
    """Rows in aligned columns; when a row would pass TEXT_WIDTH, every row's last column (the code to
    write) goes on the lines below it, wrapped between arguments, never inside a word."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    heads = [(indent + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths))).rstrip() for r in rows]
    whole = [(head + "  " + r[-1]).rstrip() for head, r in zip(heads, rows)]
    if max(map(len, whole)) <= TEXT_WIDTH:
        return whole
    lines = []
    for head, r in zip(heads, rows):
        lines.append(head)
        lines += textwrap.wrap(r[-1], TEXT_WIDTH, initial_indent=indent + "  ", subsequent_indent=indent + "    ",
                               break_long_words=False, break_on_hyphens=False)
    return lines


renders(FitOption, option_code)
