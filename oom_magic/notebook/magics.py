"""The IPython magics: thin adapters from argument strings to the use cases (guard, preflight, cleanup, snapshot)."""
from __future__ import annotations

import argparse
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, CaselessStrEnum, Float, Int, TraitError, Unicode, validate

from ..heap.cleanup import FreeReport, free_stale
from ..common.errors import OomMagicError
from ..heap.roots import collect_roots
from ..heap.snapshot import Snapshot, snapshot

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..records.guard import GuardReport
    from ..records.preflight import Preflight
    from ..render.plot import Timeline
    from .watch import WatchStatus


def _show(result: object) -> None:
    """Display a magic's result where the line runs (not only as the cell's last value); returns None."""
    if result is not None:
        from IPython.display import display

        display(result)


def _parse_line(magic: object, line: str) -> argparse.Namespace:
    """The magic's arguments; a line shlex cannot split (an unclosed quote) is a UsageError too."""
    try:
        args = parse_argstring(magic, line)
    except ValueError as exc:  # argparse's own errors are UsageErrors already; this is shlex's
        raise UsageError(f"cannot read the magic line ({exc}): close the quote or escape it") from None
    # IPython splits the line keeping quotes (arg_split, posix=False): --plot "my run.png" is a path
    # without them. Lists (%freeall's names) keep theirs: a variable's name decides there.
    for name, value in vars(args).items():
        if type(value) is str and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            setattr(args, name, value[1:-1])
    return args


class GuardedCellSyntax:
    """An input transformer: a %%guardload cell whose body does not parse fails before it runs.

    Without it the SyntaxError would surface from inside the magic (its frames, ``File <unknown>``);
    here it is raised while IPython transforms the cell, so IPython shows it as it shows a plain
    cell's (``Cell In[N], line L``, L counted from the %%guardload line) and the cell counts as
    failed. Cells that do not start with %%guardload pass through untouched.
    """

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell

    def __call__(self, lines: list[str]) -> list[str]:
        if not lines or lines[0].split()[:1] != ["%%guardload"]:
            return lines
        body = "".join(lines[1:])
        try:
            self.shell.compile.ast_parse(self.shell.transform_cell(body))  # as IPython parses a plain cell
        except SyntaxError as exc:
            raw = "".join(lines)
            name = self.shell.compile.cache(raw, self.shell.execution_count, raw_code=raw)
            lineno = (exc.lineno or 1) + 1  # the magic's own line comes first
            end = exc.end_lineno + 1 if exc.end_lineno is not None else None
            text = lines[lineno - 1] if lineno - 1 < len(lines) else exc.text
            message = re.sub(r"on line (\d+)", lambda m: f"on line {int(m.group(1)) + 1}", str(exc.msg))
            error = type(exc)(message, (name, lineno, exc.offset, text, end, exc.end_offset))
            raise error from None
        except Exception:
            return lines  # anything else is the magic's to report when it runs
        return lines


