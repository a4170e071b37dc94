"""How a record is shown: one ``str`` / pretty / HTML delegation for every record type.

Renderers live in ``oom_magic.render`` and register here when that package is imported (the
package's ``__init__`` imports it), so a record never imports the code that draws it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable


@dataclass(frozen=True)
class Renderer:
    text: Callable[[Any], str]
    html: Callable[[Any], str | None] | None = None  # None from it: no HTML for this record
    pretty: Callable[[Any], str] | None = None  # IPython's terminal display, when it is not the text form


_RENDERERS: dict[type, Renderer] = {}


def renders(record_type: type, text: Callable[[Any], str], html: Callable[[Any], str | None] | None = None,
            pretty: Callable[[Any], str] | None = None) -> None:
    """Register how ``record_type`` is shown: ``text`` for str and the terminal, ``html`` for notebooks.

    ``pretty``: what IPython's terminal display shows when that is shorter than ``str`` (a summary).
    """
    _RENDERERS[record_type] = Renderer(text, html, pretty)


def renderer_for(record: object) -> Renderer | None:
    """The renderer registered for the record's type or its nearest registered base."""
    for cls in type(record).__mro__:
        found = _RENDERERS.get(cls)
        if found is not None:
            return found
    return None


class Shown:
    """Mixin: ``str(record)``, IPython's pretty printer and ``_repr_html_`` use the registered renderer."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # IPython's pretty printer walks the MRO and stops at the first class defining __repr__, which
        # @dataclass writes into every record: a _repr_pretty_ in the record's own dict comes first.
        cls._repr_pretty_ = Shown._repr_pretty_  # type: ignore[method-assign]

    def __str__(self) -> str:
        found = renderer_for(self)
        return found.text(self) if found is not None else repr(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        found = renderer_for(self)
        printer.text(found.pretty(self) if found is not None and found.pretty is not None else str(self))

    def _repr_html_(self) -> str | None:
        found = renderer_for(self)
        return found.html(self) if found is not None and found.html is not None else None
