"""Ask transformers which weights a quantized or float16 load converts, and size what it will hold.

Header arithmetic cannot know transformers' own rules: transformers 5 fuses MoE experts into 3-D
parameters that bitsandbytes never replaces (it replaces only ``nn.Linear`` and ``Conv1D``), and
``_keep_in_fp32_modules`` (T5, mT5, ...) stay float32 under ``dtype=float16``. So the model is
built on the meta device (no memory, no weights read) and transformers' helpers answer:
``HfQuantizer.get_modules_to_not_convert`` (tied and output weights, ``llm_int8_skip_modules``,
``_keep_in_fp32_modules``), ``should_convert_module`` (which modules bitsandbytes replaces) and
``PreTrainedModel._get_dtype_plan`` (which parameters stay float32). Replaced modules are sized
by bitsandbytes' documented layout (bitsandbytes need not be installed):

- int8 (``Linear8bitLt``): an int8 weight plus a float32 scale per output row (``SCB``);
- nf4/fp4 (``Linear4bit``): ``ceil(n / 2)`` uint8 bytes of packed codes, a float32 absmax per
  block of 64 and the layer's own 16-entry float32 code (``get_4bit_type`` makes one per call);
  with double quantization the absmax is uint8 plus, per 256 blocks, a float32 absmax and one
  float32 offset (the nested 256-entry code is one shared map, ``name2qmap["dynamic"]``: left out).

The package never imports torch or transformers itself: when the user's process has already
imported both (``sys.modules``) the model is built here; otherwise in a child Python bounded in
time and memory (config_size.run_child), which imports them. Built models are bounded
(``MAX_TENSORS``) and the answers cached per config file.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from ..common._torch import loaded_torch
from ..common.dtypes import FLOAT_BYTES, QUANTIZED

__all__ = ["HeldBytes", "MAX_TENSORS", "held_bytes", "prepare"]

MAX_TENSORS = 20_000  # a meta model past this (a 1000-layer config) is not worth a second of build
_BLOCK = 64  # BitsAndBytesConfig's 4-bit blocksize
_NESTED_BLOCK = 256  # double quantization: absmax quantized per 256 blocks
_CODE_4BIT = 16 * 4  # nf4/fp4 code table: 16 float32


@dataclass(frozen=True)
class HeldBytes:
    """What a load will hold by transformers' rules: bytes, and where they go."""

    dtype: str  # the asked load: 'float16', 'int8', 'nf4', ...
    bytes: int  # parameters and persistent buffers as loaded (tied weights once)
    quantized_bytes: int  # of which: the modules bitsandbytes replaces, in its layout
    float32_bytes: int  # of which: weights that stay float32 (``_keep_in_fp32_modules``)
    unquantized_floating_bytes: int  # floating weights left in 16-bit by a quantized load
    modules_not_converted: tuple[str, ...]  # transformers' list (quantized loads)


def held_bytes(
    config_dir: str | os.PathLike[str],
    dtype: str,
    *,
    unquantized_dtype: str = "bfloat16",
    double_quant: bool = False,
    skip_modules: tuple[str, ...] | None = None,
) -> HeldBytes | None:
    """Size a load of the model in ``config_dir`` as ``dtype`` by transformers' own rules.

    ``dtype``: 'float16' / 'bfloat16' / 'float32' or 'int8' / 'nf4' / 'fp4' (bitsandbytes, the
    rest of the weights in ``unquantized_dtype``). None when torch or transformers is missing,
    the config cannot be built, or the model has more than ``MAX_TENSORS`` tensors.
    """
    return _sized(config_dir, ((dtype, double_quant),), unquantized_dtype, skip_modules)[0]


def prepare(config_dir: str | os.PathLike[str], loads: Iterable[tuple[str, bool]], *,
            unquantized_dtype: str = "bfloat16", skip_modules: tuple[str, ...] | None = None) -> None:
    """Size several loads ((dtype, double_quant) each) of one model in one pass, for held_bytes to answer.

    Without torch imported here, one child process answers them all: starting one costs seconds
    (importing torch and transformers), and a check that does not fit asks for three.
    """
    _sized(config_dir, tuple(loads), unquantized_dtype, skip_modules)


