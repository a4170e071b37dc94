"""Check a model-load cell before it runs: which checkpoint, how big, whether it fits, what to fix.

The use case over four helpers: ``load_calls`` finds the loads in the cell (parsed, never
executed), ``estimate`` sizes each checkpoint from its headers, ``host`` and ``devices`` say what
is free where it loads, and ``lints`` says what in the call should change. A torch checkpoint's
top-level keys and saved devices are read from ``data.pkl``'s opcodes (``read_checkpoint_keys``),
never unpickled. The result is a ``Preflight`` record (``records.preflight``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from ..checkpoints.files import CheckpointKeys, read_checkpoint_keys
from ..checkpoints.hub import hub_options
from ..common._torch import cuda_initialized
from ..records.diagnosis import FitOption
from .options import device_index, fit_options
from ..common.dtypes import FLOAT_BYTES
from ..common.errors import OomMagicError
from ..device.host import cuda_process_cap, disk_free, ram_total, usable_ram
from .cell_job import with_overrides
from .job_check import with_job
from .lints import load_lints
from .load_calls import device_text, find_load_calls, scan_cell
from .offload import check_offload
from ..records.preflight import FitCheck, Lint, LoadRequest, OffloadCheck, Preflight, Verdict
from ..common.sizes import parse_headroom
from .targets import Target, parse_target

__all__ = ["CUDA_CONTEXT_BYTES", "CheckpointKeys", "FitCheck", "Lint", "LoadRequest", "Preflight", "check_requests",
           "cuda_process_cap", "find_load_calls", "load_target", "parse_headroom", "preflight_check", "read_checkpoint_keys", "usable_ram"]

# What a CUDA context costs on the device before PyTorch allocates anything: 300-600 MiB with
# lazy module loading (CUDA 11.7+), more with eager loading. An estimate, said as one.
CUDA_CONTEXT_BYTES = 512 * 1024**2


@dataclass
class _Budgets:
    """Free memory per device, read once per check (NVML for CUDA, no context; psutil for RAM).

    The overrides (planning, tests) replace this machine's readings; ``target`` checks against
    that GPU's usable memory instead of this machine's devices.
    """

    free_override: int | None
    total_override: int | None
    ram_override: int | None
    disk_override: int | None
    headroom_spec: str | int | None
    nvml: Any
    target: Target | None = None
    cache: dict[str, tuple[int | None, int | None, int, str | None]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # per-process caps (set_per_process_memory_fraction)

    def device(self, device: str) -> tuple[int | None, int | None, int, str | None]:
        """(free, total, context still to come, why unknown) for a device."""
        if device not in self.cache:
            self.cache[device] = self._read(device)
        return self.cache[device]

    def _read(self, device: str) -> tuple[int | None, int | None, int, str | None]:
        if self.target is not None and device != "cpu":
            # The target's usable memory already leaves out its driver's share and a CUDA context.
            return self.target.usable, self.target.total, 0, None
        context = CUDA_CONTEXT_BYTES if device.startswith("cuda") and not cuda_initialized() else 0
        if self.free_override is not None:
            return self.free_override, self.total_override, context, None
        if device == "cpu":
            free, _ = usable_ram()
            total = ram_total()
            return free, total, 0, None if free is not None else "psutil could not read the RAM"
        from ..device.reading import available_devices, read_device

        present = available_devices(self.nvml)
        if device not in present:
            return None, None, 0, f"this machine has no {device} (it has {', '.join(present)})"
        reading = read_device(device, self.nvml)
        if reading.free is None:
            why = next((n for n in reading.notes if "NVML" in n or "mem_get_info" in n), "no reading of its free memory")
            return None, reading.total, context, why
        # PyTorch's own cache (reserved, unallocated) is free for this load too.
        free = reading.free + (reading.cache or 0)
        cap = cuda_process_cap(device)
        if cap is not None:
            # set_per_process_memory_fraction: this process may reserve only `cap` of the device.
            self.limits[device] = cap
            return min(free, max(cap - (reading.allocated or 0), 0)), cap, context, None
        return free, reading.total, context, None

    def auto_device(self, guard_device: str | None) -> str | None:
        """The GPU device_map="auto" fills first: the guard's (with a free-bytes override) or the first present."""
        if self.target is not None:
            return guard_device if guard_device and guard_device.startswith("cuda") else "cuda:0"
        if self.free_override is not None:
            return guard_device if guard_device and guard_device.startswith(("cuda", "mps")) else None
        from ..device.reading import available_devices

        return next((d for d in available_devices(self.nvml) if d.startswith(("cuda", "mps"))), None)

    def capability(self, device: str) -> tuple[int, int] | None:
        """The compute capability of the GPU the weights go to (the --target's, from gpus.json), when known."""
        if self.target is not None and device != "cpu":
            return self.target.compute_capability
        if not device.startswith("cuda"):
            return None
        from ..device.nvml import default_nvml, nvml_device_for_torch

        try:
            found = nvml_device_for_torch(self.nvml or default_nvml(), int(device.partition(":")[2] or 0))
        except Exception:  # the capability only picks float16 over bfloat16: never a reason to fail the check
            return None
        return found.compute_capability if found is not None else None

    def headroom(self, total: int | None, free: int | None) -> int:
        return parse_headroom(self.headroom_spec, total if total is not None else free)

    def ram(self) -> int | None:
        """RAM the load may use after headroom (for device_map='auto' and CPU-first loading)."""
        if self.ram_override is not None:
            return self.ram_override
        free, _ = usable_ram()
        if free is None:
            return None
        return max(free - parse_headroom(self.headroom_spec, ram_total()), 0)

    def disk(self) -> int | None:
        if self.disk_override is not None:
            return self.disk_override
        return disk_free()


