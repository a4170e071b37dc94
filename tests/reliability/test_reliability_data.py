"""Lose no data: property tests (hypothesis) over random sessions run as real cells.

Each example runs a random sequence of cells in the real IPython shell: tensors, aliases, nested
containers (lists, dicts, tuples, sets), nn.Modules, optimizers that have taken a step, closures,
plain objects, modules bound to names, exceptions stored in variables (frames and all), deletions,
and what makes memory stale: tensors shown as a cell's result (``Out[N]``), results that are a
user's own variable, failed cells whose frames hold tensors (and user variables), re-raised stored
exceptions, and garbage cycles. Before and after a cleanup every user variable is fingerprinted:
its identity and its value, tensors compared element by element (module state, optimizer state,
closure cells, exception args and frame locals included).

Properties:
- ``%freeall`` with no names (or the widget button, which calls the same function): every user
  variable is present, the same object, and equal to before; a second run finds nothing left.
- ``%freeall NAME``: only NAME is gone; every other variable is the same object, equal to before.
- a failure injected part-way through ``%freeall NAME`` either leaves every variable in place
  (when it raises) or completes the deletion and says in a note what it could not do.

No fakes: failures are injected by wrapping the real cleanup's helpers (labelled where used).
"""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from oom_magic.heap import cleanup
from oom_magic.heap.roots import is_user_name

SETUP = '''
import math, torch
from dataclasses import dataclass

def _make_closure(held):
    def read():
        return held
    return read

def _raise_with_local(n):
    local_tensor = torch.full((n,), 7.0)
    raise ValueError("failed with a local tensor")

def _raise_with(value):
    also = [value, torch.ones(3)]
    raise KeyError("failed holding a user value")

@dataclass
class _Box:
    left: object
    right: object
'''

PROPERTY = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

pytestmark = pytest.mark.usefixtures("fresh_heap")



# --------------------------------------------------------------------------- random sessions


@st.composite
def sessions(draw: st.DrawFn) -> list[str]:
    """Cells that build a namespace and leave stale memory behind."""
    cells: list[str] = []
    kinds: dict[str, str] = {}  # variable -> what it holds
    for step in range(draw(st.integers(3, 9))):
        name = f"v{step}"
        existing = sorted(kinds)
        pick = draw(st.sampled_from(existing)) if existing else None
        kind = draw(st.sampled_from([
            "tensor", "tensor", "alias", "nested", "module", "optimizer", "closure", "stored-exception",
            "module-object", "object", "delete", "out-fresh", "out-alias", "out-container", "traceback",
            "traceback-user", "raise-stored", "garbage",
        ]))
        n = draw(st.integers(1, 64))
        modules = [k for k, v in kinds.items() if v == "module"]
        errors = [k for k, v in kinds.items() if v == "stored-exception"]
        if kind == "tensor" or (pick is None and kind in ("alias", "nested", "object", "delete", "out-alias",
                                                          "out-container", "traceback-user")):
            cells.append(f"{name} = torch.randn({n})")
            kinds[name] = "tensor"
        elif kind == "alias":
            cells.append(f"{name} = {pick}")
            kinds[name] = kinds[pick]
        elif kind == "nested":
            cells.append(f"{name} = [{pick}, {{'k': (torch.randn(3), 's', 1)}}, ({{torch.ones(2)}}, [[{pick}]])]")
            kinds[name] = "nested"
        elif kind == "module":
            cells.append(f"{name} = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))")
            kinds[name] = "module"
        elif kind == "optimizer" and modules:
            target = draw(st.sampled_from(modules))
            cells.append(f"{name} = torch.optim.Adam({target}.parameters(), lr=0.1)\n"
                         f"{target}(torch.randn(2, 3)).sum().backward()\n{name}.step()")
            kinds[name] = "optimizer"
        elif kind == "closure":
            cells.append(f"{name} = _make_closure(torch.randn({n}))")
            kinds[name] = "closure"
        elif kind == "stored-exception":
            cells.append(f"try:\n    _raise_with_local({n})\nexcept Exception as _caught:\n    {name} = _caught")
            kinds[name] = "stored-exception"
        elif kind == "module-object":
            cells.append(f"{name} = {draw(st.sampled_from(['math', 'torch.nn.functional', 'torch']))}")
            kinds[name] = "module-object"
        elif kind == "object":
            cells.append(f"{name} = _Box({pick}, torch.randn({n}))")
            kinds[name] = "object"
        elif kind == "delete":
            cells.append(f"del {pick}")
            del kinds[pick]
        elif kind == "out-fresh":
            cells.append(f"torch.randn({n}) * 2")
        elif kind == "out-alias":
            cells.append(f"{pick}")
        elif kind == "out-container":
            cells.append(f"[{pick}, torch.randn({n})]")
        elif kind == "traceback":
            cells.append(f"_raise_with_local({n})")
        elif kind == "traceback-user":
            cells.append(f"_raise_with({pick})")
        elif kind == "raise-stored" and errors:
            cells.append(f"raise {draw(st.sampled_from(errors))}")
        elif kind == "garbage":
            cells.append(f"_cycle = [torch.randn({n})]\n_cycle.append(_cycle)\ndel _cycle")
        else:
            cells.append(f"{name} = torch.randn({n})")
            kinds[name] = "tensor"
    return cells


