"""The %freeall record: what a cleanup gave back, by holder kind, and what still holds a deleted name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .shown import Shown
from .snapshot import HolderKind

if TYPE_CHECKING:  # annotation only: the reading's record lives beside the code that reads it
    from .device import DeviceReading


@dataclass(frozen=True)
class StillHeld(Shown):
    """A deleted variable whose memory something else still holds."""

    name: str
    bytes: int
    holders: tuple[str, ...]

    def sentence(self) -> str:
        """"`model` deleted; its 12.55 GiB are still held by `model2` and `opt.state`" (its renderer's text)."""
        return str(self)


@dataclass(frozen=True)
class FreeReport(Shown):
    """What a cleanup gave back, by holder kind, with the device reading before and after."""

    device: str
    freed_bytes: int
    freed_by_kind: tuple[tuple[HolderKind, int], ...]
    before: DeviceReading
    after: DeviceReading
    deleted: tuple[str, ...] = ()
    still_held: tuple[StillHeld, ...] = ()
    dry_run: bool = False
    notes: tuple[str, ...] = ()
    # cpu: of freed_bytes, views of a memory-mapped file: file pages, so no memory came back for them;
    # None where not read (a GPU, not Linux).
    freed_mapped: int | None = None

    @property
    def resident_freed(self) -> int | None:
        """cpu: the resident memory (RSS) that really came back; tensors mapped from a file were never resident."""
        if self.device != "cpu" or self.dry_run:
            return None
        before, after = self.before.process_used, self.after.process_used
        return None if before is None or after is None else before - after

    def kind_bytes(self, kind: HolderKind) -> int:
        """Bytes freed (or, in a dry run, freeable) from one holder kind."""
        return dict(self.freed_by_kind).get(kind, 0)

    def __repr__(self) -> str:
        return f"<FreeReport {self.device}: freed={self.freed_bytes} B{' (dry run)' if self.dry_run else ''}>"