# Loads that go through transformers' from_pretrained (pipeline() calls it for its model).
_HF_LOADS = ("from_pretrained", "pipeline")


def _transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:
        return 5


def _load_dtype(call: LoadRequest, declared: str | None, stored: str | None) -> str | None:
    """The float dtype from_pretrained loads in: dtype=, else "auto" (transformers 5) or fp32 (4.x)."""
    request = call.dtype
    if request is None:
        request = "auto" if _transformers_major() >= 5 else "float32"
    if request == "auto":
        if declared in ("float32", "float16", "bfloat16", "float64"):
            return declared
        return stored
    return request


def _stored_float(estimate: Any) -> str | None:
    for name, _ in estimate.stored_dtypes:
        if name.startswith(("float", "bfloat")):
            return name
    return None


def preflight_check(cell: str, namespace: Mapping[str, Any] | None = None, *, device: str | None = None,
                    free_bytes: int | None = None, total_bytes: int | None = None,
                    ram_bytes: int | None = None, disk_bytes: int | None = None,
                    headroom: str | int | None = None, nvml: Any = None,
                    target: str | Target | None = None, job: Mapping[str, Any] | None = None) -> Preflight:
    """Say what a cell will load, whether it fits where it goes, and what to fix — without running it.

    ``device`` is the guard's device (used when a call does not say where it loads). Overrides,
    for planning and tests: ``free_bytes`` / ``total_bytes`` replace the target device's
    reading, ``ram_bytes`` the RAM budget, ``disk_bytes`` the disk budget. ``headroom`` is kept
    free on the target: a size ("2GiB") or a percentage of its capacity ("5%", the default).
    ``target`` ("T4", "16GiB"; see ``targets.parse_target``) checks each load against that GPU's
    usable memory instead of this machine's: a load placed on one device here is checked as if its
    weights went to the target GPU, ``device_map="auto"`` as the target plus this machine's RAM and
    disk, and the options are those that fit there. Raises OomMagicError for a bad headroom or
    target; a cell that does not parse gives a note, not an error. ``job`` (``cell_job.job_overrides``:
    context, batch, prompt, train, lora_r) sets or overrides the job the cell's load is sized for.
    """
    parse_headroom(headroom, 0)  # a bad spelling fails now, not after reading files
    rehearsed = parse_target(target) if target is not None else None
    try:
        calls, skipped = scan_cell(cell, namespace)
    except OomMagicError as exc:
        return Preflight(device, (), (), (), (str(exc),))
    calls, unplaced = with_overrides(calls, job or {})
    notes = list(skipped) + ([unplaced] if unplaced else []) + ([] if calls else [
        "no load call found (from_pretrained, pipeline, vllm.LLM, llama_cpp.Llama, torch.load, load_file): nothing to size"])
    # --target: the cell still runs here, so each load is checked here too (runs_here stays True).
    requests = tuple(replace(call, target=rehearsed) for call in calls) if rehearsed is not None else calls
    return check_requests(requests, device=device, free_bytes=free_bytes, total_bytes=total_bytes,
                          ram_bytes=ram_bytes, disk_bytes=disk_bytes, headroom=headroom, nvml=nvml, notes=notes)


