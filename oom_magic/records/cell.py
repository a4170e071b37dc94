"""The after-cell records: a cheap reading of the watched device, one record per cell, what a cell
changed, the view the widget shows, and the watch's settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from .cleanup import FreeReport
from .shown import Shown
from .snapshot import Snapshot

GPU_THRESHOLD: Final = 1 << 20
CPU_THRESHOLD: Final = 16 << 20

WatchMode = Literal["changes", "always", "off"]
# A figure that moved past the threshold in one cell.
ChangeReason = Literal["allocated", "reserved", "rss", "variables"]


@dataclass(frozen=True)
class Thresholds:
    """How far a figure must move in one cell to count as a change (int bytes)."""

    gpu: int = GPU_THRESHOLD
    cpu: int = CPU_THRESHOLD

    def for_device(self, device: str) -> int:
        """The threshold that applies on ``device``."""
        return self.cpu if device == "cpu" else self.gpu


@dataclass(frozen=True)
class Probe:
    """A cheap reading of the watched device (no heap scan); int bytes, None where not read.

    On a GPU: ``allocated``/``reserved`` from the allocator, ``high_water`` its allocated peak.
    On cpu: ``rss`` the resident set, ``high_water`` the peak resident set.
    """

    device: str
    allocated: int | None = None
    reserved: int | None = None
    high_water: int | None = None
    rss: int | None = None

    @property
    def level(self) -> int | None:
        """The figure the delta and the peak are about: allocated on a GPU, RSS on cpu."""
        return self.rss if self.device == "cpu" else self.allocated


@dataclass(frozen=True)
class CellRecord:
    """One executed cell on the timeline: the watched device's figures after it (int bytes)."""

    execution_count: int | None
    device: str
    allocated: int | None       # GPU: bytes in live tensors (allocator); None on cpu
    reserved: int | None        # GPU: allocated + the allocator's cache; None on cpu
    peak: int | None            # GPU: highest allocated during the cell; cpu: highest RSS; None if unknown
    rss: int | None             # cpu: process resident set after the cell; None on a GPU
    tensor_bytes: int | None    # bytes of live tensors the scan after this cell found; None without a scan
    oom: bool                   # the cell raised (or the guard caught) an out-of-memory error
    label: str | None           # %%guardload cells: the guard's label
    changed: bool               # a figure moved by at least the threshold


@dataclass(frozen=True)
class CellChange:
    """What one cell did to the watched device, from the cheap readings alone."""

    record: CellRecord
    before: Probe | None        # None: no reading before this cell (torch or the extension just arrived)
    after: Probe
    delta: int | None           # change of Probe.level (allocated on a GPU, RSS on cpu)
    variable_delta: int | None  # cpu: change of tensor bytes bound to variables
    peak_delta: int | None      # the cell's peak above the level before it, when known
    reasons: tuple[ChangeReason, ...]  # figures that moved past the threshold
    variable_bytes: int | None = None  # cpu: tensor bytes bound to variables after the cell

    @property
    def changed(self) -> bool:
        """Whether a figure moved by at least the threshold."""
        return self.record.changed

    @property
    def oom(self) -> bool:
        """Whether the cell ran out of memory."""
        return self.record.oom

    @property
    def device(self) -> str:
        """The watched device."""
        return self.record.device

    @property
    def execution_count(self) -> int | None:
        """The cell's execution count (None for cells run without history)."""
        return self.record.execution_count


@dataclass(frozen=True)
class CellReport(Shown):
    """What the after-cell widget shows: the cell's change, a snapshot after it, and a cleanup's result.

    ``change`` is None for a view not tied to a cell (the pinned widget before its first update).
    """

    change: CellChange | None
    snapshot: Snapshot
    freed: FreeReport | None = None


@dataclass(frozen=True)
class WatchStatus(Shown):
    """The after-cell display's settings and state, as ``%gpumem --auto/--pin`` report them."""

    mode: WatchMode
    pinned: bool
    enabled: bool               # False after a hook error, until %gpumem --auto re-enables it
    thresholds: Thresholds
    live_widgets: int           # how many per-cell widgets stay live before older ones freeze
    cells_recorded: int