@magics_class
class OomMagics(Magics):
    """%gpumem, %freeall (and, with later modules, %%guardload)."""

    top = Int(10, help="How many holders %gpumem lists when --top is not given.").tag(config=True)
    auto_display = CaselessStrEnum(
        ("changes", "always", "off"), default_value="changes",
        help="The memory widget after each cell: 'changes' under cells that changed device memory by at least "
             "the threshold (or ran out of memory), 'always' under every cell, 'off' never (%gpumem --auto MODE).",
    ).tag(config=True)
    gpu_change_threshold = Int(1 << 20, help="Bytes a GPU's allocated or reserved memory must move in one cell "
                                             "for the widget to show (default 1 MiB).").tag(config=True)
    cpu_change_threshold = Int(16 << 20, help="Bytes the process's resident set, or the tensors bound to your "
                                              "variables, must move in one cell on cpu for the widget to show "
                                              "(default 16 MiB).").tag(config=True)
    hook_budget_ms = Int(50, help="Milliseconds the after-cell widget may spend finding who holds memory: a full "
                                  "heap scan when one is predicted to fit, else the quick view (a walk from your "
                                  "variables, the output cache and tracebacks, cut off at this budget), which "
                                  "says so. %gpumem always scans the whole heap.").tag(config=True)
    live_widgets = Int(8, help="How many per-cell memory widgets stay live; older ones are frozen to static "
                               "HTML and their widget models closed. 0 shows static HTML only.").tag(config=True)
    hub_timeout = Float(10.0, help="Seconds the %%guardload preflight may spend reading the config and safetensors "
                        "headers of a hub model that is not in the local cache (never its weights); past "
                        "it the preflight says it checked nothing and the cell runs as it would without it."
                        ).tag(config=True)
    history_length = Int(10_000, help="How many cells the %gpumem --plot timeline keeps (oldest dropped first); "
                                      "read when the extension loads.").tag(config=True)
    guard_raise = Bool(True, help="After an out-of-memory error, %%guardload raises a short exception of the "
                                  "original type (so 'Run All' stops); False only prints the forensics and "
                                  "returns the report.").tag(config=True)
    expandable_segments = Bool(True, help="%%guardload sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                          "for this process while CUDA is not yet initialized, never over your own "
                                          "expandable_segments setting (in PYTORCH_ALLOC_CONF or "
                                          "PYTORCH_CUDA_ALLOC_CONF); --no-expandable skips it for one cell.").tag(config=True)
    guard_headroom = Unicode("5%", help="Memory %%guardload keeps free on the target device in its fit check and "
                                        "retry decision: a size such as 2GiB, or a percentage of the device's "
                                        "capacity such as 5%; --headroom overrides it for one cell.").tag(config=True)

    @validate("top", "gpu_change_threshold", "cpu_change_threshold", "hook_budget_ms", "live_widgets",
              "history_length")
    def _at_least(self, proposal: Any) -> int:
        """A count, threshold or budget below its floor is refused when set (%config says why), not later."""
        name, value = proposal["trait"].name, proposal["value"]
        floor = 1 if name == "history_length" else 0
        if value < floor:
            raise TraitError(f"OomMagics.{name} must be {floor} or more, not {value}; it is unchanged")
        return value

    @validate("hub_timeout")
    def _positive_seconds(self, proposal: Any) -> float:
        """A hub timeout of zero or less could never read anything: refused when set."""
        value = proposal["value"]
        if not value > 0:
            raise TraitError(f"OomMagics.hub_timeout must be a positive number of seconds, not {value}; it is unchanged")
        return float(value)

    @validate("guard_headroom")
    def _headroom(self, proposal: Any) -> str:
        from ..fit.preflight import parse_headroom

        try:
            parse_headroom(proposal["value"], 0)
        except OomMagicError as exc:
            raise TraitError(f"OomMagics.guard_headroom: {exc}; it is unchanged") from None
        return proposal["value"]

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        from .widget import CellWatch

        # The after-cell hooks; _extension registers its callbacks and unload closes it.
        self.cell_watch = CellWatch(shell, self)
        # The input transformer that fails an unparsable %%guardload cell as a plain cell (_extension registers it).
        self.syntax_check = GuardedCellSyntax(shell)

    @magic_arguments()
    @argument("--device", "-d", default=None, help="Device to show: cuda, cuda:N, cpu or mps (default: the current CUDA device, else cpu).")
    @argument("--top", "-n", type=int, default=None, help="How many holders to list (default: OomMagics.top).")
    @argument("--all", "-a", action="store_true", help="List every holder, not only the top N.")
    @argument("--json", action="store_true", help="Show the snapshot as JSON instead of a table: the --top N holders and storages, with how many there are (--all: every one).")
    @argument("-o", dest="output", action="store_true",
              help="Return the Snapshot (or, with --auto/--pin, the settings; with --plot, the Timeline) instead of "
                   "showing it, as %%timeit -o does: `snap = %%gpumem -o`.")
    @argument("--auto", default=None, choices=("changes", "always", "off"), type=str.lower,
              help="The memory widget after each cell: under cells that changed memory (changes), under every "
                   "cell (always) or never (off); also turns the check back on after an error. "
                   "Sets OomMagics.auto_display and shows the settings.")
    @argument("--pin", action="store_true",
              help="Show one live memory widget here that updates after every cell that changes memory, "
                   "instead of one widget per cell (--auto MODE goes back to per-cell widgets).")
    @argument("--plot", nargs="?", const="", default=None, metavar="PATH",
              help="Plot allocated, reserved and per-cell peak memory over the executed cells (out-of-memory "
                   "cells marked, %%%%guardload cells labelled); save a PNG to PATH when given.")
    @line_magic
    def gpumem(self, line: str = "") -> Snapshot | WatchStatus | Timeline | None:
        """Show what uses a device's memory and which variable holds it, wherever the line is in the cell.

        Shows the report (as %timeit prints its timing) and returns None; with -o it returns the
        Snapshot instead. With --auto, --pin or --plot it sets up the memory widget shown after
        cells, or plots the memory timeline, instead (-o returns the settings, or the Timeline).
        """
        args = _parse_line(self.gpumem, line)
        if args.auto is not None or args.pin or args.plot is not None:
            try:
                result = self.cell_watch.command(auto=args.auto, pin=args.pin, plot=args.plot, device=args.device)
            except OomMagicError as exc:
                raise UsageError(str(exc)) from None
            if args.output:
                return result
            _show(result)
            return None
        top = 0 if args.all else (args.top if args.top is not None else self.top)
        if top < 0:
            raise UsageError(f"--top must be 0 or more, not {top}")
        try:
            with self.cell_watch.watcher.own_scan():  # what the scan keeps resident is not the cell's
                snap = snapshot(args.device, roots=collect_roots(self.shell), top=top, name_kernels=True)
        except OomMagicError as exc:
            raise UsageError(str(exc)) from None
        snap = replace(snap, view="json") if args.json else snap
        if args.output:
            return snap
        _show(snap)
        return None

    @magic_arguments()
    @argument("names", nargs="*", help="Variables to delete first (as %%xdel does, output cache included); without names only stale memory is freed.")
    @argument("--device", "-d", default=None, help="Device to free on: cuda, cuda:N, cpu or mps (default: the current CUDA device, else cpu).")
    @argument("--dry-run", action="store_true", help="Report what would be freed; change nothing.")
    @line_magic
    def freeall(self, line: str = "") -> FreeReport:
        """Free stale memory (output cache, stored tracebacks, garbage) without touching a user variable."""
        args = _parse_line(self.freeall, line)
        try:
            return free_stale(args.device, names=args.names, dry_run=args.dry_run, shell=self.shell)
        except OomMagicError as exc:
            raise UsageError(str(exc)) from None

    def _preflight(self, source: str, namespace: dict[str, Any], device: str | None, headroom: str | int,
                   target: Any, job: dict[str, Any]) -> Preflight:
        """The fit check of a guarded cell; a hub model not in the cache is read within hub_timeout."""
        from ..checkpoints.hub import hub_options
        from ..fit.preflight import preflight_check

        with hub_options(timeout=self.hub_timeout):
            return preflight_check(source, namespace, device=device, headroom=headroom, target=target, job=job)

    @magic_arguments()
    @argument("--device", "-d", default=None, help="Device to guard and measure: cuda, cuda:N, cpu or mps (default: where the cell's load puts its weights, else the current CUDA device, else cpu).")
    @argument("--retry", type=int, default=0, metavar="N", help="On out-of-memory, run the cell again, at most N times, when the diagnosis says the same load fits now (default 0).")
    @argument("--strict", action="store_true", help="Do not run the cell when the preflight says the load will not fit (UsageError with the shortfall and an option that fits).")
    @argument("--headroom", default=None, metavar="SIZE", help="Memory to keep free on the device: a size such as 2GiB or a percentage of its capacity such as 5%% (default: OomMagics.guard_headroom).")
    @argument("--snapshot", default=None, metavar="PATH", help="CUDA only: record allocator history during the cell and, on out-of-memory, write it to PATH (a file or a folder) for https://pytorch.org/memory_viz.")
    @argument("--target", default=None, metavar="GPU", help="Rehearse the load for the GPU it will be deployed on: a known GPU (T4, L4, A10G, A100-80GB, H100-80GB, ...) or the card's total as nvidia-smi shows it (16GiB). The fit check and its options are for that GPU's usable memory; on a larger CUDA device the cell runs capped at it (set_per_process_memory_fraction, put back afterwards).")
    @argument("--context", type=int, default=None, metavar="N", help="Size the job, not just the load: tokens the KV cache holds (prompt + generated); overrides what the cell's generate() says.")
    @argument("--prompt", type=int, default=None, metavar="N", help="Tokens of the prompt's forward (default: the cell's literal prompt, else the whole context, the worst case).")
    @argument("--batch", type=int, default=None, metavar="B", help="Sequences at once (default: the cell's generate() input or TrainingArguments' per_device_train_batch_size, else 1).")
    @argument("--train", default=None, metavar="KIND", help="Size a fine-tune: adamw, sgd, adamw8bit, lora or qlora (default: what the cell's TrainingArguments and LoraConfig say).")
    @argument("--lora-r", type=int, default=None, metavar="R", help="The LoRA rank (default: the cell's LoraConfig r, else 16).")
    @argument("--no-cleanup", action="store_true", help="Do not free stale memory (output cache, stored tracebacks, garbage) before the cell.")
    @argument("--no-expandable", action="store_true", help="Do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA initializes.")
    @argument("--quiet", "-q", action="store_true", help="Print only warnings and out-of-memory forensics, show the report as one line and no memory widget under the cell; the GuardReport is still returned in full.")
    @cell_magic
    def guardload(self, line: str = "", cell: str | None = None) -> GuardReport | None:
        """Guard a model-load cell: free stale memory, check the fit, run it, recover from out-of-memory.

        Returns the GuardReport (delta, peak, time, new variables); on out-of-memory prints the
        traceback, gives back what the failed load left, diagnoses it and raises a short exception.
        """
        __tracebackhide__ = True
        from ..guard.pipeline import GuardedLoad, compile_cell
        from ..fit.cell_job import job_overrides
        from ..fit.preflight import load_target, parse_headroom
        from ..fit.targets import parse_target

        args = _parse_line(self.guardload, line)
        if cell is None or not cell.strip():
            raise UsageError("%%guardload needs a cell body: put the code that loads the model below the magic line")
        if args.retry < 0:
            raise UsageError(f"--retry must be 0 or more, not {args.retry}")
        headroom = args.headroom if args.headroom is not None else self.guard_headroom
        try:
            parse_headroom(headroom, 0)
            target = parse_target(args.target) if args.target is not None else None
            job = job_overrides(context=args.context, batch=args.batch, prompt=args.prompt, train=args.train,
                                lora_r=args.lora_r)
        except OomMagicError as exc:  # a bad --headroom, --target or job flag names the fix (and the known GPUs)
            raise UsageError(str(exc)) from None
        body, source = compile_cell(self.shell, cell)  # a SyntaxError shows as it would without the magic
        namespace = self._ipython.user_ns
        guard = GuardedLoad(
            args.device, args.retry, cleanup=not args.no_cleanup,
            expandable_segments=self.expandable_segments and not args.no_expandable, snapshot=args.snapshot,
            headroom=headroom, quiet=args.quiet, raise_on_oom=self.guard_raise, strict=args.strict,
            preflight=lambda: self._preflight(source, namespace, args.device, headroom, target, job),
            shell=self.shell, namespace=namespace, format_traceback=self._guard_traceback, label="%%guardload",
            device_hint=load_target(source, namespace), target=target)
        try:
            guard.begin()
        except OomMagicError as exc:  # an unknown --device, or --strict refusing
            raise UsageError(str(exc)) from None
        if args.quiet:
            self.cell_watch.hushed = True
        try:
            value = guard.run(body)
        finally:
            self._guard_mark(guard)
        if value is not None:
            from IPython.display import display

            display(value)
        if args.quiet and guard.report is not None:
            return _quiet(guard.report)
        return guard.report

    @property
    def _ipython(self) -> InteractiveShell:
        """The shell these magics are registered with (Magics types it as optional; here it is always set)."""
        if self.shell is None:
            raise UsageError("oom-magic's magics need an IPython shell: load them with %load_ext oom_magic")
        return self.shell

    def _guard_traceback(self, exc: BaseException) -> str:
        """The error as IPython prints it, without the guard's own frames."""
        from ..guard.tracebacks import format_user_traceback, user_traceback

        formatter = self._ipython.InteractiveTB
        try:
            return formatter.stb2text(formatter.structured_traceback(type(exc), exc, user_traceback(exc)))
        except Exception:
            return format_user_traceback(exc)
        finally:
            formatter.tb = None  # the formatter keeps the last traceback: that would keep the frames

    @staticmethod
    def _guard_mark(guard: object) -> None:
        """Label the cell on the %gpumem timeline (and flag an out-of-memory the guard caught)."""
        report = getattr(guard, "report", None)
        try:
            from .watch import mark_cell

            peak = getattr(report, "peak", None)
            measured = (peak.bytes, peak.measure) if peak is not None and peak.bytes is not None else None
            mark_cell("%%guardload", oom=report is not None and report.outcome == "oom", peak=measured)
        except Exception:
            pass


def _quiet(report: GuardReport) -> GuardReport:
    """The same report, shown as its one summary line (%%guardload --quiet)."""
    from dataclasses import fields

    from ..records.guard import QuietGuardReport

    return QuietGuardReport(**{f.name: getattr(report, f.name) for f in fields(report)})