# --------------------------------------------------------------------------- fingerprints


def fingerprint(value: Any, seen: dict[int, Any] | None = None) -> Any:
    """Identity and value of everything a variable reaches (tensors copied, cycles cut)."""
    seen = {} if seen is None else seen
    key = id(value)
    if key in seen:
        return ("seen", key)
    seen[key] = value
    if isinstance(value, torch.Tensor):
        grad = value.grad if value.is_leaf and value.grad is not None else None
        return ("tensor", key, value.detach().clone(), None if grad is None else grad.clone())
    if isinstance(value, torch.nn.Module):
        state = [(n, fingerprint(t, seen)) for n, t in value.state_dict(keep_vars=True).items()]
        return ("module", key, state)
    if isinstance(value, torch.optim.Optimizer):
        state = [(id(p), sorted((k, fingerprint(v, seen)) for k, v in s.items())) for p, s in value.state.items()]
        groups = [(g["lr"], [id(p) for p in g["params"]]) for g in value.param_groups]
        return ("optimizer", key, state, groups)
    if isinstance(value, types.FunctionType):
        cells = [fingerprint(c.cell_contents, seen) for c in value.__closure__ or ()]
        return ("function", key, cells)
    if isinstance(value, BaseException):
        frames = []
        tb = value.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            local = frame.f_locals if frame.f_code.co_flags & 0x1 else {}
            frames.append((frame.f_code.co_name, sorted((k, fingerprint(v, seen)) for k, v in local.items())))
            tb = tb.tb_next
        return ("exception", key, [fingerprint(a, seen) for a in value.args], frames)
    if isinstance(value, types.ModuleType):
        return ("module-object", key)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, key, [fingerprint(v, seen) for v in value])
    if isinstance(value, (set, frozenset)):
        return ("set", key, sorted(id(v) for v in value), [fingerprint(v, seen) for v in sorted(value, key=id)])
    if isinstance(value, dict):
        return ("dict", key, [(fingerprint(k, seen), fingerprint(v, seen)) for k, v in value.items()])
    if type(value).__name__ == "_Box":
        return ("box", key, fingerprint(vars(value), seen))
    if isinstance(value, type) or callable(value):
        return ("object", key)
    return ("plain", key if not isinstance(value, (int, str, float, bool, type(None))) else None, repr(value))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def user_state(ip) -> dict[str, tuple[int, Any]]:
    return {k: (id(v), fingerprint(v)) for k, v in list(ip.user_ns.items()) if is_user_name(k)}


