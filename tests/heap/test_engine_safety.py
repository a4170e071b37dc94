"""The heap engine runs no user code, hashes or compares no user type, and pins nothing on Ctrl-C.

Instrumented classes record every call of their dunders, properties and ``__torch_function__``
once armed; %gpumem, %freeall, the after-cell hook, the guard and ``snapshot()`` must leave the
record empty and still count and name every tensor they hold.
"""
from __future__ import annotations

import gc
import sys
import textwrap
import warnings
import weakref

import pytest
import torch

import oom_magic
from oom_magic.heap import walk as walk_module
from oom_magic.heap.holders import forget_paths

SETUP = textwrap.dedent('''
    import torch
    CALLS = []
    ARMED = [False]

    def note(what):
        if ARMED[0]:
            CALLS.append(what)

    class Meta(type):
        """__eq__ without __hash__: its classes are unhashable (a set or dict of types raises)."""
        def __eq__(cls, other):
            note("Meta.__eq__")
            return cls is other

    class Weird(metaclass=Meta):
        pass

    class Recorder:
        def __getattr__(self, name):
            note("__getattr__:" + name)
            raise AttributeError(name)
        def __getattribute__(self, name):
            note("__getattribute__:" + name)
            return object.__getattribute__(self, name)
        def __eq__(self, other):
            note("__eq__")
            return self is other
        def __hash__(self):
            note("__hash__")
            return 1
        def __repr__(self):
            note("__repr__")
            return "Recorder()"
        def __len__(self):
            note("__len__")
            return 0
        def __iter__(self):
            note("__iter__")
            return iter(())
        @property
        def lazy(self):
            note("property")
            return torch.ones(1)

    class cell:
        """A user class named like CPython's closure cell type."""
        def __getattr__(self, name):
            note("cell.__getattr__:" + name)
            raise AttributeError(name)

    class ArgsError(Exception):
        @property
        def args(self):
            note("ArgsError.args")
            return ()

    class Slow(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            note("__torch_function__")
            return super().__torch_function__(func, types, args, kwargs)
        @property
        def grad(self):
            note("Slow.grad")
            return None

    class Spied(tuple):
        """A record tuple with no fields of its own (read as a tuple), its methods instrumented."""
        __slots__ = ()
        def __iter__(self):
            note("Spied.__iter__")
            return tuple.__iter__(self)
        def __len__(self):
            note("Spied.__len__")
            return tuple.__len__(self)
        def __getitem__(self, i):
            note("Spied.__getitem__")
            return tuple.__getitem__(self, i)

    class SpyDict(dict):
        """A dict subclass with an attribute of its own, its methods instrumented."""
        def __getattribute__(self, name):
            note("SpyDict.__getattribute__:" + name)
            return dict.__getattribute__(self, name)
        def __iter__(self):
            note("SpyDict.__iter__")
            return dict.__iter__(self)
        def values(self):
            note("SpyDict.values")
            return dict.values(self)
        def keys(self):
            note("SpyDict.keys")
            return dict.keys(self)

    recorder = Recorder()
    recorder.weights = torch.ones(100)
    spied = [Spied((i, torch.ones(100))) for i in range(3)]
    spy_dict = SpyDict(k=torch.ones(100))
    spy_dict.t = torch.ones(100)
    keyed = {Recorder(): torch.ones(200)}
    c = cell()
    c.t = torch.ones(300)
    err = ArgsError("failed")
    err.payload = torch.ones(400)
    slow = torch.ones(500).as_subclass(Slow)
    weird = Weird()
    weird.t = torch.ones(600)
    weird_types = [Weird, Meta, (Weird, torch.ones(700))]
    ARMED[0] = True
''')


@pytest.fixture
def armed(ip):
    result = ip.run_cell(SETUP, store_history=True)
    assert result.success, result
    ns = ip.user_ns
    yield ns
    ns["ARMED"][0] = False


