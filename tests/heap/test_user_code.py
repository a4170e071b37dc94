"""Tensors held by the user's own classes and modules are user-held, named as the user types them.

A user's own class is defined in a cell (``__main__``) or in a module imported from the
notebook's folder; a module from anywhere else (site-packages, the standard library) is not
the user's, and what its globals hold stays ``other``. Checked through ``%gpumem -o`` in a real
shell, on the first scan (walked) and the next (remembered paths, re-checked).
"""
from __future__ import annotations

import sys
import textwrap

import pytest

from oom_magic.heap.holders import forget_paths
from tests.heap import count_climbs

MODULE = textwrap.dedent('''
    import torch
    CACHE = [torch.ones(10 + i) for i in range(5)]

    class Inner:
        table = torch.ones(20)

    def __getattr__(name):
        raise AttributeError(name)
''')


# A library's functions holding tensors as default arguments (peft's LoHa layer holds `scale` so).
LIBRARY_FUNCTIONS = textwrap.dedent('''
    import torch

    class Hada(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale=torch.ones(50)):
            return x * scale

    class Plain:
        @classmethod
        def make(cls, *, table=torch.ones(60)):
            return table

    def helper(x, bias=torch.ones(70)):
        return x + bias

    def factory():
        def inner(x, hidden=torch.ones(80)):
            return x
        return inner

    KEPT = [factory()]
''')


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A notebook folder (the working directory) with a module of the user's, and a library folder."""
    folder = tmp_path / "notebook"
    library = tmp_path / "elsewhere"
    folder.mkdir()
    library.mkdir()
    (folder / "mymod.py").write_text(MODULE)
    (library / "libmod.py").write_text("import torch\nGLOBAL = torch.ones(40)\n")
    (library / "libfuncs.py").write_text(LIBRARY_FUNCTIONS)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.syspath_prepend(str(library))
    yield folder
    for name in ("mymod", "libmod", "libfuncs"):
        sys.modules.pop(name, None)


def _paths(snap, kind: str) -> dict[str, int]:
    return {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == kind}


def test_a_cell_classes_attributes_are_user_held(ip):
    assert ip.run_cell("import torch\nclass Cfg:\n    table = torch.ones(30)\n    other = {'k': torch.ones(31)}\n",
                       store_history=True).success
    forget_paths()
    for _ in range(2):  # walked, then remembered and re-checked
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = _paths(snap, "user")
        assert user["Cfg.table"] == 120 and user["Cfg.other['k']"] == 124


def test_a_user_modules_globals_and_classes_are_user_held_by_the_name_imported(ip, user_modules):
    assert ip.run_cell("import torch\nimport mymod as mm\nimport libmod", store_history=True).success
    forget_paths()
    for _ in range(2):
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = _paths(snap, "user")
        assert user["mm.CACHE[3]"] == 13 * 4 and user["mm.Inner.table"] == 80
        assert {p for p in user if p.startswith("mm.CACHE")} == {f"mm.CACHE[{i}]" for i in range(5)}
        # A module from outside the notebook's folder is a library's: its tensor is not the user's.
        other = _paths(snap, "other")
        assert "libmod.GLOBAL" in other and not any("libmod" in p for p in user)


def test_a_user_module_no_variable_names_is_named_by_its_module(ip, user_modules):
    assert ip.run_cell("import torch\nfrom mymod import Inner", store_history=True).success
    snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
    user = _paths(snap, "user")
    assert user["Inner.table"] == 80 and user["mymod.CACHE[0]"] == 40


def test_a_library_held_tensor_is_reverified_then_claimed_by_a_variable(ip, user_modules, monkeypatch):
    """Held by a library module alone: 'other', re-verified next scan without climbing the heap's
    referrers; once a variable takes it, it is the user's."""
    assert ip.run_cell("import torch\nimport libmod", store_history=True).success
    forget_paths()
    first = _paths(ip.run_line_magic("gpumem", "-o --device cpu --all"), "other")
    assert first.get("libmod.GLOBAL") == 160
    climbs = count_climbs(monkeypatch)
    again = _paths(ip.run_line_magic("gpumem", "-o --device cpu --all"), "other")
    assert again.get("libmod.GLOBAL") == 160 and climbs == []
    assert ip.run_cell("mine = libmod.GLOBAL", store_history=True).success
    user = _paths(ip.run_line_magic("gpumem", "-o --device cpu --all"), "user")
    assert user["mine"] == 160


def test_a_test_harness_modules_are_not_the_notebooks() -> None:
    """This suite's own modules sit in the working folder but hold the shells they drive: never user roots."""
    from pathlib import Path

    from oom_magic.heap import user_code

    root = str(Path(__file__).resolve().parents[2])
    assert "tests" in user_code.HARNESS_PREFIXES  # set by tests/conftest.py
    names = set(user_code.user_module_names(root).values())
    assert not {n for n in names if n == "tests" or n.startswith("tests.")}
    assert "tests.conftest" in __import__("sys").modules  # there to be judged, and judged not the user's


def test_a_library_functions_default_arguments_are_named_by_the_function_without_a_climb(ip, user_modules,
                                                                                        monkeypatch):
    """A tensor a library function holds as a default (a staticmethod of an autograd Function, a
    classmethod's keyword default, a module function) is named by the function's module and
    qualified name, found with no garbage search nor climb through the heap's referrers; a nested
    function, which no name reaches, is searched and climbed to as before."""
    from oom_magic.heap import holders

    assert ip.run_cell("import torch\nimport libfuncs\ndel libfuncs", store_history=True).success
    functions = sys.modules["libfuncs"]
    named = {id(functions.Hada.forward.__defaults__[0]), id(functions.Plain.make.__kwdefaults__["table"]),
             id(functions.helper.__defaults__[0])}
    del functions
    forget_paths()
    searched: set[int] = set()  # ids of the tensors the garbage search (a climb of the referrers) was given
    real = holders.garbage_storages
    monkeypatch.setattr(holders, "garbage_storages",
                        lambda live, unclaimed, **kw: searched.update(map(id, unclaimed)) or real(live, unclaimed, **kw))
    for _ in range(2):
        other = _paths(ip.run_line_magic("gpumem", "-o --device cpu --all"), "other")
        assert other["libfuncs.Hada.forward.__defaults__[0]"] == 200
        assert other["libfuncs.Plain.make.__kwdefaults__['table']"] == 240
        assert other["libfuncs.helper.__defaults__[0]"] == 280
        assert [p for p, b in other.items() if b == 320 and "__defaults__" not in p], other  # climbed to
        assert not _paths(ip.run_line_magic("gpumem", "-o --device cpu --all"), "user").keys() & other.keys()
    assert searched and not searched & named  # the nested function's default alone is searched for
