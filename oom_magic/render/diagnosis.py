"""Text and HTML for a diagnosis: each likely cause with its numbers and what to do, and the retry verdict."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..records.diagnosis import Cause, Diagnosis, RetryVerdict
from ..records.shown import renders
from .advice import OPTION_LABELS, aligned_rows, option_code, option_notes, option_rows, target_label, target_place
from .units import escape, format_bytes, one_line  # escape: html.escape, surrogate-safe

if TYPE_CHECKING:
    from ..records.target import Target

_CAUSE_TITLES = {
    "other-processes": "other processes hold memory",
    "stale": "stale memory in this process",
    "variables": "your variables hold memory",
    "fragmentation": "fragmentation",
    "too-big": "the load is too big",
    "partial-load": "the failed load was given back",
}


def cause_title(cause: Cause) -> str:
    """A few words naming the cause."""
    if cause.kind == "too-big" and "not-the-weights" in cause.flags:
        return "one allocation is larger than this device"
    return _CAUSE_TITLES.get(cause.kind, cause.kind)


def _process_line(p, kernel: tuple[int, str | None, str] | None = None) -> str:
    who = p.name or "?"
    bits = [f"pid {p.pid} {who}"]
    if p.user:
        bits.append(f"user {p.user}")
    if kernel is not None and kernel[1]:
        bits.append(f"Jupyter kernel of {kernel[1]}")
    elif p.is_jupyter_kernel or kernel is not None:
        bits.append("Jupyter kernel")
    text = ", ".join(bits) + f": {format_bytes(p.used_bytes)}"
    if kernel is not None and kernel[2]:
        return text + f" → another kernel of yours: {kernel[2]}"
    if p.note == "another user's process":
        return text + " → another user's: ask them, or choose a free GPU with CUDA_VISIBLE_DEVICES"
    if p.is_jupyter_kernel:
        return text + f" → another kernel of yours: shut it down (its notebook: Kernel ▸ Shut Down Kernel) or `kill {p.pid}`"
    if p.name:
        return text + f" → stop it if you do not need it: `kill {p.pid}`"
    # Not described here (exited, or a host pid seen from a container): never advise killing it.
    return text + " → not visible from this process (a host pid, in a container?): check `nvidia-smi` on the host"


def cause_text(cause: Cause, device: str = "the device", target: Target | None = None) -> str:
    """One cause: what, with its numbers, then what to do (``target``: the cell ran capped as that GPU)."""
    f = cause.figure
    kind = cause.kind
    lines: list[str] = []
    if kind == "other-processes":
        if cause.processes:
            lines.append(f"other processes hold {format_bytes(f('others'))} on {device}")
            kernels = {k[0]: k for k in cause.kernels}
            lines += ["   " + _process_line(p, kernels.get(p.pid)) for p in cause.processes]
        else:
            lines.append(f"other processes use {format_bytes(f('others'))} of this machine's "
                         f"{format_bytes(f('total'))} RAM → close what you do not need")
    elif kind == "stale":
        lines.append(f"this process held {format_bytes(f('stale_given_back'))} of stale memory (stored tracebacks, "
                     "output cache, garbage); it has now been freed")
        if f("stale_freed_before"):
            lines.append(f"   the cleanup before the load had already freed {format_bytes(f('stale_freed_before'))}")
        lines.append("   → keep cleanup on (it is unless --no-cleanup); %freeall frees it any time")
    elif kind == "variables":
        held = ", ".join(f"`{name}` {format_bytes(b)}" for name, b in cause.holders)
        names = " ".join(name for name, _ in cause.holders)
        lines.append(f"your variables hold {format_bytes(f('held'))} on {device}: {held}")
        lines.append(f"   → if you no longer need them: %freeall {names}  (deletes them and frees what only they hold)")
    elif kind == "fragmentation":
        cache, requested, block = f("cache"), f("requested"), f("largest_free_block")
        if cache is not None and requested is not None and cache >= requested:
            lines.append(f"{format_bytes(cache)} is reserved by PyTorch but unallocated — at least the "
                         f"{format_bytes(requested)} asked for — yet no single free block is that large")
        elif block is not None:
            lines.append(f"the largest free block is {format_bytes(block)}, smaller than the {format_bytes(requested)} "
                         f"asked for, while {format_bytes((cache or 0) + (f('free') or 0))} is free in all")
        else:
            lines.append(f"{format_bytes(cache)} is cached by PyTorch and {format_bytes(f('free'))} free on the device: "
                         f"together enough for {format_bytes(requested)}, but split")
        if "expandable-on" in cause.flags:
            lines.append("   → expandable_segments is already on and the cache was emptied; if it persists, restart the kernel")
        elif "cuda-initialized" in cause.flags:
            lines.append("   → restart the kernel and run %%guardload first: it sets PYTORCH_CUDA_ALLOC_CONF="
                         "expandable_segments:True before CUDA initializes")
        else:
            lines.append("   → set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA initializes")
    elif kind == "too-big":
        need, total = f("need"), f("total")
        if "not-the-weights" in cause.flags:
            lines.append(f"one allocation asked for {format_bytes(f('requested'))}: more than the whole checkpoint "
                         f"({format_bytes(need)}) and more than {device} has in all ({format_bytes(total)})")
            lines.append("   → it is not the weights that do not fit: look at what the cell allocates besides the "
                         "load (a cache, a buffer, a batch)")
        elif "over-capacity" in cause.flags and "process-limit" in cause.flags and target is not None:
            what = (f"the load needs {format_bytes(need)}" if need is not None
                    else f"one allocation asked for {format_bytes(f('requested'))}")
            lines.append(f"too big for {target_label(target)}: {what}, and under --target {target.name} this "
                         f"process may hold {format_bytes(total)} on {device} (the {target_place(target)}'s "
                         f"{format_bytes(target.usable)} usable plus what it already held)")
        elif "over-capacity" in cause.flags and need is not None and "process-limit" in cause.flags:
            lines.append(f"too big for what this process may use: the load needs {format_bytes(need)}, and "
                         f"torch.cuda.set_per_process_memory_fraction lets it use {format_bytes(total)} of {device}")
        elif "over-capacity" in cause.flags and need is not None:
            lines.append(f"too big for {device}: the load needs {format_bytes(need)}, and {device} has "
                         f"{format_bytes(total)} in all")
        elif "over-capacity" in cause.flags:
            lines.append(f"too big for {device}: one allocation asked for {format_bytes(f('requested'))}, and {device} "
                         f"has {format_bytes(total)} in all")
        else:
            lines.append(f"the load needs {format_bytes(need)} and {format_bytes(f('free_before'))} was free before it")
        if cause.options and target is not None:
            lines.append(f"   ways to fit on {target_label(target)} (sizes for this model):")
            lines += aligned_rows(option_rows(cause.options, target_place(target)), "     ")
            lines += option_notes(cause.options, "     ")
        elif cause.options:
            lines.append("   ways to fit (sizes for this model):")
            lines += aligned_rows(option_rows(cause.options, device), "     ")
            lines += option_notes(cause.options, "     ")
    elif kind == "partial-load":
        if f("given_back"):
            lines.append(f"what the failed cell had allocated ({format_bytes(f('given_back'))}) was given back; "
                         f"{format_bytes(f('free_now'))} is free now")
            if f("still_held"):
                lines.append(f"   {format_bytes(f('still_held'))} more that it allocated is still held (named above)")
        else:
            lines.append(f"what the failed cell loaded ({format_bytes(f('still_held'))}) is still held (named above), "
                         f"so it was not given back; {format_bytes(f('free_now'))} is free now")
            lines.append("   → if you will load again, del those variables first (or %freeall NAME)")
        for option in cause.options:
            lines.append(f"   → a retry with {OPTION_LABELS.get(option.kind, option.kind)} "
                         f"({format_bytes(option.device_bytes)}) fits now: {option_code(option)}")
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def retry_text(verdict: RetryVerdict) -> str:
    """Whether the same load can fit now, with the two figures."""
    if verdict.reason == "unknown":
        return "retry: not enough figures to say whether running the cell again would fit"
    ok = "a retry can fit" if verdict.can_fit else "it would run out again"
    return (f"retry: running the cell again needs at least {format_bytes(verdict.need)}; "
            f"{format_bytes(verdict.free_now)} is free now → {ok}")


def diagnosis_text(diagnosis: Diagnosis, target: Target | None = None) -> str:
    """The ranked causes with their numbers, then the retry verdict (``target``: ran capped as that GPU)."""
    d = diagnosis
    head = f"diagnosis ({d.device}, capped as {target_label(target)})" if target else f"diagnosis ({d.device})"
    if d.requested is not None:
        head += f": asked for {format_bytes(d.requested)}"
        if d.free is not None:
            head += f" with {format_bytes(d.free)} free"
        if d.shortfall is not None:
            head += f" — {format_bytes(d.shortfall)} short"
    lines = [head]
    if not d.causes:
        lines.append("  no cause stands out in the figures")
    for rank, cause in enumerate(d.causes, 1):
        body = cause_text(cause, d.device, target).splitlines()
        lines.append(f"  {rank}. {body[0]}")
        lines += ["  " + line for line in body[1:]]
    lines.append(retry_text(d.retry))
    lines += [f"note: {n}" for n in d.notes]
    return "\n".join(map(one_line, lines))  # outside text stays on its line


def diagnosis_html(diagnosis: Diagnosis, target: Target | None = None) -> str:
    """The diagnosis as HTML (escaped text)."""
    return f"<pre class='oom-diagnosis'>{escape(diagnosis_text(diagnosis, target))}</pre>"


renders(Diagnosis, diagnosis_text, diagnosis_html)
renders(Cause, cause_text)
