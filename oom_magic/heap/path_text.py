"""The text a user would type for a path's steps (``render``: ``model.layers[3].mlp.up_proj.weight``,
``d['k'][2]``, ``head(.next ×199,600).value``), and what a step is.

``names.Namer`` writes the steps from the walk's parent links; ``resolve`` re-reads them. Steps are
plain tuples of strings and ints, so a path remembered for the next scan holds no reference.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from .reads import qualname
from .walk import Root

# A step is a tuple: ("attr", name) an attribute or slot; ("key", k) a dict value by a plain key;
# ("keytype", "Type") a dict value by a key shown by its type; ("keypath", id) a dict value keyed by
# an object named elsewhere (a parameter); ("iskey", "Type") the dict key itself; ("index", i);
# ("member", i) a set's i-th member; ("closure", i) a closure cell's contents; ("local", fn, name);
# ("cache",) an lru cache's result; ("flat", i) an object array's i-th item; ("via", "Type") an
# unnamed link; ("", ) a step shown as nothing (an instance's __dict__, a traceback).
Step = tuple

# Paths longer than this many steps are shown with their middle elided.
MAX_SHOWN_STEPS = 64
_MODULE_CHILD_DICTS = ("_parameters", "_buffers", "_modules")


# How the other steps read, the step's fields filling the blanks ({1} is step[1]).
_STEP_TEXT = {"keytype": "[<{1} key>]", "iskey": ".keys()[<{1}>]", "index": "[{1}]", "member": "{{#{1}}}",
              "closure": "[{1}]", "cell": ".cell_contents", "tb": "", "local": " → frame {1} → local {2}",
              "cache": ".cache[…]", "via": "→{1}", "elide": " …{1:,} more… ", "run": "(.{1} ×{2:,})",
              "genlocal": ".{1}.f_locals[{2!r}]"}


# -- showing and re-reading steps -----------------------------------------------------------------
def render(root: Root, steps: tuple[Step, ...], key_text: Callable[[int], str | None],
           module_type: type | None = None) -> str:
    """The path text a user would type: ``model.layers[3].mlp.up_proj.weight``, ``d['k'][2]``."""
    parts: list[str] = [root.name]
    as_attr = False  # the next key step names an attribute (an instance's or a module's __dict__)
    module_child = False  # the next key step names a module's parameter, buffer or submodule
    for step in steps:
        tag = step[0]
        text = ""
        if tag == "":
            if len(step) > 1 and step[1] == "__closure__":
                text = ".__closure__"
            elif len(step) > 1 and step[1] == "cache":
                text = ".cache"
            as_attr = len(step) == 1
            parts.append(text)
            continue
        if tag == "key":
            key = step[1]
            if module_child and type(key) is str:
                text = f"[{key}]" if key.isdigit() else f".{key}"
            elif as_attr and type(key) is str and key.isidentifier():
                text = f".{key}"
            elif as_attr and type(key) is str:  # an attribute no `obj.name` can spell: as it is reached
                text = f".__dict__[{_key_repr(key)}]"
            else:
                text = f"[{_key_repr(key)}]"
            module_child = as_attr and type(key) is str and key in _MODULE_CHILD_DICTS
            if module_child:
                parts.append("")
                as_attr = False
                continue
        elif tag == "attr":
            text = f".{step[1]}"
            module_child = step[1] in _MODULE_CHILD_DICTS
            if module_child:
                parts.append("")
                as_attr = False
                continue
        elif tag == "index":  # the commonest after attributes: no format call
            module_child = False
            text = f"[{step[1]}]"
        else:
            module_child = False
            if tag == "keypath":
                key_shown = key_text(step[1])
                # a key named only as this same dict's key (d.keys()[<T>]) reads d[<T key>], however the
                # walk reached it first: one name for one holder
                if key_shown is not None and key_shown.startswith(_joined(parts) + ".keys()[<"):
                    key_shown = None
                text = f"[{key_shown}]" if key_shown is not None else f"[<{step[2]} key>]"
            elif tag == "flat":
                text = f"[{step[1]}]" if len(step) > 2 and step[2] == 1 else f".flat[{step[1]}]"
            elif tag == "pandas":
                text = f"[{_key_repr(step[1])}].iloc[{step[2]}]"
            elif tag in _STEP_TEXT:
                text = _STEP_TEXT[tag].format(*step)
        as_attr = False
        parts.append(text)
    if len(parts) <= MAX_SHOWN_STEPS + 1:  # short enough whole (steps shown as nothing join as nothing)
        return "".join(parts)
    shown = [p for p in parts[1:] if p]
    if len(shown) > MAX_SHOWN_STEPS:
        shown = shown[:8] + [" … "] + shown[-8:]
    return parts[0] + "".join(shown)


def _joined(parts: list[str]) -> str:
    return parts[0] + "".join(p for p in parts[1:] if p)


def _key_repr(key: Any) -> str:
    try:
        text = repr(key)  # plain keys only: str, int, float, bool, bytes, None
    except Exception:
        return f"<{qualname(type(key))} key>"
    return text if len(text) <= 80 else text[:77] + "..."
