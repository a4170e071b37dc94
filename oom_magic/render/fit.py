"""The fit check as the command prints it: the guard's preflight text and a verdict, or JSON.

Registers how a ``Preflight`` and a ``Lint`` show themselves (str, IPython, HTML).
"""
from __future__ import annotations

from typing import Any

from ..records.hub import HubRead
from ..records.llama_cpp import LlamaCppLoad
from ..records.preflight import FitCheck, Lint, Preflight
from ..records.shown import renders
from .guard import (download_short_text, hub_read_text, lint_message, lint_text, need_phrase, option_code,
                    preflight_html, preflight_text, target_label)
from .job import job_fit_dict
from .json import record_dict
from .units import format_bytes


def verdict_line(preflight: Preflight) -> str:
    """One line for a log: fits (with the margin), will not fit (short by, first option that fits), or not checked."""
    if preflight.fits is None:
        reason = next((c.reason for c in preflight.checks if c.reason), None) or "; ".join(preflight.notes)
        return f"not checked: {reason}"
    if preflight.fits:
        check = preflight.checks[0]
        return f"fits on {_where(check)}{_sized_from(check)}: {need_phrase(check)}, {format_bytes(check.margin)} to spare"
    check = preflight.will_not_fit[0]
    if check.verdict != "will-not-fit" and check.download_short and (
            check.local is None or check.local.verdict != "will-not-fit"):
        return f"WILL NOT FIT on disk: {download_short_text(check)}"
    first = next((o for o in check.options if o.fits), None)
    hint = f"; fits with {option_code(first)}" if first is not None else ""
    return (f"WILL NOT FIT on {_where(check)}{_sized_from(check)}: {need_phrase(check)}, "
            f"{format_bytes(-(check.margin or 0))} short{hint}")


def _sized_from(check: FitCheck) -> str:
    """A verdict from config.json alone says so: the folder holds no weights (a failed download looks the same)."""
    return " (no weights found: sized from config.json)" if check.format == "config-only" else ""


def fit_text(preflight: Preflight) -> str:
    """The preflight as %%guardload prints it, then the verdict line (left out when nothing was checked:
    the reason is already in the preflight, and the command's error line follows)."""
    if preflight.fits is None and preflight.checks:
        return preflight_text(preflight)
    return f"{preflight_text(preflight)}\n{verdict_line(preflight)}"


def _where(check: FitCheck) -> str:
    return target_label(check.target) if check.target is not None else check.device


def fit_dict(preflight: Preflight) -> dict[str, Any]:
    """The fit check as JSON-ready data: verdict, and per load its need, budget, margin and options (int bytes)."""
    checks = []
    for check in preflight.checks:
        checks.append({
            "line": check.call.line, "source": check.call.source, "loader": check.call.kind,
            "checkpoint": check.call.checkpoint,
            "device": check.device, "verdict": check.verdict, "reason": check.reason,
            "need": check.need, "peak_need": check.peak_need, "ram_peak": check.ram_peak, "dtype": check.dtype, "free": check.free, "context": check.context,
            "headroom": check.headroom, "budget": check.budget, "margin": check.margin,
            "parameters": check.parameters, "optimizer_elements": check.optimizer_elements,
            "optimizer_bytes": check.optimizer_bytes, "format": check.format, "files": check.files,
            "split": [list(s) for s in check.split],
            # the request's target too: a load that could not be sized was still asked about that GPU
            "target": record_dict(target) if (target := check.target or check.call.target) is not None else None,
            "options": [dict(record_dict(o), code=option_code(o)) for o in check.options],
            "download_short": check.download_short,
            # the job the load is for (the cell's, or the flags'): its check as the command's --json has it
            "job": job_fit_dict(check.job)["checks"][0] if check.job is not None else None,
            "job_unsized": check.job_unsized,
            "hub": record_dict(check.estimate.hub) if getattr(check.estimate, "hub", None) is not None else None,
        })
    return {
        "fits": preflight.fits,
        "verdict": "unknown" if preflight.fits is None else "fits" if preflight.fits else "will-not-fit",
        # unsized: the reason is the check's own, said once there
        "summary": verdict_line(preflight) if preflight.fits is not None or not preflight.checks else "not checked",
        "checks": checks,
        "lints": [dict(record_dict(x), message=lint_message(x), text=lint_text(x)) for x in preflight.lints],
        "notes": list(preflight.notes),
    }


renders(Preflight, preflight_text, preflight_html)
renders(Lint, lint_text)
renders(HubRead, hub_read_text)


def llama_cpp_text(load: LlamaCppLoad) -> str:
    """A llama.cpp load's sizes, split and verdict, as the command prints them."""
    types = ", ".join(f"{name} {format_bytes(b)}" for name, b in load.by_type)
    gpu_layers = "all" if load.n_gpu_layers == -1 else str(load.n_gpu_layers)
    lines = [f"llama.cpp load of {load.file}: {load.parameters:,} parameters, {format_bytes(load.weights_bytes)} "
             f"of weights ({types})"]
    if load.hub is not None:
        lines.append(f"  {hub_read_text(load.hub)}")
    lines.append(f"  KV cache at n_ctx={load.n_ctx} ({load.type_k}/{load.type_v}, {load.layers} layers): "
                 f"{format_bytes(load.kv_cache_bytes)}")
    lines.append(f"  n_gpu_layers={gpu_layers}: {format_bytes(load.gpu_bytes)} on the GPU, "
                 f"{format_bytes(load.cpu_bytes)} in RAM")
    where = target_label(load.target) if load.target is not None else "this GPU"
    if load.n_gpu_layers == 0:
        lines.append("fits: n_gpu_layers=0 puts nothing on the GPU")
    elif load.gpu_budget is None:
        lines.append("not checked: no GPU budget here (pass --target GPU)")
    elif load.fits:
        lines.append(f"fits on {where}: {format_bytes(load.gpu_bytes)} needed, "
                     f"{format_bytes(load.gpu_budget - load.gpu_bytes)} to spare")
    else:
        lines.append(f"WILL NOT FIT on {where}: {format_bytes(load.gpu_bytes)} needed, "
                     f"{format_bytes(load.gpu_bytes - load.gpu_budget)} short (lower n_gpu_layers or n_ctx)")
    return "\n".join(lines)


renders(LlamaCppLoad, llama_cpp_text)