def check_requests(requests: tuple[LoadRequest, ...], *, device: str | None = None, free_bytes: int | None = None,
                   total_bytes: int | None = None, ram_bytes: int | None = None, disk_bytes: int | None = None,
                   headroom: str | int | None = None, nvml: Any = None, notes: Sequence[str] = ()) -> Preflight:
    """Size each load request and say whether it fits where it goes (or on its target GPU): the fit check's one pipeline.

    Every front door (a cell's loads, the command's arguments, ``fit_check()``'s parameters) ends
    here with the same records; ``device`` and the overrides are as in ``preflight_check``.
    """
    parse_headroom(headroom, 0)
    notes = list(notes)
    budgets: dict[str | None, _Budgets] = {}  # one reading per target (None: this machine)

    def budgets_for(target: Target | None) -> _Budgets:
        key = None if target is None else target.name
        if key not in budgets:
            budgets[key] = _Budgets(free_bytes, total_bytes, ram_bytes, disk_bytes, headroom, nvml, target)
        return budgets[key]

    checks: list[FitCheck] = []
    lints: list[Lint] = []
    for request in requests:
        check, request_lints = _check_call(request, device, budgets_for(request.target))
        check = with_job(check)  # the job the load is for, against the same budget
        if request.target is not None and request.runs_here and check.target is not None:
            local, _ = _check_call(request, device, budgets_for(None))
            check = replace(check, local=with_job(local))
        checks.append(check)
        lints += request_lints
        if request.target is not None and check.target is not None and not check.device.startswith(("cuda", "auto")):
            where = f"line {request.line}" if request.line is not None else "this load"
            notes.append(f"{where} loads to {check.device} here; --target {request.target.name} checked it as if "
                         "its weights went to that GPU")
    measured = next((d for d in map(_measured_device, checks) if d is not None), device)
    return Preflight(measured, tuple(requests), tuple(checks), tuple(lints), tuple(notes))


def load_target(cell: str, namespace: Mapping[str, Any] | None = None) -> str | None:
    """The device the cell's first sized load puts its weights on ('cuda', 'cuda:1', 'cpu'), or None.

    Read from the call alone (and, for torch.load without map_location, the devices the file was
    saved from): no estimate, no device reading.
    """
    try:
        calls = find_load_calls(cell, namespace)
    except OomMagicError:
        return None
    for call in calls:
        where = _target(call, None)
        if where is None and call.kind == "torch.load" and call.checkpoint and Path(call.checkpoint).is_file():
            try:
                keys = read_checkpoint_keys(call.checkpoint)
            except OomMagicError:
                keys = None
            where = _saved_device(keys)
        if where == "auto":
            from ..device.reading import available_devices

            return "cuda" if any(d.startswith("cuda") for d in available_devices()) else "cpu"
        if where is not None and where not in ("mixed", "disk", "meta", "unknown"):
            return where
    return None


def _saved_device(keys: CheckpointKeys | None) -> str:
    """Where torch.load without map_location puts a checkpoint: the one device it was saved from, else the cpu."""
    saved = {device_text(loc) for loc in (keys.locations if keys else ())}
    return saved.pop() if len(saved) == 1 else "cpu"


def _measured_device(check: FitCheck) -> str | None:
    """The device a guard should watch for this load: its target, or the GPU of an "auto" split."""
    if check.device == "auto":
        return next((d for d, _ in check.split if d not in ("cpu", "disk")), "cpu")
    if check.device in ("mixed", "unknown", "disk", "meta"):
        return None
    return check.device


