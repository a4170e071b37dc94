"""Why a load ran out of memory: the Diagnosis record, its ranked causes, retry verdict and fit options.

Int bytes, None where unknown. ``diagnose.py`` builds them; the text and HTML forms are in
``render/guard.py``, registered for these types when ``oom_magic.render`` is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .shown import Shown

if TYPE_CHECKING:
    from .oom import OOMMessage
    from .device import ProcessInfo

__all__ = ["Cause", "CauseKind", "Diagnosis", "FitKind", "FitOption", "RetryReason", "RetryVerdict"]

CauseKind = Literal["other-processes", "stale", "variables", "fragmentation", "too-big", "partial-load"]
FitKind = Literal["bfloat16", "int8", "nf4", "device-map-auto", "offload-folder", "map-location-cpu", "device-cpu",
                  "mmap", "skip-optimizer"]
RetryReason = Literal["fits-now", "still-short", "unknown"]


@dataclass(frozen=True)
class FitOption(Shown):
    """One way to make this load fit, with its sizes for this model on this machine.

    ``kind``: 'bfloat16' | 'int8' | 'nf4' | 'device-map-auto' | 'offload-folder' |
    'map-location-cpu' | 'device-cpu' (load_file) | 'mmap' | 'skip-optimizer'. ``device_bytes`` is what lands on the target
    device, ``cpu_bytes`` / ``disk_bytes`` what accelerate would place in RAM / on disk.
    ``max_memory`` is the budget dict to pass (key: device index, 'mps' or 'cpu'; value: bytes).
    ``fits`` is None when a budget is unknown.
    """

    kind: FitKind
    device_bytes: int
    fits: bool | None
    cpu_bytes: int = 0
    disk_bytes: int = 0
    dtype: str | None = None
    max_memory: tuple[tuple[int | str, int], ...] = ()
    offload_folder: str | None = None
    key: str | None = None  # skip-optimizer: the top-level key that holds the model weights
    # what this option needs first and lacks here ("bitsandbytes", ...); set means it cannot work as is (fits False)
    needs: str | None = None

    def code(self) -> str:
        """The change to make in the load call, as code to paste (the option's text form)."""
        return str(self)

    def __repr__(self) -> str:
        return f"<FitOption {self.kind}: {self.device_bytes} B on device, fits={self.fits}>"


@dataclass(frozen=True)
class Cause(Shown):
    """One likely cause of the out-of-memory error and the figures that show it (int bytes)."""

    kind: CauseKind
    score: float  # share of the shortfall this cause accounts for (1.0: alone enough); ranking key
    figures: tuple[tuple[str, int | None], ...]
    processes: tuple[ProcessInfo, ...] = ()  # other-processes
    holders: tuple[tuple[str, int], ...] = ()  # variables: (name, bytes), largest first
    kernels: tuple[tuple[int, str | None, str], ...] = ()  # other-processes: (pid, notebook, how to stop it)
    options: tuple[FitOption, ...] = ()  # too-big / partial-load
    flags: tuple[str, ...] = ()  # facts the advice depends on ('expandable-on', 'cuda-initialized', ...)

    def figure(self, name: str) -> int | None:
        """One named figure (bytes), None when unknown or absent."""
        return dict(self.figures).get(name)

    def text(self) -> str:
        """The cause as lines of text: what, with numbers, then what to do."""
        return str(self)

    def __repr__(self) -> str:
        return f"<Cause {self.kind} score={self.score:.2f}>"


@dataclass(frozen=True)
class RetryVerdict(Shown):
    """Whether running the same load again can fit now, and the two figures that decide it.

    ``reason``: 'fits-now' | 'still-short' | 'unknown' (a figure is missing).
    """

    can_fit: bool
    reason: RetryReason
    free_now: int | None
    need: int | None  # the least the same load needs: its estimate, or what it held + what it asked


@dataclass(frozen=True)
class Diagnosis(Shown):
    """Why a load ran out of memory: causes ranked most likely first, and whether a retry can fit."""

    device: str
    oom: OOMMessage | None
    requested: int | None
    free: int | None  # free on the device when it failed
    total: int | None
    shortfall: int | None  # requested - free
    causes: tuple[Cause, ...]
    retry: RetryVerdict
    notes: tuple[str, ...] = ()

    @property
    def top(self) -> Cause | None:
        """The most likely cause, or None when nothing explains it."""
        return self.causes[0] if self.causes else None

    @property
    def kinds(self) -> tuple[CauseKind, ...]:
        """The cause kinds, most likely first."""
        return tuple(c.kind for c in self.causes)

    def cause(self, kind: str) -> Cause | None:
        """The cause of one kind, or None."""
        return next((c for c in self.causes if c.kind == kind), None)

    def __repr__(self) -> str:
        return f"<Diagnosis {self.device}: {', '.join(self.kinds) or 'no cause found'}; retry={self.retry.can_fit}>"
