"""Lint a load call: the one-line problems in how it loads (unsafe unpickling, a missed map_location,
a safetensors file beside a pickle, a training checkpoint read whole, float32 of a half model), each with the fix.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..checkpoints.files import CheckpointKeys
from ..records.preflight import Lint
from ..records.request import LoadRequest

__all__ = ["load_lints"]


def load_lints(call: LoadRequest, estimate: Any, keys: CheckpointKeys | None, load_dtype: str | None) -> list[Lint]:
    """What in this load call should change (``estimate`` and ``keys`` None when the file was not read)."""
    found: list[Lint] = []
    if call.kind == "torch.load":
        found += _torch_load_lints(call, estimate, keys)
    if call.kind in ("from_pretrained", "pipeline") and estimate is not None:
        declared = estimate.declared_dtype
        if load_dtype == "float32" and declared in ("bfloat16", "float16") and call.quantization is None \
                and call.cast_to in (None, "float32"):
            half = estimate.bytes_for(declared)
            found.append(Lint(
                "fp32-of-half", call.line,
                f"loads in float32 a model whose config.json declares {declared}: {{fp32}} instead of {{half}}",
                # a checkpoint named to the command or fit_check() has no call to edit: name the flag
                f'pass --dtype {declared} (dtype="{declared}" in fit_check())' if call.origin == "checkpoint"
                else f'pass dtype=torch.{declared} (or dtype="auto")',
                sizes=(("fp32", estimate.bytes_for("float32")), ("half", half))))
    return found


def _torch_load_lints(call: LoadRequest, estimate: Any, keys: CheckpointKeys | None) -> list[Lint]:
    found: list[Lint] = []
    name = Path(call.checkpoint).name if call.checkpoint else "the checkpoint"
    saved_on_cpu = keys is not None and bool(keys.locations) and all(loc == "cpu" for loc in keys.locations)
    if not call.map_location_given and not saved_on_cpu:  # a cpu-saved file comes back to the cpu anyway
        saved = ", ".join(keys.locations) if keys is not None and keys.locations else None
        where = f" (this file was saved from {saved})" if saved else ""
        found.append(Lint("map-location", call.line,
                          f"torch.load without map_location restores each tensor to the device it was saved from{where}",
                          'pass map_location="cpu", then move the model with .to(device)'))
    if call.weights_only is not True:
        version = _torch_version()
        safe_default = version is not None and version >= (2, 6) and call.weights_only is None \
            and os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "") in ("", "0")
        if call.weights_only is False:
            message = "torch.load(weights_only=False) unpickles the file, which runs any code it holds"
        elif safe_default:
            message = (f"torch.load without weights_only=True: torch {version[0]}.{version[1]} defaults to it, "  # type: ignore[index]
                       "but torch < 2.6 (or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) unpickles with code execution")
        else:
            message = "torch.load without weights_only=True unpickles the file, which runs any code it holds"
        found.append(Lint("weights-only", call.line, message, "pass weights_only=True",
                          severity="info" if safe_default else "warning"))
    if call.checkpoint is not None:
        sibling = _safetensors_sibling(Path(call.checkpoint))
        if sibling is not None:
            found.append(Lint("safetensors-sibling", call.line,
                              f"{name} is a pickle, and {sibling.name} beside it holds safetensors (no code runs, memory-mapped)",
                              f'load {sibling.name} with safetensors.torch.load_file(path, device="cpu")'))
    if keys is not None and keys.optimizer_keys() and not (call.mmap and call.device == "cpu"):
        heavy = keys.optimizer_keys()
        opt_bytes = sum(b for _, b in heavy)
        names = ", ".join(repr(k) for k, _ in heavy)
        model = keys.model_key()
        pick = f"[{model[0]!r}]" if model else ""
        found.append(Lint("training-checkpoint", call.line,
                          f"{name} is a training checkpoint: {names} {'hold' if len(heavy) > 1 else 'holds'} "
                          "{optimizer} of its {total}, "
                          "and torch.load reads all of it",
                          f'torch.load(path, map_location="cpu", weights_only=True, mmap=True){pick} reads only what you use',
                          sizes=(("optimizer", opt_bytes), ("total", keys.total))))
    return found


def _safetensors_sibling(path: Path) -> Path | None:
    """The .safetensors copy of a pickle checkpoint: same stem, or the HF rename (pytorch_model* → model*).

    Any other .safetensors file in the folder is left out: sharing a folder does not make it this checkpoint.
    """
    if not path.is_file() or path.suffix == ".safetensors":
        return None
    same = path.with_suffix(".safetensors")
    if same.is_file():
        return same
    if path.name.startswith("pytorch_model"):
        renamed = path.parent / (path.name.replace("pytorch_model", "model", 1).rsplit(".", 1)[0] + ".safetensors")
        if renamed.is_file():
            return renamed
    return None


def _torch_version() -> tuple[int, int] | None:
    try:
        from importlib.metadata import version

        major, minor = version("torch").split(".")[:2]
        return int(major), int(re.match(r"\d+", minor).group())  # type: ignore[union-attr]
    except Exception:
        return None