def _check_call(call: LoadRequest, guard_device: str | None, budgets: _Budgets) -> tuple[FitCheck, list[Lint]]:
    """One load's check; for a hub model not in the cache, also whether its download fits the cache's disk."""
    check, lints = _check_load(call, guard_device, budgets)
    hub = getattr(check.estimate, "hub", None)
    if hub is not None:
        free = budgets.disk_override if budgets.disk_override is not None else hub.cache_free
        if free is not None and hub.download_bytes > free:
            check = replace(check, download_short=hub.download_bytes - free)
    return check, lints


def _check_load(call: LoadRequest, guard_device: str | None, budgets: _Budgets) -> tuple[FitCheck, list[Lint]]:
    lints: list[Lint] = []
    keys: CheckpointKeys | None = None
    where = _target(call, guard_device)
    if call.checkpoint is None:
        return _unknown(call, where, f"cannot size the checkpoint: {call.unresolved}"), load_lints(call, None, None, None)
    if call.kind == "llama_cpp" or call.gguf_file is not None:
        return _check_gguf(call, where, budgets), []
    try:
        # A from_pretrained cell runs transformers anyway: its quantized / float16 sizes may ask its own rules.
        with hub_options(token=call.token):  # the call's own token= wins over HF_TOKEN and the saved login
            estimate = _estimate(call.checkpoint, follow_transformers=call.kind in _HF_LOADS,
                                 revision=call.revision)
    except OomMagicError as exc:
        lints = load_lints(call, None, None, None)
        said = str(exc)  # a reader's message that starts with the path already names it
        named = said.startswith((call.checkpoint, os.path.abspath(call.checkpoint)))
        return _unknown(call, where, f"cannot size {said}" if named else f"cannot size {call.checkpoint}: {said}"), lints
    if call.kind == "torch.load":
        try:
            keys = read_checkpoint_keys(estimate.files[0]) if len(estimate.files) == 1 else None
        except OomMagicError:
            keys = None
        if where is None:
            where = _saved_device(keys)
    lints = load_lints(call, estimate, keys, _load_dtype(call, estimate.declared_dtype, _stored_float(estimate)))
    if call.kind == "vllm":
        return _check_vllm(call, estimate, budgets), lints
    need, dtype = _need(call, estimate)
    where = where or "cpu"
    if where == "unknown":
        given = next((n for n in call.notes if n.startswith(("device_map:", "map_location:", "device:"))), "")
        return _unknown(call, where, f"where it loads is known only when the cell runs ({given})", estimate, need,
                        dtype), lints
    if where == "mixed":
        return _unknown(call, where, "device_map places modules one by one: not checked", estimate, need, dtype), lints
    if where in ("disk", "meta"):
        return _unknown(call, where, f"weights go to {where}, not to memory", estimate, need, dtype), lints
    if where == "auto":
        return _check_auto(call, estimate, need, dtype, budgets, guard_device), lints
    resolved = _resolve_cuda(where)
    # --target: the weights go to the target GPU (keeping a cuda:N index), whatever this machine has.
    place = (resolved if resolved.startswith("cuda") else "cuda:0") if budgets.target is not None else resolved
    free, total, context, why = budgets.device(place)
    headroom = budgets.headroom(total, free)
    check = FitCheck(call=call, device=resolved, verdict="unknown", reason=why, need=need, dtype=dtype, free=free,
                     context=context, headroom=headroom, parameters=estimate.parameters, format=estimate.format,
                     declared_dtype=estimate.declared_dtype, files=len(estimate.files), estimate=estimate,
                     process_cap=budgets.limits.get(place), target=budgets.target, optimizer_elements=getattr(estimate, "optimizer_elements", 0),
                    optimizer_bytes=getattr(estimate, "optimizer_bytes", 0))
    if free is None:
        return check, lints
    peak = _ram_peak(call, estimate, dtype) if place == "cpu" else None
    check = replace(check, reason=None, ram_peak=peak if peak is not None and peak > need else None)
    budget = free - context - headroom
    if max(need, peak or 0) <= budget:
        return replace(check, verdict="fits"), lints
    model_part = None
    if keys is not None and keys.optimizer_keys():
        model_part = keys.model_key()
    options = fit_options(estimate, device=place, need=need, dtype=dtype, loader=call.kind,
                          device_budget=budget, ram_budget=budgets.ram() if place != "cpu" else budget,
                          disk_budget=budgets.disk(), model_part=model_part,
                          offload_folder=call.offload_folder or "offload",
                          compute_capability=budgets.capability(place))
    options, offload = _check_offload_plan(options, _peak_ratio(call, estimate, dtype))
    return replace(check, verdict="will-not-fit", options=options, offload=offload), lints


