"""The fit check's records: each load request's fit verdict (with its offload check), the lints, the whole preflight.

Frozen dataclasses with int bytes (None where unknown). They are drawn by ``render.fit``, which
registers their text and HTML with ``shown.renders``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .job import JobFit
from .request import LoadKind, LoadRequest
from .shown import Shown

if TYPE_CHECKING:
    # Records of the advice and the target GPU, still beside the code that builds them.
    from .diagnosis import FitOption
    from .target import Target

__all__ = ["FitCheck", "Lint", "LintCode", "LoadCall", "LoadKind", "LoadRequest", "OffloadCheck", "Preflight", "Severity", "Verdict"]

# The load-request record under its former name (kept for callers of the public API).
LoadCall = LoadRequest
Verdict = Literal["fits", "will-not-fit", "unknown"]
LintCode = Literal["map-location", "weights-only", "safetensors-sibling", "training-checkpoint", "fp32-of-half"]
Severity = Literal["warning", "info"]


@dataclass(frozen=True)
class OffloadCheck:
    """Whether an offload plan's CPU and disk shares fit on this machine; int bytes, None where unknown."""

    folder: Path                # the offload folder, absolute
    folder_exists: bool         # it is an existing directory
    folder_creatable: bool      # it exists and is writable, or its nearest existing parent is a writable directory
    disk_free: int | None       # free bytes on the file system that holds (or would hold) the folder
    ram_available: int | None   # psutil.virtual_memory().available
    shortfalls: tuple[str, ...]  # one line each: what falls short and by how much

    @property
    def ok(self) -> bool:
        """True when nothing falls short (unknown figures are not shortfalls)."""
        return not self.shortfalls

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"{len(self.shortfalls)} shortfall(s)"
        return f"OffloadCheck({str(self.folder)!r}, {state})"


@dataclass(frozen=True)
class FitCheck:
    """Will one load fit where it is going: need against the free memory there, with headroom."""

    call: LoadRequest  # what was asked for
    device: str  # where it must fit ('cuda:0', 'cpu'; 'auto' spreads over device + RAM)
    verdict: Verdict
    reason: str | None  # why 'unknown', in words
    need: int | None  # bytes the weights take there
    dtype: str | None  # the dtype `need` assumes; None = as stored
    free: int | None  # free on that device now
    context: int  # the CUDA context still to come (0 once CUDA is initialized, and off CUDA)
    headroom: int
    parameters: int | None = None
    format: str | None = None
    declared_dtype: str | None = None
    split: tuple[tuple[str, int], ...] = ()  # device_map="auto": (place, bytes) for device, cpu, disk
    options: tuple[FitOption, ...] = ()
    files: int = 0
    estimate: Any = field(default=None, repr=False, compare=False)  # the CheckpointEstimate (no tensors)
    process_cap: int | None = None  # torch.cuda.set_per_process_memory_fraction's limit, when set
    # --target: checked against that GPU's usable memory (free = usable, context already in it), not this device
    target: Target | None = None
    offload: OffloadCheck | None = None  # the advised offload plan's CPU and disk shares checked here
    # --target: the same load checked against this machine too (a 25 GiB load must not run on a
    # 24 GiB machine because an 80 GiB target would hold it); None without --target
    local: FitCheck | None = None
    # cpu loads: RAM at the load's peak when above `need` (a cast or MoE fusion copies beside the
    # file pages it reads; see load_peak); None when the peak is the weights themselves
    ram_peak: int | None = None
    # a hub model not in the cache: bytes its download lacks on the disk of the hub cache; None = it fits or unknown
    download_short: int | None = None
    # a training checkpoint's optimizer/scheduler state, beside `parameters` (which counts the model only)
    optimizer_elements: int = 0
    optimizer_bytes: int = 0
    # vllm.LLM: what it reserves up front on this GPU (gpu_memory_utilization × total); `need` is its
    # share of the weights plus the KV cache of one max_model_len sequence (`kv_cache`) and must fit inside
    reserve: int | None = None
    kv_cache: int | None = None
    max_model_len: int | None = None
    # the job the load is for (call.job) sized against the same budget; its needed bytes count in peak_need
    job: JobFit | None = None
    job_unsized: str | None = None  # why call.job could not be sized (the weights' verdict stands)

    @property
    def budget(self) -> int | None:
        """Bytes the load may use: free − context − headroom (device + RAM for device_map="auto"; vLLM: its reserve)."""
        if self.reserve is not None:
            return self.reserve
        if self.split:
            return sum(b for _, b in self.split)
        if self.free is None:
            return None
        return self.free - self.context - self.headroom

    @property
    def peak_need(self) -> int | None:
        """What the load needs at its peak: the weights, the cpu load's RAM peak, or its job, whichever is higher."""
        if self.need is None:
            return None
        return max(self.need, self.ram_peak or 0, self.job.needed if self.job is not None else 0)

    @property
    def margin(self) -> int | None:
        """Budget − peak_need: what stays free after the load (negative: the shortfall)."""
        if self.peak_need is None or self.budget is None:
            return None
        return self.budget - self.peak_need


@dataclass(frozen=True)
class Lint(Shown):
    """One problem in a load call, one line, with the fix. ``{name}`` in the message is a size."""

    code: LintCode
    line: int | None  # the cell line; None for a checkpoint named outside a cell
    message: str
    fix: str
    severity: Severity = "warning"
    sizes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Preflight(Shown):
    """What the cell will load, whether it fits, and what in the calls should change."""

    device: str | None  # the device the guard measures; None when no load targets one
    calls: tuple[LoadRequest, ...]
    checks: tuple[FitCheck, ...]
    lints: tuple[Lint, ...]
    notes: tuple[str, ...] = ()

    @property
    def will_not_fit(self) -> tuple[FitCheck, ...]:
        """The loads that will not fit where they are going (under --target: there, or here), or whose
        download from the hub will not fit the disk of the hub cache."""
        return tuple(c for c in self.checks if c.verdict == "will-not-fit" or c.download_short
                     or (c.local is not None and c.local.verdict == "will-not-fit"))

    @property
    def fits(self) -> bool | None:
        """True when every sized load fits, False when one will not, None when none could be sized."""
        if self.will_not_fit:
            return False
        return True if any(c.verdict == "fits" for c in self.checks) else None

    def lint(self, code: str) -> Lint | None:
        """The first lint with this code, or None."""
        return next((x for x in self.lints if x.code == code), None)

    def __repr__(self) -> str:
        verdicts = ", ".join(c.verdict for c in self.checks) or "no load found"
        return f"<Preflight {len(self.calls)} load(s): {verdicts}; {len(self.lints)} lint(s)>"
