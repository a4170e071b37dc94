"""What a guarded load returns: the GuardReport and the records it is made of.

Int bytes, None where unknown. The text and HTML forms are in ``render/guard.py``, registered
for these types when ``oom_magic.render`` is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .shown import Shown

if TYPE_CHECKING:
    from .cleanup import FreeReport
    from .device import DeviceReading
    from .oom import OOMMessage
    from .preflight import Preflight
    from .target import Cap, Target
    from .diagnosis import Diagnosis

__all__ = ["AllocatorAction", "AllocatorSetting", "Attempt", "ChangeKind", "ContextRoom", "GiveBack", "GuardReport", "Outcome",
           "PeakMeasure", "PeakReading", "QuietGuardReport", "Rehearsal", "RehearsalReason", "VariableUse"]

Outcome = Literal["ok", "oom", "error"]
AllocatorAction = Literal["set", "already-on", "user-off", "needs-restart", "off", "not-cuda"]
PeakMeasure = Literal["allocated", "resident", "none"]
ChangeKind = Literal["new", "rebound", "grew", "shrank"]
# Where a guarded load ran: its hints name magics and cells in IPython, Python calls in a script.
MadeIn = Literal["ipython", "script"]
RehearsalReason = Literal["not-cuda", "not-larger", "torch-not-imported", "cuda-not-initialized", "cap-failed"]


@dataclass(frozen=True)
class AllocatorSetting(Shown):
    """What the guard did about ``expandable_segments`` before the load.

    ``action``: 'set' (the variable was set for this process) | 'already-on' | 'user-off' (you
    set it False) | 'needs-restart' (CUDA is initialized: the setting applies only from a fresh
    kernel) | 'off' (turned off by flag or config) | 'not-cuda'.
    """

    action: AllocatorAction
    variable: str | None = None
    value: str | None = None

    @property
    def enabled(self) -> bool | None:
        """Whether expandable segments are on for this process's allocator (None: not CUDA)."""
        if self.action in ("set", "already-on"):
            return True
        if self.action == "not-cuda":
            return None
        return False


@dataclass(frozen=True)
class PeakReading(Shown):
    """The cell's peak on the device, what it measures, and what it means (or why it is unknown)."""

    bytes: int | None  # the highest the measure reached during the cell
    above_start: int | None  # peak minus the same measure before the cell
    measure: PeakMeasure  # 'allocated' (CUDA allocator) | 'resident' (process RSS) | 'none'
    note: str


@dataclass(frozen=True)
class VariableUse(Shown):
    """A variable the load created or changed, with the device memory it holds."""

    name: str
    change: ChangeKind
    bytes: int  # tensor bytes reachable from it, every device
    delta: int  # change in those bytes during the cell
    by_device: tuple[tuple[str, int], ...]
    dtype: str | None  # the dtype that holds most of its bytes


@dataclass(frozen=True)
class GiveBack(Shown):
    """What came back after a failed load: its own tensors, stale memory, and what is still held."""

    failed_load_bytes: int  # tensors the failed load created, now freed
    stale_bytes: int  # tensors from before the load (stale tracebacks, output cache, garbage), now freed
    still_held_bytes: int  # tensors the failed load created that something still holds
    still_held_by: tuple[str, ...]
    frames_cleared: int
    dropped_last_exception: bool
    at_failure: DeviceReading
    after: DeviceReading
    cleanup: FreeReport | None = None

    @property
    def total(self) -> int:
        """Tensor bytes freed in all."""
        return self.failed_load_bytes + self.stale_bytes

    @property
    def process_freed(self) -> int | None:
        """How much this process's own usage fell (CPU: resident memory; CUDA: NVML's figure)."""
        a, b = self.at_failure.process_used, self.after.process_used
        return None if a is None or b is None else a - b

    @property
    def reserved_freed(self) -> int | None:
        """How much PyTorch's reserved memory fell (CUDA/MPS; cache emptied)."""
        a, b = self.at_failure.reserved, self.after.reserved
        return None if a is None or b is None else a - b