def _check_gguf(call: LoadRequest, where: str | None, budgets: _Budgets) -> FitCheck:
    """A GGUF load: llama.cpp's GPU share (weights of the offloaded layers and their KV cache at n_ctx), or
    transformers' gguf_file=, which dequantizes every tensor to the load dtype (float32 unless told)."""
    from .llama_cpp import read_gguf, size_llama_cpp

    if call.checkpoint is None:
        return _unknown(call, where, f"cannot size the checkpoint: {call.unresolved}")
    try:
        with hub_options(token=call.token):
            header, hub, label = read_gguf(call.checkpoint, call.gguf_file, call.revision)
        if call.kind == "llama_cpp":
            # llama-cpp-python's defaults: n_ctx=512, n_gpu_layers=0
            load: Any = size_llama_cpp(header, label, n_ctx=call.n_ctx or 512, n_gpu_layers=call.n_gpu_layers or 0,
                                       hub=hub)
            need, dtype = (load.gpu_bytes if call.n_gpu_layers else load.weights_bytes + load.kv_cache_bytes), None
            where = ("cuda" if call.n_gpu_layers else "cpu") if where is None or call.n_gpu_layers else where
        else:
            dtype = call.dtype if call.dtype in FLOAT_BYTES else "float32"
            load = _GgufDequantized(label, hub)
            need = sum(t.elements for t in header.tensors) * FLOAT_BYTES[dtype]
    except OomMagicError as exc:
        return _unknown(call, where, f"cannot size {call.checkpoint}{'/' + call.gguf_file if call.gguf_file else ''}: "
                                     f"{exc}")
    where = where or "cpu"
    if where in ("unknown", "mixed", "disk", "meta", "auto"):
        return _unknown(call, where, f"a GGUF load with device {where}: not checked", load, need, dtype)
    resolved = _resolve_cuda(where)
    place = (resolved if resolved.startswith("cuda") else "cuda:0") if budgets.target is not None else resolved
    free, total, context, why = budgets.device(place)
    check = FitCheck(call=call, device=resolved, verdict="unknown", reason=why, need=need, dtype=dtype, free=free,
                     context=context, headroom=budgets.headroom(total, free),
                     parameters=sum(t.elements for t in header.tensors), format="gguf", files=1, estimate=load,
                     process_cap=budgets.limits.get(place), target=budgets.target)
    if free is None:
        return check
    return replace(check, reason=None, verdict="fits" if need <= (check.budget or 0) else "will-not-fit")


@dataclass(frozen=True)
class _GgufDequantized:
    """What the preflight keeps of a GGUF that transformers loads (gguf_file=): its label and what the hub sent."""

    file: str
    hub: Any


def _ram_peak(call: LoadRequest, estimate: Any, dtype: str | None) -> int | None:
    """RAM a from_pretrained onto the cpu takes at its peak (load_peak), or None when not known."""
    if call.kind not in _HF_LOADS:
        return None
    from .load_peak import load_peak

    peak = load_peak(estimate, dtype)
    return None if peak is None else peak.ram_need


def _peak_ratio(call: LoadRequest, estimate: Any, dtype: str | None) -> float:
    """RAM at the load's peak per byte of weights kept in RAM (1.0 when no copy is made)."""
    peak = _ram_peak(call, estimate, dtype)
    loaded = estimate.bytes_for(dtype) if dtype in FLOAT_BYTES else estimate.stored_bytes
    return max(peak / loaded, 1.0) if peak and loaded else 1.0


