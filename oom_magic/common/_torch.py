"""Access to torch only when the user has imported it: the extension never imports it itself."""
from __future__ import annotations

import sys
from types import ModuleType


def loaded_torch() -> ModuleType | None:
    """Return the torch module if the user's process already imported it, else None."""
    torch = sys.modules.get("torch")
    # A half-imported torch (import in progress or failed) has no Tensor yet.
    if torch is None or getattr(torch, "Tensor", None) is None:
        return None
    return torch


def cuda_initialized() -> bool:
    """Say whether this process already has a CUDA context (so allocator calls are free)."""
    torch = loaded_torch()
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False
