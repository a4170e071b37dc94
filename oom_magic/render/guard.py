"""Text and HTML for %%guardload: cleanup, allocator and preflight lines, the give-back, the run summary.

The diagnosis is worded in ``render/diagnosis.py`` and the fit options in ``render/advice.py``
(their names are re-exported here). Every string that comes from outside (paths, variable names,
process names, error messages, call source) is escaped in the HTML forms.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..common.sizes import shorten
from ..records.diagnosis import RetryVerdict
from ..records.guard import (AllocatorSetting, ContextRoom, GiveBack, GuardReport, QuietGuardReport, Rehearsal,
                             VariableUse)
from ..records.hub import HubRead
from ..records.llama_cpp import LlamaCppLoad
from ..records.shown import renders
from .advice import (OPTION_LABELS, aligned_rows, option_code, option_notes, option_rows, quantized_label, size_literal, target_label,
                     target_place)
from .job import job_label, job_sum
from .diagnosis import cause_text, cause_title, diagnosis_html, diagnosis_text, retry_text
from .units import escape, format_bytes, one_line  # escape: html.escape, surrogate-safe

if TYPE_CHECKING:
    from ..records.cleanup import FreeReport
    from ..records.preflight import FitCheck, Lint, Preflight
    from ..records.target import Target

__all__ = ["allocator_line", "cause_text", "cause_title", "cleanup_line", "context_room_line", "diagnosis_html", "diagnosis_text",
           "give_back_line", "guard_report_html", "need_phrase", "guard_report_text", "lint_text", "option_code", "option_rows",
           "preflight_html", "preflight_text", "quiet_summary_html", "quiet_summary_text", "refusal_line",
           "rehearsal_line", "retry_line", "retry_text", "run_summary_text", "script_wording", "short_message",
           "size_literal", "target_label", "target_place", "worded_for"]


def lint_message(lint: Lint) -> str:
    """The lint's problem with its sizes filled in."""
    return lint.message.format(**{name: format_bytes(b) for name, b in lint.sizes}) if lint.sizes else lint.message


def lint_text(lint: Lint) -> str:
    """One line: the problem with its sizes, then the fix."""
    message = lint_message(lint)
    tag = "note" if lint.severity == "info" else "lint"
    where = f" (line {lint.line})" if lint.line is not None else ""
    return one_line(f"{tag}{where}: {message} → {lint.fix}")


def cleanup_line(report: FreeReport) -> str:
    """What the cleanup before the load gave back."""
    if report.freed_bytes == 0:
        return f"cleanup: nothing stale to free on {report.device}"
    kinds = ", ".join(f"{k} {format_bytes(b)}" for k, b in report.freed_by_kind if b)
    return f"cleanup: freed {format_bytes(report.freed_bytes)} of stale memory on {report.device} ({kinds})"


def allocator_line(setting: AllocatorSetting) -> str:
    """What was done about expandable_segments ('' when there is nothing to say)."""
    if setting.action == "set":
        return (f"allocator: set {setting.variable}={setting.value} for this process "
                "(applies when CUDA initializes; fewer fragmentation OOMs)")
    if setting.action == "already-on":
        return f"allocator: expandable_segments already on ({setting.variable}={setting.value})"
    if setting.action == "user-off":
        return f"allocator: you set expandable_segments:False in {setting.variable}; left as is"
    if setting.action == "needs-restart":
        return ("allocator: CUDA is already initialized, so expandable_segments cannot be turned on now; "
                f"restart the kernel and run this cell first (or start Jupyter with "
                f"{setting.variable}=expandable_segments:True)")
    return ""


# --------------------------------------------------------------------------- preflight


def download_short_text(check: FitCheck) -> str:
    """Why a hub model's download will not fit on the disk of the hub cache, and the fix."""
    hub = check.estimate.hub
    return (f"the download of {hub.repo_id} is {format_bytes(hub.download_bytes)}, "
            f"{format_bytes(check.download_short)} more than is free where the hub cache lives ({hub.cache_dir}): "
            "free space there or set HF_HUB_CACHE to a larger disk")