def _check_offload_plan(options: tuple[FitOption, ...],
                        peak_ratio: float = 1.0) -> tuple[tuple[FitOption, ...], OffloadCheck | None]:
    """Check the advised disk-offload plan's RAM and disk shares here; an option that falls short does not fit.

    The RAM share counts the load's transient peak (``peak_ratio``: a cast copies beside the file).
    """
    plan = next((o for o in options if o.kind == "offload-folder"), None)
    if plan is None:
        return options, None
    try:
        offload = check_offload(int(plan.cpu_bytes * peak_ratio), plan.disk_bytes, plan.offload_folder or "offload")
    except OomMagicError:
        return options, None
    if offload.ok:
        return options, offload
    return tuple(replace(o, fits=False) if o is plan else o for o in options), offload


def _target(call: LoadRequest, guard_device: str | None) -> str | None:
    if call.moved_to:
        return call.moved_to
    if call.kind in _HF_LOADS:
        if call.device == "default":  # pipeline() without device or device_map: device 0, a GPU when there is one
            from ..device.reading import available_devices

            return next((d for d in available_devices() if d.startswith("cuda")), "cpu")
        return call.device or "cpu"
    return call.device


def _resolve_cuda(device: str) -> str:
    """'cuda' → the current CUDA device (cuda:0 without a context)."""
    if device != "cuda":
        return device
    from ..device.reading import default_device

    current = default_device()
    return current if current.startswith("cuda") else "cuda:0"


def _need(call: LoadRequest, estimate: Any) -> tuple[int, str | None]:
    """Bytes the load puts on its target, and the dtype that assumes (None: as stored)."""
    if call.kind not in _HF_LOADS:
        if call.cast_to in FLOAT_BYTES:
            return estimate.bytes_for(call.cast_to), call.cast_to
        return estimate.stored_bytes, None
    dtype = _load_dtype(call, estimate.declared_dtype, _stored_float(estimate))
    if call.cast_to in FLOAT_BYTES and call.quantization is None:
        dtype = call.cast_to
    rest = dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16"
    if call.quantization in ("int8", "nf4", "fp4"):
        kwargs = {"skip_modules": call.skip_modules} if call.skip_modules is not None else {}
        return (estimate.bytes_for(call.quantization, double_quant=call.double_quant, unquantized_dtype=rest, **kwargs),
                call.quantization)
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        return estimate.bytes_for(dtype), dtype
    return estimate.stored_bytes, None


def _unknown(call: LoadRequest, where: str | None, reason: str, estimate: Any = None, need: int | None = None,
             dtype: str | None = None) -> FitCheck:
    return FitCheck(call=call, device=where or "unknown", verdict="unknown", reason=reason, need=need, dtype=dtype,
                    free=None, context=0, headroom=0,
                    parameters=estimate.parameters if estimate is not None else None,
                    format=estimate.format if estimate is not None else None,
                    declared_dtype=estimate.declared_dtype if estimate is not None else None,
                    files=len(estimate.files) if estimate is not None else 0, estimate=estimate,
                    optimizer_elements=getattr(estimate, "optimizer_elements", 0),
                    optimizer_bytes=getattr(estimate, "optimizer_bytes", 0))


def _check_vllm(call: LoadRequest, estimate: Any, budgets: _Budgets) -> FitCheck:
    """vllm.LLM: its reservation must be free, and its weights plus one max_model_len sequence must fit inside it."""
    from .vllm import vllm_sizes

    try:
        sizes = vllm_sizes(call, estimate, _stored_float(estimate))
    except OomMagicError as exc:
        return _unknown(call, "cuda:0", str(exc), estimate)
    place = "cuda:0"
    base = _unknown(call, place, "", estimate, sizes.need, sizes.dtype)
    free, total, context, why = budgets.device(place)
    if free is None or total is None:
        return replace(base, reason=why or "no reading of this GPU's total memory", free=free, context=context)
    reserve = int(total * (call.memory_utilization or 0.9))
    fits = reserve <= free - context and sizes.need <= reserve
    return replace(base, verdict="fits" if fits else "will-not-fit", reason=None, free=free, context=context,
                   reserve=reserve, kv_cache=sizes.kv_cache, max_model_len=sizes.max_model_len, target=budgets.target)


