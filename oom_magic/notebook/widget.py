"""Show device memory under each cell that changed it: a bar, a caption, a "Free stale tensors" button.

``CellWatch`` owns the after-cell hooks (registered by ``_extension``): a cheap reading before and
after each cell (``watch.Watcher``, no heap scan), and only when a figure moved past its threshold,
or the cell ran out of memory, a snapshot and a ``MemoryWidget`` under that cell's output.
Modes (``OomMagics.auto_display`` or ``%gpumem --auto``): ``changes`` (default), ``always``,
``off`` (no widget at all, out-of-memory cells included); ``%gpumem --pin`` shows one live widget
that updates after every cell that changed memory instead of one widget per cell.

Widget lifetime, decided here:

- A widget under an earlier cell keeps showing that cell's state, and once a newer widget shows, its
  caption says so ("as of In [N]"); only its own button changes its figures (to now's).
- Live widget models are capped: at most ``OomMagics.live_widgets`` (default 8) per-cell widgets
  stay live. When a newer one pushes the oldest out, the oldest is *frozen*: its output is
  replaced (``update_display`` on its display id) by the static text/html of the state it showed,
  then its models (box, children, layouts, styles) are closed. A frozen widget still shows its
  figures, without a button. ``live_widgets = 0`` displays the static view only (no models).
- Re-pinning, ``--auto`` and unloading the extension freeze the pinned widget; unloading freezes
  every live widget.
- Without a kernel (terminal IPython) outputs are never updated (a terminal would print them
  again); models are still closed.

Every widget's mimebundle carries text/plain and static text/html beside the widget view, so
terminals, nbconvert exports and GitHub show the same figures. This module imports ipywidgets
only when a widget is built, and IPython only when something is displayed.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from ..heap.cleanup import free_stale
from ..common.errors import OomMagicError
from ..records.cell import CellChange, CellRecord, CellReport, Thresholds, WatchStatus
from ..records.cleanup import FreeReport
from ..device.reading import resolve_device
from ..records.snapshot import Snapshot
from ..render.cell import (cell_bar_html, cell_caption, cell_details_html, cell_html, cell_text, free_button_label,
                          freed_line)
from ..render.plot import Timeline, plot_timeline
from ..render.units import escape  # html.escape, surrogate-safe
from ..heap.roots import collect_roots
from ..heap.snapshot import snapshot
from .watch import ScanCost, Watcher, activate, deactivate

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

__all__ = ["CellWatch", "MemoryWidget"]

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
MODES = ("changes", "always", "off")

FreeAction = Callable[[str], "tuple[FreeReport, Snapshot]"]


class MemoryWidget:
    """One memory view: caption, stacked bar with collapsible details, free-stale button; live until frozen.

    Three parts (a Label, an HTML, a button row): every ipywidgets part is a model with its own comm
    messages, so the details are a ``<details>`` element inside the bar's HTML, not an Accordion.
    """

    def __init__(self, report: CellReport, *, free: FreeAction | None = None, pinned: bool = False) -> None:
        import ipywidgets as w

        self.report = report
        self.pinned = pinned
        self.handle: Any | None = None  # the DisplayHandle of the output showing this widget
        self.superseded = False  # a newer cell ran: the caption says "as of In [N]" until a click refreshes it
        self._free = free
        self._busy = False
        self._static: tuple[tuple[CellReport, bool], dict[str, str]] | None = None
        self.caption = w.Label()
        self.bar = w.HTML()
        self.button = w.Button(button_style="warning", icon="trash", layout=w.Layout(width="auto"),
                               tooltip="Free tensors only the output cache, a stored traceback or garbage "
                                       "holds (what %freeall frees); no variable of yours is touched")
        self.status = w.HTML()
        self._row = w.HBox([self.button, self.status])
        self.box = w.VBox([self.caption, self.bar, self._row])
        self.button.on_click(self._on_free)
        self.show(report)

    # -- state -----------------------------------------------------------------------------------
    def show(self, report: CellReport) -> None:
        """Show ``report`` in place (the widget keeps its models and its place in the output)."""
        self.report = report
        if self.closed:
            return
        snap = report.snapshot
        self.bar.value = (cell_bar_html(snap) + "<details class='oom-details'><summary>details</summary>"
                          + cell_details_html(snap) + "</details>")
        self.status.value = escape(freed_line(report.freed)) if report.freed is not None else ""
        self._show_button()
        # The caption goes last: a frontend that shows the new caption has every other part too.
        self.caption.value = cell_caption(report, pinned=self.pinned, as_of=self.superseded)

    def supersede(self) -> None:
        """A newer cell ran: say which cell these figures are from ("as of In [N]"), one caption update."""
        if self.superseded or self.pinned:
            return
        self.superseded = True
        if not self.closed:
            self.caption.value = cell_caption(self.report, as_of=True)

    def _show_button(self) -> None:
        stale = self.report.snapshot.stale_bytes
        self.button.description = free_button_label(stale)
        self.button.layout.display = None if stale > 0 and self._free is not None else "none"

    @property
    def details_body(self) -> Any:
        """The HTML part that holds the details (the bar's: see the class docstring)."""
        return self.bar

    @property
    def closed(self) -> bool:
        """Whether the widget's models are closed (frozen widgets show static HTML only)."""
        return self.box.comm is None

    def close(self) -> None:
        """Close every model this widget created (box, children, their layouts and styles)."""
        for widget in (self.box, self._row, self.caption, self.bar,
                       self.button, self.status):
            for part in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None and part.comm is not None:
                    part.close()

    # -- the button ------------------------------------------------------------------------------
    def _on_free(self, _button: Any = None) -> None:
        if self._busy or self._free is None or self.closed:
            return
        self._busy = True
        self.button.disabled = True
        self.button.description = "Freeing stale tensors…"
        try:
            freed, snap = self._free(self.report.snapshot.device)
            self.superseded = False  # the figures are now's again
            self.show(replace(self.report, snapshot=snap, freed=freed))
        except Exception as exc:  # never into the kernel's comm handler
            self.status.value = escape(f"could not free stale tensors: {type(exc).__name__}: {exc}")
            self._show_button()
        finally:
            self._busy = False
            if not self.closed:
                self.button.disabled = False

    # -- display ---------------------------------------------------------------------------------
    def static_bundle(self) -> dict[str, str]:
        """text/plain and text/html of the state shown (what exports and frozen outputs keep)."""
        cached = self._static
        key = (self.report, self.superseded)
        if cached is None or cached[0][0] is not key[0] or cached[0][1] != key[1]:  # once per state: display, freeze
            as_of = self.superseded
            cached = self._static = (key, {"text/plain": cell_text(self.report, pinned=self.pinned, as_of=as_of),
                                           "text/html": cell_html(self.report, pinned=self.pinned, as_of=as_of)})
        return dict(cached[1])

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if not self.closed:
            data.update(self.box._repr_mimebundle_(**kwargs) or {})
        data.update(self.static_bundle())
        return data

    def __repr__(self) -> str:
        change = self.report.change
        cell = f" In [{change.execution_count}]" if change is not None and change.execution_count is not None else ""
        state = "closed" if self.closed else "live"
        return (f"<MemoryWidget{cell} {self.report.snapshot.device}: stale={self.report.snapshot.stale_bytes} B, "
                f"{'pinned, ' if self.pinned else ''}{state}>")


class CellWatch:
    """The after-cell hooks: cheap check, then (when memory changed) a widget under the cell."""

    def __init__(self, shell: InteractiveShell, settings: Any) -> None:
        # ``settings`` is the OomMagics instance: its traits are read on every cell.
        self.shell = shell
        self.settings = settings
        self.watcher = Watcher(history_limit=int(getattr(settings, "history_length", 10_000)))
        self.scan_cost = ScanCost()  # decides between a full scan and the quick view after a cell
        self.enabled = True
        self.hushed = False  # %%guardload --quiet: no widget under the running cell (its change is still recorded)
        self.warned_static = False  # "no ipywidgets" is said once, not under every cell
        self.live: list[MemoryWidget] = []
        self.pinned: MemoryWidget | None = None
        # Outputs of frozen widgets are rewritten only where a frontend shows them (a kernel).
        self.update_outputs = getattr(shell, "kernel", None) is not None
        # The exact callables registered, so unload removes exactly these.
        self._callbacks: dict[str, Callable[..., None]] = {"pre_run_cell": self.pre_run_cell,
                                                          "post_run_cell": self.post_run_cell}

    # -- registration (used by _extension) -------------------------------------------------------
    @property
    def latest(self) -> MemoryWidget | None:
        """The newest live widget (the pinned one while pinned), or None."""
        if self.pinned is not None and not self.pinned.closed:
            return self.pinned
        return next((w for w in reversed(self.live) if not w.closed), None)

    def callbacks(self) -> dict[str, Callable[..., None]]:
        """The event name → callback pairs to register; the same objects every time."""
        return dict(self._callbacks)

    def activate(self) -> None:
        """Make this watcher the target of ``watch.mark_cell``."""
        activate(self.watcher)

    def close(self) -> None:
        """Freeze every live widget and stop receiving ``mark_cell``."""
        deactivate(self.watcher)
        self.unpin()
        while self.live:
            self._freeze(self.live.pop(0))
        self.watcher.close()

    # -- hooks -----------------------------------------------------------------------------------
    def pre_run_cell(self, info: ExecutionInfo | None = None) -> None:
        """Read the device before a cell (microseconds; nothing when torch is not imported)."""
        self.hushed = False
        if not self.enabled:
            return
        try:
            self.watcher.before_cell()
        except Exception as exc:
            self._fail(exc)

    def post_run_cell(self, result: ExecutionResult) -> None:
        """Compare with the reading before the cell; show the widget when memory changed."""
        if not self.enabled:
            return
        try:
            self._after(result)
        except KeyboardInterrupt:
            pass  # the user interrupted a scan: no widget for this cell, the hook stays on
        except Exception as exc:
            self._fail(exc)

    def _after(self, result: ExecutionResult) -> None:
        started = time.perf_counter()
        if result is None:  # a Ctrl-C inside IPython's own cell bookkeeping: no cell to compare
            return
        info = getattr(result, "info", None)
        if info is not None and getattr(info, "silent", False):
            return
        settings = self.settings
        change = self.watcher.after_cell(result.execution_count, result.error_in_exec, self.shell.user_ns,
                                         Thresholds(settings.gpu_change_threshold, settings.cpu_change_threshold),
                                         source=getattr(info, "raw_cell", None))
        if change is None or self.hushed:
            return
        mode = settings.auto_display
        wanted = change.changed or change.oom or mode == "always"
        if self.pinned is not None:
            if wanted:
                self.pinned.show(self._report(change, started=started))
        elif mode != "off" and wanted:
            report = self._report(change, started=started)
            shown = time.perf_counter()
            self.show(report)
            self.scan_cost.learn_widget(time.perf_counter() - shown)

    def _fail(self, exc: BaseException) -> None:
        self.enabled = False
        message = (f"oom-magic: the after-cell memory check failed ({type(exc).__name__}: {exc}); "
                   "it is off now. Turn it back on with %gpumem --auto changes")
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # a warnings filter set to "error" must not reach the cell: say it plainly
            try:
                sys.stderr.write(message + "\n")
            except Exception:
                pass

    # -- widgets ---------------------------------------------------------------------------------
    def _report(self, change: CellChange | None, device: str | None = None, *,
                started: float | None = None) -> CellReport:
        """Scan the device (only here: something changed) and pair the snapshot with the change.

        A full scan runs when its predicted cost fits ``OomMagics.hook_budget_ms``; otherwise the
        quick view (a walk from your variables, cut off at the budget), and the widget says so.
        ``started``: when the hook began (its reading counts against the budget).
        """
        snap = self._budgeted_scan(change.device if change is not None else device, started)
        if change is not None:
            record = self.watcher.note_scan(snap, change.record)
            if record is not None:
                change = replace(change, record=record)
        return CellReport(change, snap)

    def show(self, report: CellReport) -> MemoryWidget | None:
        """Display a widget for ``report`` under the running cell; freeze the oldest beyond the cap."""
        from IPython.display import display

        limit = max(int(self.settings.live_widgets), 0)
        missing = _widgets_missing()
        if missing and not self.warned_static:
            self.warned_static = True
            warnings.warn(f"oom-magic: {missing}; showing the static view under each cell instead", stacklevel=2)
        if limit == 0 or missing:
            display(_Static(report))
            return None
        for older in self.live:  # their figures are of their own cells now: say so ("as of In [N]")
            older.supersede()
        widget = MemoryWidget(report, free=self._free_and_rescan)
        widget.handle = display(widget, display_id=True)
        self.live.append(widget)
        while len(self.live) > limit:
            self._freeze(self.live.pop(0))
        return widget

    def pin(self) -> MemoryWidget:
        """Display one live widget that updates after every cell that changes memory."""
        from IPython.display import display

        missing = _widgets_missing()
        if missing:
            raise OomMagicError(f"--pin needs a live widget, but {missing}")
        self.unpin()
        widget = MemoryWidget(self._report(None, device=self._watched_device()), free=self._free_and_rescan,
                              pinned=True)
        widget.handle = display(widget, display_id=True)
        self.pinned = widget
        return widget

    def unpin(self) -> None:
        """Freeze the pinned widget (it keeps its last state) and go back to one widget per cell."""
        if self.pinned is not None:
            widget, self.pinned = self.pinned, None
            self._freeze(widget)

    def _freeze(self, widget: MemoryWidget) -> None:
        if widget.closed:
            return
        if self.update_outputs and widget.handle is not None:
            try:
                widget.handle.update(widget.static_bundle(), raw=True)
            except Exception:
                pass  # the output may be gone (cleared cell); closing the models still matters
        widget.close()

    def _free_and_rescan(self, device: str) -> tuple[FreeReport, Snapshot]:
        freed = free_stale(device, shell=self.shell)
        return freed, self._full_scan(device, self.scan_cost.heap_blocks())

    def _budgeted_scan(self, device: str | None, started: float | None) -> Snapshot:
        """A full scan when it and the widget fit the after-cell budget, else the quick view, saying so."""
        blocks = self.scan_cost.heap_blocks()
        budget = max(int(getattr(self.settings, "hook_budget_ms", 50)), 0) / 1000
        spent = time.perf_counter() - started if started is not None else 0.0
        walk = self.scan_cost.quick_walk(blocks, budget - spent)
        if walk is None:
            return self._full_scan(device, blocks)
        # The walk's time is counted from here: collecting the roots and reading the device (4 ms and
        # more in a big namespace, before the walk's own clock) come out of it, not on top of it.
        begun = time.perf_counter()
        roots = collect_roots(self.shell)
        snap = snapshot(device, roots=roots, heap_scan=False, budget_seconds=walk - (time.perf_counter() - begun))
        self.scan_cost.learn_quick_view(time.perf_counter() - begun, walk)
        why = (f"quick view: to keep this view under {budget * 1000:,.0f} ms (OomMagics.hook_budget_ms), only the "
               "tensors your variables, the output cache and stored tracebacks hold were counted "
               f"(looking through all of memory would take about {self.scan_cost.predict(blocks) * 1000:,.0f} ms). "
               "Left out: garbage (objects that only refer to each other) and tensors a library keeps. "
               "%gpumem has the full picture.")
        cut = "" if snap.attribution_complete else (" The look also stopped at the time limit, so some tensors of "
                                                    "yours may be missing too.")
        # The snapshot's own quick-view and walk-stopped notes say the same in engine words: one note instead.
        rest = tuple(n for n in snap.notes if not n.startswith(("quick view:", "holder walk stopped")))
        return replace(snap, notes=(why + cut,) + rest)

    def _full_scan(self, device: str | None, blocks: int) -> Snapshot:
        """The whole heap scanned; its cost per allocated block is learnt for the next decision."""
        snap = snapshot(device, roots=collect_roots(self.shell))
        if snap.heap_passed:
            self.scan_cost.learn(snap.scan_seconds, blocks)
        return snap

    def _watched_device(self) -> str | None:
        from ..common._torch import loaded_torch

        torch = loaded_torch()
        return self.watcher.read(torch).device if torch is not None else None

    # -- %gpumem --auto / --pin / --plot -----------------------------------------------------------
    def status(self) -> WatchStatus:
        """The current mode, thresholds and how many cells were recorded."""
        s = self.settings
        return WatchStatus(s.auto_display, self.pinned is not None, self.enabled,
                           Thresholds(s.gpu_change_threshold, s.cpu_change_threshold), int(s.live_widgets),
                           len(self.watcher.history))

    def command(self, *, auto: str | None = None, pin: bool = False, plot: str | None = None,
                device: str | None = None) -> WatchStatus | Timeline:
        """Apply ``%gpumem --auto MODE``, ``--pin`` and ``--plot [PATH]``; return the status or the timeline."""
        if auto is not None:
            if auto not in MODES:
                raise OomMagicError(f"--auto takes one of {', '.join(MODES)}, not {auto!r}")
            self.settings.auto_display = auto
            self.enabled = True
            self.unpin()
        if pin:
            self.enabled = True
            self.pin()
        if plot is not None:
            return self.plot(plot or None, device)
        return self.status()

    def plot(self, path: str | None = None, device: str | None = None) -> Timeline:
        """The timeline of the recorded cells on ``device`` (default: the last cell's), saved to ``path``."""
        records: tuple[CellRecord, ...] = self.watcher.records()
        if device is not None:
            device = resolve_device(device)
        timeline = plot_timeline(records, device=device, path=path)
        if path is None and getattr(self.shell, "kernel", None) is None:
            # Terminal IPython draws no pictures: say where one goes instead of a bare repr.
            timeline = replace(timeline, note="this terminal shows no pictures: %gpumem --plot PATH saves the "
                                              "timeline as a PNG there (e.g. %gpumem --plot timeline.png)")
        return timeline


def _widgets_missing() -> str | None:
    """Why live widgets cannot be shown (ipywidgets absent), or None."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed (pip install 'ipywidgets>=8')"
    return None


class _Static:
    """The static view alone (``live_widgets = 0``): text/plain and text/html, no widget model."""

    def __init__(self, report: CellReport) -> None:
        self.report = report

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, str]:
        return {"text/plain": cell_text(self.report), "text/html": cell_html(self.report)}