@dataclass(frozen=True)
class Attempt(Shown):
    """One run of the load: how it ended, and on out-of-memory what came back and why it failed."""

    number: int
    outcome: Outcome
    seconds: float
    error: str | None = None  # "RuntimeError: <first line>"
    oom: OOMMessage | None = None
    give_back: GiveBack | None = None
    diagnosis: Diagnosis | None = None
    snapshot_file: str | None = None  # where --snapshot wrote the allocator history at this failure


@dataclass(frozen=True)
class Rehearsal(Shown):
    """How ``--target`` was rehearsed: the cell ran capped as that GPU, or only the fit check ran, and why.

    ``reason`` when there is no cap: 'not-cuda' | 'not-larger' (this device is not larger than the
    target plus what this process holds) | 'torch-not-imported' | 'cuda-not-initialized' (the load
    was not seen going to CUDA, so no context was created for the cap) | 'cap-failed'.
    """

    target: Target
    device: str
    checked: bool  # the preflight sized a load against the target
    cap: Cap | None = None  # the fraction set for the cell and the one put back
    reason: RehearsalReason | None = None
    device_total: int | None = None  # CUDA's total for this device (what the fraction multiplies)
    held_before: int | None = None  # memory_allocated() before the cell: counted on top of the target
    restored: bool | None = None  # the previous fraction was put back (None: not yet, or no cap)
    error: str | None = None

    @property
    def limit(self) -> int | None:
        """Bytes this process may reserve on the device under the cap."""
        if self.cap is None or self.device_total is None:
            return None
        return int(self.cap.fraction * self.device_total)


@dataclass(frozen=True)
class ContextRoom(Shown):
    """How much KV cache the loaded model has room for now: the device's free memory after the load over
    what the cache grows by per token at this batch (the job's sizing probe, run on the meta device)."""

    tokens: int            # free // per_token
    batch: int             # the job's batch for inference, else 1
    dtype: str             # the cache's dtype (the model's compute dtype)
    free: int              # free on the device after the load
    per_token: float       # bytes the cache grows by per token of context at this batch
    device: str


@dataclass(frozen=True)
class GuardReport(Shown):
    """The story of one guarded load: before, each attempt, after. Int bytes, None where unknown.

    ``str(report)`` tells the whole story; IPython shows the run summary.
    """

    device: str
    outcome: Outcome
    attempts: tuple[Attempt, ...]
    cleanup: FreeReport | None
    allocator: AllocatorSetting
    preflight: Preflight | None
    before: DeviceReading
    after: DeviceReading
    seconds: float  # wall time of the last attempt
    delta: int | None  # device usage after − before (CUDA: allocated; CPU: resident memory)
    tensor_delta: int | None  # live tensor bytes on the device after − before
    peak: PeakReading
    variables: tuple[VariableUse, ...] = ()
    snapshot: str | None = None  # where --snapshot wrote the allocator history, or why it did not
    notes: tuple[str, ...] = ()
    label: str = "guard_load"  # '%%guardload' in the magic
    rehearsal: Rehearsal | None = None  # --target: how the load was rehearsed for that GPU
    made_in: MadeIn = "ipython"  # printed later, the report still phrases its hints for where it was made
    context_room: ContextRoom | None = None  # after a load of a transformers model whose config is known

    @property
    def last(self) -> Attempt:
        """The last attempt."""
        return self.attempts[-1]

    @property
    def oom(self) -> OOMMessage | None:
        """The parsed out-of-memory message of the last attempt (None if it did not run out)."""
        return self.last.oom

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The diagnosis of the last out-of-memory error."""
        return self.last.diagnosis

    @property
    def give_back(self) -> GiveBack | None:
        """What came back after the last failed attempt."""
        return self.last.give_back

    @property
    def retries(self) -> int:
        """How many times the load was run again."""
        return len(self.attempts) - 1

    def variable(self, name: str) -> VariableUse | None:
        """The new or changed variable of that name, or None."""
        return next((v for v in self.variables if v.name == name), None)

    def __repr__(self) -> str:
        return (f"<GuardReport {self.device}: {self.outcome} after {len(self.attempts)} attempt(s), "
                f"delta={self.delta}, peak={self.peak.bytes}>")


@dataclass(frozen=True, repr=False)
class QuietGuardReport(GuardReport):
    """A GuardReport whose display is one line (%%guardload --quiet); every field and property is the report's."""
