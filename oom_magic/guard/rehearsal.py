"""--target: run the guarded cell capped as a smaller GPU, or say why only the fit check could run.

The cap is a ``set_per_process_memory_fraction``, which needs CUDA initialized. When CUDA is not
initialized yet it is initialized for the cap only when the load is known to go to CUDA (the user
named a cuda device, or the cell's load targets one), as ``--snapshot`` does: the cell would
create that context a moment later anyway. Otherwise no context is created for the cap, and the
report says that only the fit check ran.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from ..device.reading import cuda_index
from ..records.guard import Rehearsal
from ..fit.targets import Target, capped, memory_fraction_for

if TYPE_CHECKING:
    from types import ModuleType

    from ..fit.preflight import Preflight

__all__ = ["apply_cap", "force_restore", "plan_rehearsal", "restore_failed"]


def plan_rehearsal(target: Target, device: str, preflight: Preflight | None, torch: ModuleType | None,
                   loads_to_cuda: bool) -> Rehearsal:
    """Whether the cell can run capped as the target here; if not, the reason."""
    checked = preflight is not None and any(c.target is not None and c.need is not None for c in preflight.checks)
    rehearsal = Rehearsal(target, device, checked)
    if not device.startswith("cuda"):
        return replace(rehearsal, reason="not-cuda")
    if torch is None:
        return replace(rehearsal, reason="torch-not-imported")
    if not _cuda_ready(torch) and not loads_to_cuda:
        return replace(rehearsal, reason="cuda-not-initialized")
    return rehearsal


def _cuda_ready(torch: ModuleType) -> bool:
    """Whether the user's torch has CUDA initialized (asking creates no context)."""
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def apply_cap(rehearsal: Rehearsal, torch: ModuleType, device: str) -> tuple[Rehearsal, Callable[[], Any] | None]:
    """Cap this process on the device at the target's usable memory plus what it holds now.

    Returns the rehearsal as it now stands (capped, or 'not-larger' / 'cap-failed') and how to put
    the previous fraction back (None when nothing was capped).
    """
    cuda = torch.cuda
    index = cuda_index(device) or 0
    try:
        if not cuda.is_initialized():
            cuda.init()  # only for a load known to go to CUDA (see plan_rehearsal)
        total = int(cuda.get_device_properties(index).total_memory)
        held = int(cuda.memory_allocated(index))
        fraction = memory_fraction_for(rehearsal.target.usable, total, held)
        rehearsal = replace(rehearsal, device_total=total, held_before=held)
        if fraction >= 1.0:
            return replace(rehearsal, reason="not-larger"), None
        manager = capped(cuda, index, fraction)
        cap = manager.__enter__()
    except Exception as exc:
        return replace(rehearsal, reason="cap-failed", error=f"{type(exc).__name__}: {exc}"), None
    return replace(rehearsal, cap=cap), lambda: manager.__exit__(None, None, None)


def force_restore(rehearsal: Rehearsal, torch: ModuleType | None) -> Rehearsal:
    """Put the previous fraction back directly (a Ctrl-C landed in the restore itself)."""
    cap = rehearsal.cap
    if cap is None or torch is None:
        return rehearsal
    torch.cuda.set_per_process_memory_fraction(cap.restore_to, cap.device_index)
    return replace(rehearsal, restored=True)


def restore_failed(rehearsal: Rehearsal, exc: Exception) -> Rehearsal:
    """The rehearsal with the previous fraction not put back, and the call that would."""
    cap = rehearsal.cap
    where = (f"torch.cuda.set_per_process_memory_fraction({cap.restore_to if cap else 1.0}, "
             f"{cap.device_index if cap else 0})")
    return replace(rehearsal, restored=False, error=f"could not put the previous fraction back ({exc}): run {where}")