def _sized(config_dir: str | os.PathLike[str], loads: tuple[tuple[str, bool], ...], rest: str,
           skip_modules: tuple[str, ...] | None) -> list[HeldBytes | None]:
    """The answer for each load, the ones not cached yet sized together (one child at most)."""
    config = _config_file(config_dir)
    if config is None:
        return [None] * len(loads)
    skip = tuple(skip_modules) if skip_modules is not None else None
    keys = [_key(*config, d, rest, dq, skip) for d, dq in loads]
    if len(_held) > 256:  # bounded; cleared before, not after, what was asked is looked up
        _held.clear()
    missing = {k: load for k, load in zip(keys, loads) if k not in _held}
    if missing:
        _size(Path(config[0]), missing, rest, skip)
    return [_held.get(k) for k in keys]


def _size(config: Path, missing: dict[tuple, tuple[str, bool]], unquantized_dtype: str,
          skip: tuple[str, ...] | None) -> None:
    try:
        modules = _loaded()
        if modules is None:  # built in a bounded child, which imports torch and transformers
            answers = _held_in_child(config, list(missing.values()), unquantized_dtype, skip)
        else:
            answers = [held_in_process(*modules, config, d, unquantized_dtype, dq, skip)
                       for d, dq in missing.values()]
    except Exception:  # noqa: BLE001 - transformers' internals move; header arithmetic stays the answer
        answers = [None] * len(missing)
    _held.update(zip(missing, answers))


# (config file, its mtime, dtype, unquantized dtype, double quant, skipped modules) -> the answer; the
# mtime in the key: an edited config.json is sized again.
_held: dict[tuple, HeldBytes | None] = {}


def _config_file(config_dir: str | os.PathLike[str]) -> tuple[str, int] | None:
    config = Path(config_dir) / "config.json"
    try:
        return str(config.resolve()), config.stat().st_mtime_ns
    except OSError:
        return None


def _key(config: str, stamp: int, dtype: str, rest: str, double_quant: bool,
         skip: tuple[str, ...] | None) -> tuple:
    if dtype not in QUANTIZED:  # a float load: the quantization settings do not change it
        rest, double_quant, skip = "", False, None
    return (config, stamp, dtype, rest, double_quant, tuple(skip) if skip is not None else None)


def _loaded() -> tuple[ModuleType, ModuleType] | None:
    """torch and transformers when the user's process has imported both, else None."""
    torch, transformers = loaded_torch(), sys.modules.get("transformers")
    return None if torch is None or transformers is None else (torch, transformers)


# Run by the child: the same sizing with torch and transformers imported there; one JSON line.
_CHILD = r"""
import dataclasses, json, sys
from pathlib import Path
try:
    import torch, transformers
except ImportError as exc:
    print(json.dumps({"missing": str(exc)})); sys.exit(0)
from oom_magic.checkpoints.hf_rules import held_in_process
config, loads, rest, skip = json.loads(sys.argv[1])
answers = []
for dtype, double_quant in loads:
    try:
        held = held_in_process(torch, transformers, Path(config), dtype, rest, double_quant,
                               None if skip is None else tuple(skip))
    except Exception:
        held = None
    answers.append(None if held is None else dataclasses.asdict(held))
print(json.dumps({"held": answers}))
"""


def _held_in_child(config: Path, loads: list[tuple[str, bool]], rest: str,
                   skip: tuple[str, ...] | None) -> list[HeldBytes | None]:
    from .config_size import run_child

    answer = run_child(_CHILD, [json.dumps([str(config), loads, rest, skip])], str(config))
    held = answer.get("held")
    if not isinstance(held, list) or len(held) != len(loads):
        return [None] * len(loads)
    return [HeldBytes(**dict(h, modules_not_converted=tuple(h["modules_not_converted"])))
            if isinstance(h, dict) else None for h in held]


