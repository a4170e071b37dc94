"""Tests for loading and unloading the extension: exactly one set of hooks, closed widgets, safe hooks.

A real IPython shell (the ``ip`` fixture) and real torch CPU tensors. The one fake is a probe
that raises, standing in for a failure inside the hook (labelled where used).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

from oom_magic.notebook import watch
from oom_magic.notebook.widget import CellWatch


def ours(ip, event: str) -> list:
    """The callbacks a CellWatch registered for ``event``."""
    return [cb for cb in ip.events.callbacks[event] if isinstance(getattr(cb, "__self__", None), CellWatch)]


def cell_watch(ip) -> CellWatch:
    return ip.magics_manager.registry["OomMagics"].cell_watch


def test_load_registers_exactly_one_pre_and_post_hook(ip) -> None:
    assert len(ours(ip, "pre_run_cell")) == 1
    assert len(ours(ip, "post_run_cell")) == 1
    watch_ = cell_watch(ip)
    assert ours(ip, "post_run_cell")[0] == watch_.callbacks()["post_run_cell"]
    assert watch.mark_cell("x") is True  # the loaded watcher receives marks


def test_loading_twice_is_harmless(ip) -> None:
    before = cell_watch(ip)
    ip.run_line_magic("load_ext", "oom_magic")
    assert cell_watch(ip) is before
    assert len(ours(ip, "pre_run_cell")) == 1 and len(ours(ip, "post_run_cell")) == 1


def test_unload_removes_exactly_our_callbacks_and_reload_leaves_one_set(ip) -> None:
    def someone_elses(result) -> None:
        pass

    ip.events.register("post_run_cell", someone_elses)
    try:
        old = cell_watch(ip)
        ip.run_line_magic("unload_ext", "oom_magic")
        assert ours(ip, "pre_run_cell") == [] and ours(ip, "post_run_cell") == []
        assert someone_elses in ip.events.callbacks["post_run_cell"]
        assert watch.mark_cell("x") is False
        assert "gpumem" not in ip.magics_manager.magics["line"]
        ip.run_line_magic("load_ext", "oom_magic")
        ip.run_line_magic("reload_ext", "oom_magic")
        assert len(ours(ip, "pre_run_cell")) == 1 and len(ours(ip, "post_run_cell")) == 1
        assert cell_watch(ip) is not old
        assert ours(ip, "post_run_cell")[0].__self__ is cell_watch(ip)
    finally:
        ip.events.unregister("post_run_cell", someone_elses)


def test_unload_closes_the_widgets_it_displayed(ip) -> None:
    import ipywidgets.widgets.widget as widget_module

    ip.run_cell("import torch", store_history=True)
    ip.run_cell("x = torch.ones(16 << 20)", store_history=True)
    watch_ = cell_watch(ip)
    assert len(watch_.live) == 1
    shown = watch_.live[0]
    model_ids = [shown.box.model_id, shown.button.model_id, shown.button.layout.model_id]
    assert all(m in widget_module._instances for m in model_ids)
    ip.run_line_magic("unload_ext", "oom_magic")
    assert shown.closed and watch_.live == []
    assert not any(m in widget_module._instances for m in model_ids)
    ip.run_line_magic("load_ext", "oom_magic")


def test_silent_cells_are_not_recorded(ip) -> None:
    ip.run_cell("import torch", store_history=True)
    watch_ = cell_watch(ip)
    before = len(watch_.watcher.history)
    ip.run_cell("y = torch.ones(16 << 20)", silent=True)
    assert len(watch_.watcher.history) == before
    ip.run_cell("z = 1", store_history=True)
    assert len(watch_.watcher.history) == before + 1


def test_a_failing_hook_warns_once_turns_itself_off_and_comes_back(ip, capsys) -> None:
    ip.run_cell("import torch", store_history=True)
    watch_ = cell_watch(ip)

    def broken_probe(torch_module):
        """FAKE failure: stands in for any error inside the hook."""
        raise RuntimeError("probe exploded")

    real_probe = watch_.watcher._probe
    watch_.watcher._probe = broken_probe
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ip.run_cell("a = 1", store_history=True)
        second = ip.run_cell("b = 2", store_history=True)
    assert first.success and second.success
    assert ip.user_ns["a"] == 1 and ip.user_ns["b"] == 2
    messages = [str(w.message) for w in caught if "oom-magic" in str(w.message)]
    assert len(messages) == 1
    assert "probe exploded" in messages[0] and "%gpumem --auto changes" in messages[0]
    assert watch_.enabled is False
    assert "Error in callback" not in capsys.readouterr().out
    watch_.watcher._probe = real_probe
    status = ip.run_line_magic("gpumem", "-o --auto changes")
    assert status.enabled is True and watch_.enabled is True
    recorded = len(watch_.watcher.history)
    ip.run_cell("c = 3", store_history=True)
    assert len(watch_.watcher.history) == recorded + 1


def test_a_warnings_filter_set_to_error_still_never_reaches_the_cell(ip, capsys) -> None:
    ip.run_cell("import torch", store_history=True)
    watch_ = cell_watch(ip)

    def broken_probe(torch_module):
        """FAKE failure inside the hook."""
        raise RuntimeError("probe exploded")

    watch_.watcher._probe = broken_probe
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = ip.run_cell("d = 4", store_history=True)
    assert result.success and result.error_in_exec is None
    assert watch_.enabled is False
    assert "the after-cell memory check failed (RuntimeError: probe exploded)" in capsys.readouterr().err


def test_without_torch_the_hooks_do_nothing_and_never_import_it(tmp_path) -> None:
    script = textwrap.dedent("""
        import sys
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "oom_magic")
        for src in ("a = 1", "b = [0] * 10_000_000", "del b"):
            ip.run_cell(src, store_history=True)
        watch = ip.magics_manager.registry["OomMagics"].cell_watch
        print(len(watch.watcher.history), len(watch.live), "torch" in sys.modules)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "IPYTHONDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["0", "0", "False"]


def test_an_interrupt_during_the_hook_skips_that_cell_only(ip, capsys) -> None:
    ip.run_cell("import torch", store_history=True)
    watch_ = cell_watch(ip)
    real_probe = watch_.watcher._probe
    calls = []

    def interrupted_once(torch_module):
        """FAKE: the user presses interrupt while the hook reads (after the cell)."""
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_probe(torch_module)

    watch_.watcher._probe = interrupted_once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ip.run_cell("e = 5", store_history=True)
    assert result.success and watch_.enabled
    assert not [w for w in caught if "oom-magic" in str(w.message)]
    assert "Error in callback" not in capsys.readouterr().out
    watch_.watcher._probe = real_probe
    recorded = len(watch_.watcher.history)
    ip.run_cell("f = 6", store_history=True)
    assert len(watch_.watcher.history) == recorded + 1
