"""The IPython magics: thin adapters from argument strings to the pure core."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Int

from .cleanup import FreeReport, free_stale
from .errors import OomMagicError
from .roots import collect_roots
from .snapshot import Snapshot, snapshot

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


@magics_class
class OomMagics(Magics):
    """%gpumem, %freeall (and, with later modules, %%guardload)."""

    top = Int(10, help="How many holders %gpumem lists when --top is not given.").tag(config=True)

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)

    @magic_arguments()
    @argument("--device", "-d", default=None, help="Device to show: cuda, cuda:N, cpu or mps (default: the current CUDA device, else cpu).")
    @argument("--top", "-n", type=int, default=None, help="How many holders to list (default: OomMagics.top).")
    @argument("--all", "-a", action="store_true", help="List every holder, not only the top N.")
    @argument("--json", action="store_true", help="Show the snapshot as JSON instead of a table.")
    @line_magic
    def gpumem(self, line: str = "") -> Snapshot:
        """Show what uses a device's memory and which variable holds it; returns the Snapshot."""
        args = parse_argstring(self.gpumem, line)
        top = 0 if args.all else (args.top if args.top is not None else self.top)
        if top < 0:
            raise UsageError(f"--top must be 0 or more, not {top}")
        try:
            snap = snapshot(args.device, roots=collect_roots(self.shell), top=top)
        except OomMagicError as exc:
            raise UsageError(str(exc)) from None
        return replace(snap, view="json") if args.json else snap

    @magic_arguments()
    @argument("names", nargs="*", help="Variables to delete first (as %%xdel does, output cache included); without names only stale memory is freed.")
    @argument("--device", "-d", default=None, help="Device to free on: cuda, cuda:N, cpu or mps (default: the current CUDA device, else cpu).")
    @argument("--dry-run", action="store_true", help="Report what would be freed; change nothing.")
    @line_magic
    def freeall(self, line: str = "") -> FreeReport:
        """Free stale memory (output cache, stored tracebacks, garbage) without touching a user variable."""
        args = parse_argstring(self.freeall, line)
        try:
            return free_stale(args.device, names=args.names, dry_run=args.dry_run, shell=self.shell)
        except OomMagicError as exc:
            raise UsageError(str(exc)) from None