def _run(ip, source: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ip.run_cell(source, store_history=True)
    assert not [w for w in caught if "oom-magic" in str(w.message)]
    return result


def _check_counts(snap) -> None:
    assert snap.held_by("recorder") == 400
    assert snap.held_by("keyed") == 800
    assert snap.held_by("c") == 1200
    assert snap.held_by("err") == 1600
    assert snap.held_by("slow") == 2000
    assert snap.held_by("weird") == 2400
    assert snap.held_by("weird_types") == 2800
    assert snap.held_by("spied") == 1200
    assert snap.held_by("spy_dict") == 800


def test_no_user_code_runs_in_any_magic_the_hook_the_guard_or_snapshot(ip, armed):
    calls = armed["CALLS"]
    forget_paths()
    snap = oom_magic.snapshot("cpu")
    assert calls == []
    _check_counts(snap)
    paths = {g.path for g in snap.holders("user")}
    # A user type as a key is never shown by its repr, and has one name however the walk reached it first.
    assert {"keyed[<Recorder key>]", "recorder.weights", "c.t", "err.payload", "slow", "weird.t",
                                "weird_types[2][1]", "spied[0][1]", "spied[2][1]", "spy_dict.t",
                                "spy_dict['k']"} <= paths, paths

    again = oom_magic.snapshot("cpu")  # remembered paths, re-checked
    assert calls == [] and {g.path for g in again.holders("user")} == paths

    snap = ip.run_line_magic("gpumem", "-o --all")
    str(snap), snap._repr_html_(), snap.to_json_text()
    _check_counts(snap)
    assert calls == []

    ip.run_line_magic("gpumem", "--auto always")
    assert _run(ip, "extra = torch.ones(50)").success
    watch = ip.magics_manager.registry["OomMagics"].cell_watch
    assert watch.enabled and watch.live[-1].report.snapshot.held_by("extra") == 200
    assert calls == []

    assert ip.run_line_magic("freeall", "--dry-run").dry_run
    freed = ip.run_line_magic("freeall", "")
    assert freed.device == "cpu" and calls == []
    report = ip.run_cell_magic("guardload", "--quiet", "loaded = torch.zeros(64)\n")
    assert report.outcome == "ok" and calls == []
    assert armed["slow"].sum().item() == 500  # (torch functions on it run only now, by the test)
    assert calls and set(calls) == {"__torch_function__"}  # the instrument works


def test_a_metaclass_without_hash_anywhere_breaks_nothing(ip, armed):
    """A class whose metaclass defines __eq__ alone cannot be hashed: the engine never tries."""
    _run(ip, "import gc\nstray = [Weird]\nbox = {'k': (Meta, Weird, torch.ones(10))}")
    ip.run_line_magic("gpumem", "--auto always")
    assert _run(ip, "more = torch.ones(20)").success
    assert ip.magics_manager.registry["OomMagics"].cell_watch.enabled
    snap = ip.run_line_magic("gpumem", "-o")
    assert snap.held_by("box") == 40 and snap.held_by("more") == 80
    assert ip.run_line_magic("freeall", "").device == "cpu"
    assert armed["CALLS"] == []


def test_ctrl_c_during_a_scan_pins_nothing(ip, monkeypatch):
    _run(ip, "import torch\nbig = [torch.ones(1000) for _ in range(3)]\nrows = [{'i': i} for i in range(5000)]")
    ref = weakref.ref(ip.user_ns["big"][1])
    real_mark = walk_module.Walk._mark
    hit = []

    def interrupted(self, kids, parents, *once):
        if not hit:
            hit.append(1)
            raise KeyboardInterrupt
        return real_mark(self, kids, parents, *once)

    monkeypatch.setattr(walk_module.Walk, "_mark", interrupted)
    forget_paths()
    enabled = gc.isenabled()
    result = ip.run_cell("%gpumem", store_history=True)
    assert hit and isinstance(result.error_in_exec, KeyboardInterrupt)
    assert gc.isenabled() is enabled  # the user's setting is back as it was
    monkeypatch.setattr(walk_module.Walk, "_mark", real_mark)
    # IPython keeps the traceback (sys.last_traceback); deleting the variable must free the tensors.
    _run(ip, "del big")
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("enabled", [True, False])
def test_a_users_gc_setting_survives_every_scan(ip, enabled):
    _run(ip, "import torch\nt = torch.ones(10)")
    (gc.enable if enabled else gc.disable)()
    try:
        ip.run_line_magic("gpumem", "")
        ip.run_line_magic("freeall", "")
        after = gc.isenabled()
    finally:
        gc.enable()
    assert after is enabled


def test_the_deadline_is_checked_inside_one_huge_container():
    """A 620k-item set is read a slice at a time with the clock checked between slices."""
    from oom_magic.heap.holders import attribute_reachable
    from oom_magic.heap.roots import Roots
    from oom_magic.heap.tracker import tensor_types

    big = {(i, _Tracked()) for i in range(620_000)}
    live, attribution = attribute_reachable(Roots(user=(("big", big),)), torch, tensor_types(torch), "cpu",
                                            budget_seconds=0.0)
    live.release()
    assert not attribution.complete
    assert 0 < attribution.nodes_walked < 100_000  # stopped inside the set, not after reading all of it


class _Tracked:
    """A gc-tracked object (its instances keep the tuples holding them tracked)."""


def test_the_users_classes_and_modules_are_read_without_user_code(ip, armed, tmp_path, monkeypatch):
    """Class attributes (a metaclass with __getattribute__/__eq__) and a user module's globals (a
    module __getattr__) are roots: reading them calls none of the user's dunders."""
    (tmp_path / "loudmod.py").write_text(textwrap.dedent('''
        import torch
        CALLS = []
        def __getattr__(name):
            CALLS.append("module.__getattr__:" + name)
            raise AttributeError(name)
        HELD = [torch.ones(900)]
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        armed["ARMED"][0] = False
        assert _run(ip, textwrap.dedent('''
            import loudmod
            class Loud(type):
                def __getattribute__(cls, name):
                    note("Loud.__getattribute__:" + name)
                    return type.__getattribute__(cls, name)
                def __eq__(cls, other):
                    note("Loud.__eq__")
                    return cls is other
                __hash__ = None
            class Cfg(metaclass=Loud):
                table = torch.ones(800)
                rec = Recorder()
            ARMED[0] = True
        ''')).success
        calls = armed["CALLS"]
        forget_paths()
        for _ in range(2):
            snap = ip.run_line_magic("gpumem", "-o --all")
            user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
            assert user["Cfg.table"] == 3200 and user["loudmod.HELD[0]"] == 3600
            _check_counts(snap)
        assert calls == [] and sys.modules["loudmod"].CALLS == []
    finally:
        armed["ARMED"][0] = False
        sys.modules.pop("loudmod", None)


def test_tensors_frozen_by_gc_freeze_are_outside_the_scan_and_the_report_says_so():
    # gc.get_objects() skips the permanent generation gc.freeze() moves objects to (servers freeze
    # their heap after start-up): the scan cannot see those tensors, so the report must say so.
    frozen = torch.ones(12_345)
    address = frozen.untyped_storage().data_ptr()
    gc.collect()
    gc.freeze()
    try:
        snap = oom_magic.snapshot("cpu")
    finally:
        gc.unfreeze()
    assert address not in {s.address for s in snap.storages}
    assert any("frozen by gc.freeze()" in note and "gc.unfreeze()" in note for note in snap.notes), snap.notes
    seen = oom_magic.snapshot("cpu")
    assert address in {s.address for s in seen.storages}
    assert not any("gc.freeze()" in note for note in seen.notes)
