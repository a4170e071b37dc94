"""The README's usage lines list every flag the magics and the command accept, and no other."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from oom_magic.cli import build_parser
from oom_magic.notebook.magics import OomMagics

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def usage_line(command: str) -> str:
    """The README heading ``### `COMMAND [...]` ``, its bracketed part."""
    match = re.search(rf"^### `{re.escape(command)}( [^`]*)?`$", README, re.M)
    assert match, f"no usage heading for {command} in the README"
    return match.group(1) or ""


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", text))


def parser_flags(parser) -> set[str]:
    """Every option string but --help/-h, keeping one spelling per option: the long one, else the short."""
    flags = set()
    for action in parser._actions:
        strings = [s for s in action.option_strings if s not in ("-h", "--help")]
        if strings:
            longs = [s for s in strings if s.startswith("--")]
            flags.add(longs[0] if longs else strings[0])
    return flags


@pytest.mark.parametrize("command, magic", [("%gpumem", "gpumem"), ("%freeall", "freeall"),
                                            ("%%guardload", "guardload")])
def test_readme_usage_lists_every_magic_flag(command, magic):
    parser = getattr(OomMagics, magic).parser
    assert flags_in(usage_line(command)) == parser_flags(parser)


def test_readme_usage_lists_every_fit_command_flag():
    fit = build_parser()._subparsers._group_actions[0].choices["fit"]
    assert flags_in(usage_line("oom-magic fit CHECKPOINT")) == parser_flags(fit)


def test_readme_documents_what_new_users_asked_about():
    for words in ("g.report", "GuardReport", "**CUDA only**", "no untracked", "`-o`", "exits **0**",
                  "oom_magic.fit_check("):
        assert words in README, words
    assert "shown as n/a" not in README
