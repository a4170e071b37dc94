"""The fit check on its own: will a checkpoint (or a load cell) fit a device or a target GPU.

``fit_check`` is ``%%guardload``'s preflight for scripts and pipelines: a checkpoint path (local
file or folder, sharded index, ``.bin``/``.pt``, or a hub id: from the local cache, else its
config and safetensors headers read from the hub) is turned into the load call it stands for and
checked exactly as the guard checks a cell; code is checked as written. Headers only: no weight is
loaded or downloaded, nothing is run, and no CUDA context is created.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from ..common.errors import OomMagicError
from .preflight import Preflight, preflight_check

__all__ = ["QUANTIZATIONS", "DTYPES", "fit_check", "load_source"]

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


def load_source(path: str | os.PathLike[str], *, device: str, dtype: str | None = None,
                quantization: str | None = None, revision: str | None = None) -> str:
    """The one-line load a checkpoint stands for, as %%guardload would read it.

    A folder or hub id loads with ``from_pretrained``; a single ``.bin``/``.pt`` file with
    ``torch.load``, a ``.safetensors`` file with ``load_file`` (a dtype becomes ``.to(dtype)``).
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
        cast = f".to(torch.{dtype})" if dtype else ""
        if local.suffix in _TORCH_FILES:
            return f"state = torch.load({text!r}, map_location={device!r}, weights_only=True){cast}"
        return f"state = safetensors.torch.load_file({text!r}, device={device!r}){cast}"
    folder = str(local.parent) if local is not None and local.is_file() else text  # an index names its folder
    args = [repr(folder)]
    if revision is not None:
        args.append(f"revision={str(revision)!r}")
    if dtype:
        args.append(f"dtype=torch.{dtype}")
    if quantization == "int8":
        args.append("quantization_config=BitsAndBytesConfig(load_in_8bit=True)")
    elif quantization is not None:
        args.append(f"quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={quantization!r})")
    args.append(f"device_map={device!r}")
    return f"model = AutoModelForCausalLM.from_pretrained({', '.join(args)})"


def fit_check(path_or_cell_or_call: str | os.PathLike[str], *, device: str | None = None, target: Any = None,
              dtype: str | None = None, quantization: str | None = None, headroom: str | int | None = None,
              namespace: Mapping[str, Any] | None = None, revision: str | None = None,
              token: str | None = None, hub_timeout: float | None = None) -> Preflight:
    """Check whether a checkpoint, or the loads in some code, fit a device or a target GPU; runs nothing.

    ``path_or_cell_or_call`` is a checkpoint (file, folder, shard index or cached hub id ``org/name``)
    or code holding ``from_pretrained`` / ``torch.load`` / ``load_file`` calls (names in it resolve
    against ``namespace``). ``device`` is where the weights go ("cuda", "cuda:1", "cpu", "auto" for
    ``device_map="auto"``; default: the current CUDA device, else cpu); ``target`` ("T4", "16GiB")
    checks against that GPU's usable memory instead of this machine's. ``dtype`` and
    ``quantization`` ("int8", "nf4", "fp4") say how a checkpoint path is loaded. Returns the
    ``Preflight`` record ``%%guardload`` prints (``.fits``: True, False, or None when nothing could
    be sized); raises ``OomMagicError`` with the fix for a missing path, unknown target or dtype.

    A hub id not in the local cache is sized from its config.json and safetensors headers read from
    the hub at ``revision`` (``token``: else HF_TOKEN or the saved login), within ``hub_timeout``
    seconds (default 10); a failure to read them is an ``OomMagicError`` of one line.
    """
    from ..checkpoints.hub import hub_options

    with hub_options(timeout=hub_timeout, token=token):
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
    from ..checkpoints.files import uncached_hub_id

    remote = uncached_hub_id(path_or_cell_or_call)
    if remote is not None:  # read the hub first: a failure is the command's one line, not a preflight
        from ..checkpoints.hub import read_hub_checkpoint

        read_hub_checkpoint(remote, revision=revision)  # kept per (repo, revision) for the estimate
    if device is None:
        from ..device.reading import default_device

        device = "cuda" if target is not None else default_device()
    source = load_source(path_or_cell_or_call, device=str(device), dtype=dtype, quantization=quantization,
                         revision=revision)
    return preflight_check(source, {}, device=None if device == "auto" else str(device), headroom=headroom,
                           target=target)