def held_in_process(torch: Any, transformers: Any, config: Path, dtype: str, rest: str, double_quant: bool,
                    skip: tuple[str, ...] | None) -> HeldBytes | None:
    """held_bytes with the given torch and transformers modules (the user's, or the child's)."""
    # Submodules of the transformers passed in (a load imports them itself).
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    quantized = dtype in QUANTIZED
    float_name = rest if quantized else dtype
    if float_name not in FLOAT_BYTES:
        return None
    float_dtype = getattr(torch, float_name)
    model_config = transformers.AutoConfig.from_pretrained(str(config.parent), local_files_only=True,
                                                           trust_remote_code=False)
    model = _build_on_meta(torch, transformers, model_config, float_dtype, config.name)
    tensors = _weights(model)
    if len(tensors) > MAX_TENSORS:
        return None
    keep_fp32 = _float32_matcher(model, float_dtype)
    replaced: dict[str, Any] = {}
    conv1d = None
    not_convert: tuple[str, ...] = ()
    if quantized:
        keep = sorted(getattr(model, "_keep_in_fp32_modules", None) or ())
        not_convert = tuple(sorted(HfQuantizer.get_modules_to_not_convert(
            model, list(skip) if skip is not None else None, keep)))
        conv1d = getattr(transformers, "Conv1D", None) or _conv1d()
        for name, module in model.named_modules():
            if not should_convert_module(name, list(not_convert)):
                continue
            if type(module) is torch.nn.Linear or (conv1d is not None and isinstance(module, conv1d)):
                replaced[f"{name}.weight" if name else "weight"] = module
    total = quant = fp32 = kept16 = 0
    for name, tensor in tensors:
        if name in replaced:
            n = tensor.numel()
            rows = _out_features(replaced[name], tensor, conv1d)
            size = _int8_bytes(n, rows) if dtype == "int8" else _four_bit_bytes(n, double_quant)
            quant += size
            total += size
            continue
        if not tensor.is_floating_point():
            total += tensor.numel() * tensor.element_size()
            continue
        if keep_fp32(name):
            size = tensor.numel() * 4
            fp32 += size
        else:
            size = tensor.numel() * FLOAT_BYTES[float_name]
            if quantized:
                kept16 += size
        total += size
    return HeldBytes(dtype, total, quant, fp32, kept16, not_convert)


def _weights(model: Any) -> list[tuple[str, Any]]:
    """Each unique parameter and persistent buffer once (tied weights once), with its name."""
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        items = list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in items:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found.append((prefix + name, tensor))
            if len(found) > MAX_TENSORS:
                return found
    return found


def _float32_matcher(model: Any, float_dtype: Any) -> Callable[[str], bool]:
    """transformers' dtype plan for this load: which parameter names stay float32."""
    plan = model._get_dtype_plan(float_dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return lambda name: False
    from transformers.core_model_loading import build_glob_alternation

    pattern = build_glob_alternation(list(plan.keys()))[0]
    return lambda name: pattern.search(name) is not None


def _conv1d() -> Any:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _out_features(module: Any, weight: Any, conv1d: Any) -> int:
    """Output rows of a replaced module: Conv1D stores [in, out], nn.Linear [out, in]."""
    if conv1d is not None and isinstance(module, conv1d):
        return int(weight.shape[1])
    return int(weight.shape[0])


def _int8_bytes(elements: int, rows: int) -> int:
    """Linear8bitLt: int8 weight + float32 SCB per output row."""
    return elements + 4 * rows


def _four_bit_bytes(elements: int, double_quant: bool) -> int:
    """Linear4bit: packed uint8 codes + absmax per 64-block + code table (nested stats if double)."""
    packed = (elements + 1) // 2
    blocks = -(-elements // _BLOCK)
    if not double_quant:
        return packed + 4 * blocks + _CODE_4BIT
    nested = -(-blocks // _NESTED_BLOCK)
    return packed + blocks + _CODE_4BIT + 4 * nested + 4


def _build_on_meta(torch: Any, transformers: Any, model_config: Any, dtype: Any, label: str) -> Any:
    """Instantiate the config's architecture (else AutoModelForCausalLM, else AutoModel) on meta.

    In this process only when the user has imported torch and transformers (config-only sizing,
    which need not, builds in a bounded child: config_size.py).
    """
    candidates: list[Callable[..., Any]] = []
    for arch in getattr(model_config, "architectures", None) or []:
        found = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
            model_class: Any = found  # a PreTrainedModel subclass: untyped here (transformers is not followed)
            candidates.append(model_class._from_config)
    candidates += [transformers.AutoModelForCausalLM.from_config, transformers.AutoModel.from_config]
    error: Exception | None = None
    for build in candidates:
        try:
            with torch.device("meta"):
                return build(model_config, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - model constructors raise anything
            error = error or exc
    raise ValueError(f"{label}: transformers cannot build this model ({type(error).__name__})")
