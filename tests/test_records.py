"""Records are shown through the renderer registry: str, IPython's pretty printer and HTML agree."""
from __future__ import annotations

from dataclasses import dataclass

from IPython.lib.pretty import pretty

from oom_magic.records.shown import Shown, renderer_for, renders


@dataclass(frozen=True)
class _Box(Shown):
    used: int


@dataclass(frozen=True)
class _SmallBox(_Box):
    pass


def test_a_registered_record_is_shown_by_its_renderer_in_str_pretty_and_html() -> None:
    renders(_Box, lambda r: f"box uses {r.used} B", lambda r: f"<b>{r.used}</b>")
    box = _Box(512)
    assert str(box) == "box uses 512 B"
    # @dataclass writes __repr__ into the class; IPython's pretty printer must still use the renderer.
    assert pretty(box) == "box uses 512 B"
    assert box._repr_html_() == "<b>512</b>"
    assert repr(box) == "_Box(used=512)"


def test_a_subclass_uses_its_nearest_registered_base() -> None:
    renders(_Box, lambda r: f"box uses {r.used} B")
    small = _SmallBox(1)
    assert renderer_for(small) is renderer_for(_Box(0))
    assert pretty(small) == "box uses 1 B"
    assert small._repr_html_() is None