def assert_unchanged(before: dict[str, tuple[int, Any]], after: dict[str, tuple[int, Any]], gone: set[str] = frozenset()) -> None:
    assert set(after) == set(before) - set(gone), (set(before) ^ set(after))
    for name in after:
        assert after[name][0] == before[name][0], f"{name} was rebound"
        assert same(after[name][1], before[name][1]), f"{name} changed"


def play(ip, cells: list[str]) -> None:
    ip.run_cell("%reset -f", store_history=False)
    assert ip.run_cell(SETUP, store_history=True).success
    for cell in cells:
        ip.run_cell(cell, store_history=True)  # failing cells are part of the session


# --------------------------------------------------------------------------- properties


@PROPERTY
@given(cells=sessions(), via=st.sampled_from(["magic", "magic", "button"]), data=st.data())
def test_freeall_keeps_every_variable_and_freeall_name_removes_only_name(ip, cells: list[str], via: str,
                                                                          data: st.DataObject) -> None:
    play(ip, cells)
    before = user_state(ip)
    if via == "magic":
        report = ip.run_line_magic("freeall", "")
    else:  # the widget's button: the same cleanup, then a rescan
        report, snap = ip.magics_manager.registry["OomMagics"].cell_watch._free_and_rescan("cpu")
        assert snap.stale_bytes == 0
    assert report.deleted == () and report.freed_bytes >= 0
    assert_unchanged(before, user_state(ip))
    assert ip.run_line_magic("freeall", "").freed_bytes == 0  # nothing stale was left behind

    candidates = sorted(k for k in before if k.startswith("v"))
    if not candidates:
        return
    name = data.draw(st.sampled_from(candidates), label="name")
    before = user_state(ip)
    report = ip.run_line_magic("freeall", name)
    assert report.deleted == (name,)
    assert_unchanged(before, user_state(ip), gone={name})


def _failing_after(calls: int, what: str) -> Any:
    """FAKE fault: a callable that works ``calls`` times, then raises (wraps the real helper)."""
    count = {"n": 0}

    def wrap(real: Any) -> Any:
        def failing(*args: Any, **kwargs: Any) -> Any:
            count["n"] += 1
            if count["n"] > calls:
                raise RuntimeError(f"injected failure in {what}")
            return real(*args, **kwargs)

        return failing

    return wrap


SITES = ["attribute", "_drop_output_refs", "clear_frames", "forget_last_exception", "gc.collect", "empty_cache",
         "find_tensors", "read_device", "_still_held"]


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cells=sessions(), site=st.sampled_from(SITES), calls=st.integers(0, 2), data=st.data())
def test_a_freeall_that_fails_part_way_leaves_the_namespace_whole(ip, cells: list[str], site: str, calls: int,
                                                                  data: st.DataObject) -> None:
    play(ip, cells)
    candidates = sorted(k for k in ip.user_ns if k.startswith("v") and is_user_name(k))
    names = [data.draw(st.sampled_from(candidates), label="name")] if candidates and data.draw(st.booleans()) else []
    before = user_state(ip)
    patch = pytest.MonkeyPatch()
    try:
        if site == "gc.collect":
            shim = types.SimpleNamespace(**{k: getattr(cleanup.gc, k) for k in dir(cleanup.gc) if not k.startswith("__")})
            shim.collect = _failing_after(calls, site)(cleanup.gc.collect)
            patch.setattr(cleanup, "gc", shim)
        else:
            patch.setattr(cleanup, site, _failing_after(calls, site)(getattr(cleanup, site)))
        try:
            report = ip.run_line_magic("freeall", " ".join(names))
        except (RuntimeError, UsageError) as exc:
            assert "injected failure" in str(exc)
            assert_unchanged(before, user_state(ip))  # failed: nothing of the user's changed
        else:
            assert report.deleted == tuple(names)
            assert_unchanged(before, user_state(ip), gone=set(names))
            if any("injected failure" in n for n in report.notes):
                assert len([n for n in report.notes if "injected failure" in n]) == 1
    finally:
        patch.undo()