def hub_read_text(hub: HubRead) -> str:
    """What was read from the hub for an uncached model, and what its download would need on disk."""
    headers = f"{hub.headers} header{'s' if hub.headers != 1 else ''}"
    free = (f"{format_bytes(hub.cache_free)} free" if hub.cache_free is not None else "free space unknown")
    return (f"read {headers}, {format_bytes(hub.bytes_read)}, from the hub ({hub.repo_id} at {hub.revision[:12]}); "
            f"the download is {format_bytes(hub.download_bytes)}, {free} in {hub.cache_dir}")


def _check_lines(check: FitCheck) -> list[str]:
    call = check.call
    lines: list[str] = []
    if call.line is not None:  # a load written in a cell: the line as the user wrote it
        where = f" → {call.variable}" if call.variable else ""
        lines.append(f"preflight (line {call.line}){where}: {shorten(call.source or '', 120)}")
    indent = "  " if lines else ""  # a checkpoint named to the command heads its own report
    if check.parameters is not None and check.format == "config-only":  # no weights: say what was sized instead
        lines.append(f"{indent}checkpoint {call.checkpoint}: no weight files found; sized from config.json (the model "
                     f"it describes): {check.parameters:,} parameters, {format_bytes(check.need)} as "
                     f"{check.dtype or 'float32'}")
    elif check.parameters is not None:
        as_what = f"as {quantized_label(check.dtype, call.double_quant)}" if check.dtype else "as stored"
        if isinstance(check.estimate, LlamaCppLoad):
            as_what = "on the GPU" if check.estimate.n_gpu_layers else "in RAM, with its KV cache"
        counted = f"{check.parameters:,} parameters"
        if check.optimizer_elements:  # a training checkpoint: the model's count, its optimizer state beside it
            counted += (f" + optimizer state {check.optimizer_elements:,} elements "
                        f"({format_bytes(check.optimizer_bytes)}, read by torch.load too)")
        held = format_bytes(check.need)
        if check.kv_cache is not None and check.need is not None:  # vLLM: the weights alone here
            held = format_bytes(check.need - check.kv_cache)
            if call.tensor_parallel > 1:
                held += f" per GPU (1/{call.tensor_parallel}, tensor_parallel_size={call.tensor_parallel})"
        lines.append(f"{indent}checkpoint {call.checkpoint} ({check.format}, {check.files} file{'s' if check.files != 1 else ''}): "
                     f"{counted}, {held} {as_what}")
    elif not lines:
        lines.append(f"checkpoint {call.checkpoint}")
    hub = getattr(check.estimate, "hub", None)
    if isinstance(hub, HubRead):
        lines.append(f"  {hub_read_text(hub)}")
    if check.download_short:
        lines.append(f"  WILL NOT FIT on disk: {download_short_text(check)}")
    if isinstance(check.estimate, LlamaCppLoad):
        load = check.estimate
        layers = "all" if load.n_gpu_layers == -1 else load.n_gpu_layers
        lines.append(f"  llama.cpp: {format_bytes(load.weights_bytes)} of weights + {format_bytes(load.kv_cache_bytes)} "
                     f"of KV cache at n_ctx={load.n_ctx}; n_gpu_layers={layers} puts {format_bytes(load.gpu_bytes)} "
                     f"on the GPU, {format_bytes(load.cpu_bytes)} in RAM")
    lines += _job_lines(check)
    if check.verdict == "unknown":
        lines.append(f"  not checked: {check.reason}")
        return lines
    if check.reserve is not None:
        return lines + _vllm_lines(check)
    if check.target is not None:
        return lines + _target_check_lines(check, check.target)
    if check.split:
        places = " + ".join(f"{format_bytes(b)} {'RAM' if d == 'cpu' else d}" for d, b in check.split)
        head = f"  device_map=\"auto\": {places} usable after headroom"
    else:
        free_word = "available" if check.device == "cpu" else "free"
        head = f"  {check.device}: {format_bytes(check.free)} {free_word}"
        if check.process_cap is not None:
            head += f" to this process (capped at {format_bytes(check.process_cap)} by set_per_process_memory_fraction)"
        if check.context:
            head += f" − {format_bytes(check.context)} CUDA context (estimate; not initialized yet)"
        head += f" − {format_bytes(check.headroom)} headroom = {format_bytes(check.budget)}"
    if check.verdict == "fits":
        peak = (f" at the load's RAM peak ({format_bytes(check.peak_need)}: copies beside the file pages read; "
                f"{format_bytes(check.need)} once loaded)") if check.ram_peak is not None else ""
        verdict = "fits"
        if check.job is not None and check.job.needed == check.peak_need:
            verdict, peak = f"fits with its job ({format_bytes(check.peak_need)})", ""
        lines.append(f"{head} → {verdict}, {format_bytes(check.margin)} to spare{peak}")
    else:
        lines.append(f"{head} → WILL NOT FIT: {need_phrase(check)}, {format_bytes(-(check.margin or 0))} short")
    if check.options:
        lines.append("  ways to fit (sizes for this model on this machine):")
        place = check.device if check.device != "auto" else next(
            (d for d, _ in check.split if d not in ("cpu", "disk")), "cpu")
        lines += aligned_rows(option_rows(check.options, place), "    ")
        lines += option_notes(check.options, "    ")
    return lines + _offload_lines(check)