def _check_auto(call: LoadRequest, estimate: Any, need: int, dtype: str | None, budgets: _Budgets,
                guard_device: str | None) -> FitCheck:
    """device_map="auto": the first GPU (if any), then RAM, then (with offload_folder) disk."""
    limits = dict(call.max_memory or ())
    gpu = budgets.auto_device(guard_device)
    split: list[tuple[str, int]] = []
    free = total = None
    context = headroom = 0
    if gpu is not None:
        free, total, context, _ = budgets.device(gpu)
        headroom = budgets.headroom(total, free)
        usable = max((free or 0) - context - headroom, 0)
        key = device_index(gpu)
        if key in limits:
            usable = min(usable, limits[key])
        split.append((gpu, usable))
    ram = budgets.ram()
    if ram is not None:
        split.append(("cpu", min(ram, limits["cpu"]) if "cpu" in limits else ram))
    disk = budgets.disk()
    if call.offload_folder and disk is not None:
        split.append(("disk", disk))
    verdict: Verdict = "fits" if need <= sum(b for _, b in split) else "will-not-fit"
    options: tuple[FitOption, ...] = ()
    offload: OffloadCheck | None = None
    if verdict == "will-not-fit":
        place = gpu or "cpu"
        options = fit_options(estimate, device=place, need=need, dtype=dtype,
                              device_budget=dict(split).get(place, 0), ram_budget=ram, disk_budget=disk,
                              offload_folder=call.offload_folder or "offload",
                              compute_capability=budgets.capability(place))
        options, offload = _check_offload_plan(options, _peak_ratio(call, estimate, dtype))
    return FitCheck(call=call, device="auto", verdict=verdict, reason=None, need=need, dtype=dtype, free=free,
                    context=context, headroom=headroom, parameters=estimate.parameters, format=estimate.format,
                    declared_dtype=estimate.declared_dtype, split=tuple(split), options=options,
                    files=len(estimate.files), estimate=estimate, target=budgets.target, offload=offload,
                    optimizer_elements=getattr(estimate, "optimizer_elements", 0),
                    optimizer_bytes=getattr(estimate, "optimizer_bytes", 0))


class _PipelineEstimate:
    """A diffusers pipeline folder sized as the sum of its components (CheckpointEstimate's interface)."""

    def __init__(self, path: Path, parts: list[Any]) -> None:
        self.path = str(path)
        self.parts = parts
        self.format = "diffusers-pipeline"
        self.files = tuple(f for p in parts for f in p.files)
        self.parameters = sum(p.parameters for p in parts)
        self.stored_bytes = sum(p.stored_bytes for p in parts)
        self.bytes = sum(p.bytes for p in parts)
        declared = {p.declared_dtype for p in parts} - {None}
        self.declared_dtype = declared.pop() if len(declared) == 1 else None
        census: dict[str, int] = {}
        for p in parts:
            for name, n in p.stored_dtypes:
                census[name] = census.get(name, 0) + n
        self.stored_dtypes = tuple(sorted(census.items(), key=lambda kv: -kv[1]))

    def bytes_for(self, dtype: str, **kwargs: Any) -> int:
        return sum(p.bytes_for(dtype, **kwargs) for p in self.parts)

    def prepare_rules(self, loads: tuple[tuple[str, bool], ...], **kwargs: Any) -> None:
        for p in self.parts:
            p.prepare_rules(loads, **kwargs)


def _estimate(checkpoint: str, follow_transformers: bool = False, revision: str | None = None) -> Any:
    """estimate_checkpoint, or for a diffusers pipeline folder the sum over its weight folders."""
    from ..checkpoints.estimate import estimate_checkpoint, resolve_checkpoint

    try:
        return estimate_checkpoint(checkpoint, follow_transformers=follow_transformers, revision=revision)
    except OomMagicError as first:
        try:
            folder = resolve_checkpoint(checkpoint)
        except OomMagicError:
            raise first from None
        if not (folder / "model_index.json").is_file():
            raise
        parts = []
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            weights = [f for f in sub.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth")]
            if weights:
                parts.append(estimate_checkpoint(sub))
        if not parts:
            raise
        return _PipelineEstimate(folder, parts)
