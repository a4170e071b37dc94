"""Gradients and optimizer state as torch.optim (and bitsandbytes) create them, parameter by parameter.

Parameters are (name, dtype, elements, bytes) rows, as the meta-device probe reports them. Rules,
from the optimizers' ``_init_group`` / first ``step``:
- every trainable parameter gets a ``.grad`` of its own shape and dtype;
- AdamW: ``exp_avg`` and ``exp_avg_sq`` (``zeros_like``: the parameter's dtype) and a ``step``
  scalar, float32, created on the host unless ``capturable``/``fused`` (so on a GPU it costs no
  device memory; on the cpu it is 4 bytes per parameter);
- SGD with momentum: one ``momentum_buffer``, a clone of the first gradient;
- bitsandbytes ``AdamW8bit``: parameters of at least ``min_8bit_size`` (4096) elements keep two
  uint8 states plus a float32 absmax per block of 256 and the two shared 256-entry float32
  code tables; smaller ones keep two float32 states (bitsandbytes' ``Optimizer2State.init_state``).

And what the step itself allocates for a moment: on a GPU, AdamW runs its ``foreach`` kernels by
default (``_default_to_fused_or_foreach``: every parameter a CUDA tensor), and ``_multi_tensor_adamw``
takes ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, one new tensor per parameter of its
state's size, while the gradients and state are alive (measured on an H200: the step's peak above
what it leaves equals the gradients' bytes, 4,416,872,448 B). Its other updates are in place. SGD's
foreach momentum update is in place too (no nesterov, no weight decay); bitsandbytes' 8-bit step
runs its own kernels, in place.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from ..common.errors import OomMagicError

__all__ = ["gradient_bytes", "optimizer_bytes", "optimizer_step_bytes"]

Row = tuple[str, str, int, int]  # (name, dtype, elements, bytes)
_FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
_STEP_BYTES = 4  # torch.tensor(0.0, dtype=float32): AdamW's step counter
_BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size
_BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit state block
_BNB_CODE_TABLES = 2 * 256 * 4  # the "dynamic" and "udynamic" quantization maps, shared by every parameter


def _trainable(rows: Iterable[Row]) -> list[Row]:
    return [row for row in rows if row[1] in _FLOATING]


def gradient_bytes(rows: Iterable[Row]) -> int:
    """Bytes of the ``.grad`` tensors of the trainable (floating) parameters: one per parameter, same dtype."""
    return sum(row[3] for row in _trainable(rows))


def optimizer_bytes(rows: Iterable[Row], optimizer: str, *, on_host_too: bool = False) -> int:
    """Bytes of the optimizer state after the first step, for 'adamw', 'sgd' (momentum) or 'adamw8bit'.

    ``on_host_too``: add AdamW's float32 ``step`` counters, which live on the host (count them when
    the device is the cpu).
    """
    params = _trainable(rows)
    if optimizer == "adamw":
        return sum(2 * nbytes for _, _, _, nbytes in params) + (_STEP_BYTES * len(params) if on_host_too else 0)
    if optimizer == "sgd":
        return sum(nbytes for _, _, _, nbytes in params)
    if optimizer == "adamw8bit":
        total = _BNB_CODE_TABLES if params else 0
        for _, _, elements, _ in params:
            if elements >= _BNB_MIN_8BIT:
                total += 2 * (elements + 4 * math.ceil(elements / _BNB_BLOCK))
            else:
                total += 2 * 4 * elements
        return total
    raise OomMagicError(f"unknown optimizer {optimizer!r}: use adamw, sgd or adamw8bit")


def optimizer_step_bytes(rows: Iterable[Row], optimizer: str, *, foreach: bool = True) -> int:
    """Bytes the optimizer's step allocates for a moment above its state: foreach AdamW's sqrt of
    ``exp_avg_sq`` (one tensor the size of each parameter, in its dtype); 0 for SGD, 8-bit AdamW,
    or AdamW's per-parameter loop (``foreach=False``, the default on the cpu: a parameter at a time)."""
    if optimizer == "adamw" and foreach:
        return sum(nbytes for _, _, _, nbytes in _trainable(rows))
    if optimizer in ("adamw", "sgd", "adamw8bit"):
        return 0
    raise OomMagicError(f"unknown optimizer {optimizer!r}: use adamw, sgd or adamw8bit")