def _vllm_lines(check: FitCheck) -> list[str]:
    """vLLM: its reservation against what is free, then weights + one sequence's KV cache inside it."""
    assert check.reserve is not None and check.need is not None and check.free is not None
    call, kv, length = check.call, check.kv_cache or 0, check.max_model_len or 0
    total = round(check.reserve / (call.memory_utilization or 0.9))
    where = f"on {target_label(check.target)}" if check.target is not None else check.device
    free = check.free - check.context
    context = f" − {format_bytes(check.context)} CUDA context" if check.context else ""
    head = (f"  {where}: vLLM reserves {format_bytes(check.reserve)} up front (gpu_memory_utilization "
            f"{call.memory_utilization:g} × {format_bytes(total)}); {format_bytes(check.free)} free{context}")
    inside = (f"{format_bytes(check.need - kv)} of weights + {format_bytes(kv)} of KV cache for one "
              f"{length:,}-token sequence = {format_bytes(check.need)}")
    if check.reserve > free:
        most = free / total if total else 0.0
        return [head + f" → WILL NOT FIT: vLLM refuses to start, {format_bytes(check.reserve - free)} short "
                       f"of its reservation",
                f"  (it needs {inside}; gpu_memory_utilization={_floor2(most):g} is the most this GPU has free)"]
    if check.need <= check.reserve:
        return [head + f" → fits: needs {inside}, {format_bytes(check.reserve - check.need)} to spare "
                       "(activations and CUDA graphs, profiled at startup, come out of it)"]
    lines = [head + f" → WILL NOT FIT: needs {inside}, {format_bytes(check.need - check.reserve)} short"]
    per_token = kv // length if length else 0
    room = check.reserve - (check.need - kv)
    if per_token and room > 0:
        lines.append(f"  max_model_len={room // per_token:,} fits in the reservation")
    if total and check.need <= free:
        lines.append(f"  gpu_memory_utilization={_ceil2(check.need / total):g} holds it")
    return lines


def _floor2(x: float) -> float:
    return int(x * 100) / 100


def _ceil2(x: float) -> float:
    return -int(-x * 100 // 1) / 100


def _job_lines(check: FitCheck) -> list[str]:
    """The job the load is for, part by part, and the longest context its budget holds (or why it is not sized)."""
    if check.job_unsized is not None:
        return [f"  job not sized: {check.job_unsized}"]
    fit = check.job
    if fit is None:
        return []
    lines = [f"  job: {job_sum(fit)}"]
    if fit.largest_context is not None:
        lines.append(f"  largest context at batch {fit.job.batch} in the {format_bytes(fit.usable)} budget below: "
                     f"{fit.largest_context:,} tokens")
    return lines


def need_phrase(check: FitCheck) -> str:
    """'needs N' — the figure every shortfall subtracts from; a cpu load whose RAM peak or whose job is the need says so."""
    if check.job is not None and check.job.needed == check.peak_need:
        return f"needs {format_bytes(check.peak_need)} for its job ({job_label(check.job.job)})"
    if check.ram_peak is not None:
        return (f"needs {format_bytes(check.peak_need)} at the load's RAM peak (copies beside the file pages read; "
                f"{format_bytes(check.need)} once loaded)")
    return f"needs {format_bytes(check.need)}"


def _target_check_lines(check: FitCheck, target: Target) -> list[str]:
    """The fit verdict phrased for the --target GPU, its options, and the offload plan's check."""
    label, place = target_label(target), target_place(target)
    head = f"  on {label} this load needs {format_bytes(check.peak_need)} of {format_bytes(check.budget)} usable"
    if check.split:
        places = " + ".join(f"{format_bytes(b)} {'RAM' if d == 'cpu' else d if d == 'disk' else 'on the ' + place}"
                            for d, b in check.split)
        head += f" with device_map=\"auto\" ({places}; RAM and disk are this machine's)"
    # One usable figure, the target's, everywhere (the rehearsal line names the same one).
    if not check.split:
        head = f"  on {label} this load needs {format_bytes(check.peak_need)} of {format_bytes(target.usable)} usable"
        head += (f" (after its driver and CUDA context) − {format_bytes(check.headroom)} headroom = "
                 f"{format_bytes(check.budget)}" if check.headroom else " (after its driver and CUDA context)")
    if check.verdict == "fits":
        lines = [f"{head}; margin {format_bytes(check.margin)} → fits"]
    else:
        lines = [f"{head} → WILL NOT FIT: {format_bytes(-(check.margin or 0))} short"]
    if check.local is not None:
        lines.append(_local_line(check.local))
    if check.options:
        lines.append(f"  ways to fit on {label} (sizes for this model; RAM and disk are this machine's):")
        lines += aligned_rows(option_rows(check.options, place), "    ")
        lines += option_notes(check.options, "    ")
    return lines + _offload_lines(check)


def _local_line(local: FitCheck) -> str:
    """--target: the same load against this machine, where the cell really runs."""
    where = "RAM" if local.device == "cpu" else local.device
    if local.verdict == "unknown":
        return f"  and here ({where}): not checked: {local.reason}"
    budget = f"{format_bytes(local.budget)} usable after headroom"
    if local.verdict == "fits":
        return f"  and here ({where}, where the cell runs): {budget} → fits, {format_bytes(local.margin)} to spare"
    return (f"  and here ({where}, where the cell runs): {budget} → WILL NOT FIT: {need_phrase(local)}, "
            f"{format_bytes(-(local.margin or 0))} short")


def _offload_lines(check: FitCheck) -> list[str]:
    """Whether the advised spill to disk has room here: RAM and the offload folder's disk."""
    offload = check.offload
    plan = next((o for o in check.options if o.kind == "offload-folder"), None)
    if offload is None or plan is None:
        return []
    if offload.ok:
        return [f"  spill to disk checked here: {format_bytes(plan.cpu_bytes)} in RAM and "
                f"{format_bytes(plan.disk_bytes)} on disk at {offload.folder} have room"]
    return ["  spill to disk falls short here:"] + [f"    {line}" for line in offload.shortfalls]


def preflight_text(preflight: Preflight) -> str:
    """Every load with its fit verdict and options, then the lints."""
    lines: list[str] = []
    for check in preflight.checks:
        lines += _check_lines(check)
        lines += [f"  note: {n}" for n in check.call.notes]
    lines += [lint_text(x) for x in preflight.lints]
    lines += [f"preflight: {n}" for n in preflight.notes]
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def refusal_line(preflight: Preflight) -> str:
    """One line for --strict: which load will not fit, by how much, and the first option that fits."""
    check = preflight.will_not_fit[0]
    local = check.local if check.local is not None and check.local.verdict == "will-not-fit" else None
    if check.verdict != "will-not-fit" and local is None and check.download_short:
        return one_line(f"--strict: line {check.call.line}: {download_short_text(check)}")
    if check.verdict != "will-not-fit" and local is not None and check.target is not None:  # --target: fits there, not here
        return (f"--strict: line {check.call.line} fits on {target_label(check.target)} but will not fit on this "
                f"machine ({'RAM' if local.device == 'cpu' else local.device}), where the cell runs: "
                f"{need_phrase(local)}, {format_bytes(-(local.margin or 0))} short")
    short = -(check.margin or 0)
    first = next((o for o in check.options if o.fits), None)
    hint = f"; {OPTION_LABELS.get(first.kind, first.kind)} fits: {option_code(first)}" if first else ""
    where = target_label(check.target) if check.target is not None else check.device
    both = (f"; nor on this machine ({'RAM' if local.device == 'cpu' else local.device}): "
            f"{format_bytes(-(local.margin or 0))} short" if local is not None else "")
    return one_line(f"--strict: line {check.call.line} will not fit on {where}: {need_phrase(check)}, "
                    f"{format_bytes(short)} short{both}{hint}")


def preflight_html(preflight: Preflight) -> str:
    """The preflight as HTML (escaped)."""
    return f"<pre class='oom-preflight'>{escape(preflight_text(preflight))}</pre>"


# --------------------------------------------------------------------------- give back, retry, short error


def give_back_line(give_back: GiveBack, device: str) -> str:
    """How much came back after the failure, and what is still held."""
    g = give_back
    parts = [f"give-back: cleared {g.frames_cleared} frame{'s' if g.frames_cleared != 1 else ''} of the error"]
    if g.dropped_last_exception:
        parts.append("dropped the stored exception (sys.last_*)")
    freed = f"freed {format_bytes(g.failed_load_bytes)} of the failed load's tensors"
    if g.stale_bytes:
        freed += f" and {format_bytes(g.stale_bytes)} of stale ones"
    parts.append(freed + f" on {device}")
    line = "; ".join(parts)
    a, b = g.at_failure, g.after
    if a.process_used is not None and b.process_used is not None:
        what = "resident memory" if device == "cpu" else "usage"
        line += f"; this process's {what} {format_bytes(a.process_used)} → {format_bytes(b.process_used)}"
    if g.reserved_freed:
        line += f"; cache emptied ({format_bytes(g.reserved_freed)} back to the driver)"
    if g.still_held_bytes:
        holders = ", ".join(f"`{one_line(h)}`" for h in g.still_held_by) or "something the walk could not name"
        line += f"\n  still held: {format_bytes(g.still_held_bytes)} of the failed load, by {holders}"
    return line


def retry_line(verdict: RetryVerdict | None, number: int, total: int) -> str:
    """What the guard does after a failed attempt (the figures are in the diagnosis's retry line just above)."""
    if verdict is not None and verdict.can_fit:
        return f"→ retry {number + 1} of {total}: running the cell again"
    if verdict is None:
        return "→ no retry: no diagnosis to say a retry would fit"
    return "→ no retry"


def short_message(report: GuardReport) -> str:
    """One line for the short exception: what ran out, how much came back, where the details are."""
    oom = report.oom
    rehearsal = report.rehearsal
    capped = rehearsal.target if rehearsal is not None and rehearsal.cap is not None else None
    ran_out = (f"out of memory as on {target_label(capped)} ({report.device} capped at its "
               f"{format_bytes(capped.usable)} usable)" if capped is not None else f"{report.device} out of memory")
    if oom is not None and oom.requested is not None:
        what = f"{ran_out}: tried to allocate {format_bytes(oom.requested)}"
        free = report.diagnosis.free if report.diagnosis else None
        if free is not None:
            what += f" with {format_bytes(free)} free"
    else:
        what = f"{ran_out}: {one_line((report.last.error or '').split(': ', 1)[-1][:160])}"
    back = report.give_back.total if report.give_back else 0
    top = report.diagnosis.top if report.diagnosis else None
    cause = f"; most likely: {cause_title(top)}" if top is not None else ""
    tries = f" after {len(report.attempts)} attempts" if len(report.attempts) > 1 else ""
    return (f"{what}{tries} ({report.label} gave back {format_bytes(back)}{cause}; "
            "traceback and diagnosis printed above)")


# --------------------------------------------------------------------------- the report


def rehearsal_line(rehearsal: Rehearsal, *, before: bool = False) -> str:
    """One line: how --target was rehearsed here (capped, or the fit check only and why).

    ``before``: said before the cell runs, so the uncapped load is announced, not reported.
    """
    r = rehearsal
    t = r.target
    usable = f"the {target_place(t)}'s {format_bytes(t.usable)} usable"
    checked = f"only the fit check ran against {usable}" if r.checked else f"nothing was checked against {usable}"
    head = f"--target {t.name}: "
    if r.cap is not None:
        held = f" + {format_bytes(r.held_before)} this process already held" if r.held_before else ""
        line = (f"{head}{r.device} ({format_bytes(r.device_total)}) ran capped at {usable}{held} "
                f"(memory fraction {r.cap.fraction:.6g})")
        if r.restored:
            line += f"; the previous fraction {r.cap.restore_to:g} was restored"
        elif r.error:
            line += f"; {r.error}"
        return line
    why = {
        "not-cuda": f"this is {r.device}, so {checked}",
        "not-larger": (f"{r.device} ({format_bytes(r.device_total)}) is not larger than {usable} plus what this "
                       f"process holds, so {checked}"),
        "torch-not-imported": f"torch is not imported yet, so no cap could be set before the cell; {checked}",
        "cuda-not-initialized": (f"CUDA is not initialized and the cell's load was not seen going to {r.device}, so no "
                                 f"cap was set (setting one would create a CUDA context); {checked} — name the device "
                                 f"(--device {r.device}) to rehearse the load itself"),
        "cap-failed": f"could not cap {r.device} ({r.error}); {checked}",
    }.get(r.reason or "", checked)
    return f"{head}{why}; the load itself {'runs' if before else 'ran'} uncapped"


def context_room_line(room: ContextRoom) -> str:
    """'room for 12,345 tokens of KV cache at batch 1 (bfloat16) now: 1.50 GiB available ÷ 128 KiB per token'."""
    free_word = "available" if room.device == "cpu" else "free"
    return (f"room for {room.tokens:,} tokens of KV cache at batch {room.batch} ({room.dtype}) now: "
            f"{format_bytes(room.free)} {free_word} ÷ {format_bytes(round(room.per_token))} per token")


def _variable_line(v: VariableUse) -> str:
    where = " + ".join(f"{format_bytes(b)} on {d}" for d, b in v.by_device) or "0 B"
    dtype = f" {v.dtype}" if v.dtype else ""
    if len(v.by_device) == 1:
        where = f"{format_bytes(v.bytes)}{dtype} on {v.by_device[0][0]}"
    else:
        where = f"{format_bytes(v.bytes)}{dtype} ({where})"
    change = {"new": "new", "rebound": "reassigned", "grew": f"grew {format_bytes(v.delta, signed=True)}",
              "shrank": f"shrank {format_bytes(v.delta, signed=True)}"}[v.change]
    return f"{v.name}: {where} ({change})"


def run_summary_text(report: GuardReport) -> str:
    """The after-the-cell summary: time, delta, peak, the variables it made (worded for where it ran)."""
    return worded_for(report, _summary_text(report))


def _summary_text(report: GuardReport) -> str:
    r = report
    if r.outcome == "oom":
        return one_line(short_message(r))
    if r.outcome == "error":
        return one_line(f"{r.label}: the cell raised {r.last.error}")
    tries = f" (attempt {len(r.attempts)})" if len(r.attempts) > 1 else ""
    measure = "resident memory" if r.device == "cpu" else "allocated"
    line = f"{r.label}: ran in {r.seconds:.2f} s{tries} on {r.device} · {measure} {format_bytes(r.delta, signed=True)}"
    if r.tensor_delta is not None:
        line += f" · tensors {format_bytes(r.tensor_delta, signed=True)}"
    if r.peak.bytes is not None:
        above = f" ({format_bytes(r.peak.above_start, signed=True)} above the start)" if r.peak.above_start is not None else ""
        line += f" · peak {format_bytes(r.peak.bytes)}{above}"
    else:
        line += " · peak n/a"
    lines = [line]
    lines += ["  " + _variable_line(v) for v in r.variables]
    if r.rehearsal is not None and r.rehearsal.cap is not None:  # the other cases were said before the cell
        lines.append("  " + rehearsal_line(r.rehearsal))
    lines.append(f"  peak: {r.peak.note}")
    free_word = "available" if r.device == "cpu" else "free"
    lines.append(f"  {r.device}: {format_bytes(r.after.free)} {free_word} now")
    if r.context_room is not None:
        lines.append(f"  {context_room_line(r.context_room)}")
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def guard_report_text(report: GuardReport) -> str:
    """The whole story: cleanup, allocator, preflight, each attempt, the summary."""
    r = report
    lines: list[str] = []
    if r.cleanup is not None:
        lines.append(cleanup_line(r.cleanup))
    allocator = allocator_line(r.allocator)
    if allocator:
        lines.append(allocator)
    if r.preflight is not None and (r.preflight.calls or r.preflight.notes):
        lines.append(preflight_text(r.preflight))
    capped = r.rehearsal.target if r.rehearsal is not None and r.rehearsal.cap is not None else None
    if r.rehearsal is not None and not (r.outcome == "ok" and capped is not None):  # else in the summary
        lines.append(rehearsal_line(r.rehearsal))
    for attempt in r.attempts:
        if attempt.outcome == "oom":
            lines.append(one_line(f"attempt {attempt.number}: {attempt.error}"))
            if attempt.give_back is not None:
                lines.append(give_back_line(attempt.give_back, r.device))
            if attempt.diagnosis is not None:
                lines.append(diagnosis_text(attempt.diagnosis, capped))
            if attempt.snapshot_file:
                lines.append(one_line(f"allocator history: {attempt.snapshot_file}"))
    if r.snapshot and not any(a.snapshot_file for a in r.attempts):
        lines.append(one_line(f"snapshot: {r.snapshot}"))
    lines.append(run_summary_text(r))
    return worded_for(r, "\n".join(lines))


def worded_for(report: GuardReport, text: str) -> str:
    """The report's hints as they can be followed where it was made: magics in IPython, calls in a script."""
    return script_wording(text) if report.made_in == "script" else text


def guard_report_html(report: GuardReport) -> str:
    """The run summary as HTML, with the full story in a collapsed block (all text escaped)."""
    r = report
    rows = "".join(
        f"<tr><td><code>{escape(v.name)}</code></td><td>{escape(format_bytes(v.bytes))}</td>"
        f"<td>{escape(v.dtype or '')}</td><td>{escape(', '.join(d for d, _ in v.by_device))}</td>"
        f"<td>{escape(v.change)}</td></tr>" for v in r.variables)
    table = (f"<table class='oom-table'><thead><tr><th>variable</th><th>bytes</th><th>dtype</th><th>device</th>"
             f"<th>change</th></tr></thead><tbody>{rows}</tbody></table>") if rows else ""
    head, *rest = run_summary_text(r).splitlines()
    # The cleanup, fit check and forensics were printed just above this report: the details do not repeat
    # them (or the variables, in the table), only what was not said yet; print(report) tells it all again.
    said = {"  " + _variable_line(v) for v in r.variables}
    more = [line.strip() for line in rest if line not in said]
    more.append("print(report) shows the whole story again: cleanup, fit check, each attempt")
    return (f"<div class='oom-guard'><b>{escape(head)}</b>{table}"
            f"<details><summary>details</summary><pre>{escape(chr(10).join(more))}</pre></details></div>")


# --------------------------------------------------------------------------- outside IPython

_SCRIPT_WORDS = (
    (re.compile(r"%freeall (\S+(?: \S+)*)  \(deletes them and frees what only they hold\)"),
     lambda m: f"del {', '.join(m.group(1).split())}, then oom_magic.free_stale()"),
    (re.compile(r" \(or %freeall NAME\)"), lambda m: " (then oom_magic.free_stale())"),
    (re.compile(r"%freeall frees it any time"), lambda m: "oom_magic.free_stale() frees it any time"),
    (re.compile(r"keep cleanup on \(it is unless --no-cleanup\)"), lambda m: "keep cleanup on (cleanup=True)"),
    (re.compile(r"restart the kernel and run %%guardload first"),
     lambda m: "start a new process and enter guard_load before anything initializes CUDA"),
    (re.compile(r"restart the kernel"), lambda m: "restart the process"),
    (re.compile(r"the failed cell"), lambda m: "the failed load"),
    (re.compile(r"running the cell again"), lambda m: "running the load again"),
    (re.compile(r"what the cell allocates"), lambda m: "what the guarded code allocates"),
    (re.compile(r"the cell raised"), lambda m: "the guarded code raised"),
)


def script_wording(text: str) -> str:
    """The guard's hints phrased for a script outside IPython: Python calls instead of magics and cells."""
    for pattern, words in _SCRIPT_WORDS:
        text = pattern.sub(words, text)
    return text


def quiet_summary_text(report: GuardReport) -> str:
    """%%guardload --quiet: the run summary's first line."""
    return run_summary_text(report).splitlines()[0]


def quiet_summary_html(report: GuardReport) -> str:
    """%%guardload --quiet as HTML: the run summary's first line, bold."""
    return f"<div class='oom-guard'><b>{escape(quiet_summary_text(report))}</b></div>"


renders(GuardReport, guard_report_text, guard_report_html, pretty=run_summary_text)
renders(ContextRoom, context_room_line)
renders(QuietGuardReport, guard_report_text, quiet_summary_html, pretty=quiet_summary_text)
