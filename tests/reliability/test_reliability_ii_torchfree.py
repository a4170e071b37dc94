"""Reliability II, the cases that need no torch: run on every Python that pyproject admits
(`make test-pythons`, torch not installed there) as well as in the main suite.

Each test failed before its fix. Through the public surface: the magics in a real shell, or the
Python API (`guard_load`, `preflight_check`, `estimate_checkpoint`) where no magic is involved.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from oom_magic import estimate_checkpoint, guard_load
from oom_magic.common.errors import OomMagicError
from oom_magic.fit.preflight import preflight_check

FORGED = "FAKE LINE: fits, 80 GiB to spare"


def write_safetensors(path: Path, rows: int = 4, cols: int = 4) -> Path:
    """A real safetensors file (one float32 matrix), written by hand: no torch needed."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(rows * cols * 4))
    return path


# --------------------------------------------------------------------------- %freeall names (no torch needed)


def test_freeall_refuses_ipython_names_and_keeps_them(ip) -> None:
    from IPython.core.error import UsageError

    ip.system_piped("true")  # what `!true` runs in a kernel: IPython sets _exit_code
    assert ip.user_ns["_exit_code"] == 0
    for name in ("_exit_code", "In", "_ih", "_i1", "get_ipython"):
        before = ip.user_ns.get(name)
        with pytest.raises(UsageError, match="IPython's own name"):
            ip.run_line_magic("freeall", name)
        assert ip.user_ns.get(name) is before


def test_freeall_names_a_variable_once_and_without_quotes(ip) -> None:
    from IPython.core.error import UsageError

    ip.run_cell("x = [1]; y = [2]; keep = [3]")
    assert ip.run_line_magic("freeall", "x x").deleted == ("x",)  # was a KeyError traceback
    assert ip.run_line_magic("freeall", "'y'").deleted == ("y",)  # was "no variable named \"'y'\""
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("freeall", "'a b'")
    assert str(info.value).startswith("no variable named 'a b'") and "\n" not in str(info.value)
    assert ip.user_ns["keep"] == [3]


# --------------------------------------------------------------------------- the guard's own lifetime


def test_a_finished_guard_refuses_to_run_again_in_one_line(ip) -> None:
    ip.run_cell("from oom_magic import guard_load\ng = guard_load(quiet=True)\nwith g:\n    a = 1")
    result = ip.run_cell("with g:\n    ran_unguarded = True")
    error = result.error_in_exec
    assert type(error).__name__ == "GuardUsedUp" and "ran_unguarded" not in ip.user_ns
    assert error._render_traceback_() == [f"GuardUsedUp: {error}"]  # one line in IPython, no guard frames
    for reuse in ("g.run(lambda: 1)", "[None for attempt in g]"):
        assert type(ip.run_cell(reuse).error_in_exec).__name__ == "GuardUsedUp"
    # A guard whose load raised is finished too.
    ip.run_cell("h = guard_load(quiet=True)")
    assert type(ip.run_cell("with h:\n    raise ValueError('x')").error_in_exec) is ValueError
    assert type(ip.run_cell("with h:\n    pass").error_in_exec).__name__ == "GuardUsedUp"


def test_an_error_whose_str_raises_passes_through_as_the_users(ip) -> None:
    ip.run_cell("class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')\n")
    result = ip.run_cell("%%guardload -q\nraise Odd()")
    assert type(result.error_in_exec).__name__ == "Odd"  # not the RuntimeError from inside the guard
    result = ip.run_cell("from oom_magic import guard_load\nwith guard_load(quiet=True):\n    raise Odd()")
    assert type(result.error_in_exec).__name__ == "Odd"


def test_top_level_await_runs_in_a_guarded_cell_as_in_a_plain_one(ip) -> None:
    ip.run_cell("import asyncio")
    plain = ip.run_cell("await asyncio.sleep(0)\nplain = await asyncio.sleep(0, result=7)")
    assert plain.error_in_exec is None and ip.user_ns["plain"] == 7
    guarded = ip.run_cell("%%guardload -q\nawait asyncio.sleep(0)\nguarded = await asyncio.sleep(0, result=8)")
    assert guarded.error_before_exec is None and guarded.error_in_exec is None
    assert ip.user_ns["guarded"] == 8


def test_an_out_of_memory_recovery_runs_without_exception_groups(capsys) -> None:
    """Python 3.10 has no BaseExceptionGroup: the give-back used to fail there with a NameError."""
    namespace: dict[str, Any] = {}
    with guard_load(raise_on_oom=False, namespace=namespace, expandable_segments=False) as guard:
        raise MemoryError("the allocator could not find 2 GiB")
    assert guard.report.outcome == "oom" and guard.report.give_back is not None
    assert "NameError" not in capsys.readouterr().out


def test_nested_guards_diagnose_one_out_of_memory_once(capsys) -> None:
    with pytest.raises(MemoryError) as info, guard_load(namespace={}, expandable_segments=False) as outer, \
            guard_load(namespace={}, expandable_segments=False) as inner:
        raise MemoryError("the allocator could not find 2 GiB")
    out = capsys.readouterr().out
    assert out.count("diagnosis (") == 1  # the inner guard's; the outer does not take its report for a 2nd OOM
    assert info.value.oom_report is inner.report and inner.report.outcome == "oom"
    assert outer.report.outcome == "error"


# --------------------------------------------------------------------------- preflight


def _odd_classes() -> dict[str, Any]:
    class RaisingModule(type):
        @property
        def __module__(cls) -> str:  # type: ignore[override]
            raise RuntimeError("no module")

    class Unhashable(type):
        def __eq__(cls, other: object) -> bool:
            raise TypeError("no ==")

        __hash__ = None  # type: ignore[assignment]

    class Loader:
        @classmethod
        def from_pretrained(cls, path: str) -> str:
            return "loaded"

    odd = RaisingModule("Odd", (Loader,), {})
    unhashable = Unhashable("Unhashable", (Loader,), {})
    return {"odd_cls": odd, "odd_obj": odd(), "uh_cls": unhashable, "uh_obj": unhashable()}


@pytest.mark.parametrize("name", ["odd_cls", "odd_obj", "uh_cls", "uh_obj"])
def test_an_object_whose_metaclass_cannot_be_inspected_is_skipped_with_a_note(ip, name: str) -> None:
    ip.user_ns.update(_odd_classes())
    for cell in (f"model = {name}.from_pretrained('ckpt')",
                 f"from transformers import AutoModel\nmodel = AutoModel.from_pretrained({name})",
                 f"model = AutoModel.from_pretrained('ckpt', device_map={name})"):
        preflight = preflight_check(cell, ip.user_ns)
        assert any(f"`{name}` was skipped: its metaclass" in note for note in preflight.notes)
    from oom_magic.fit.preflight import load_target  # the magic asks it before the guard starts

    assert load_target(f"model = AutoModel.from_pretrained('ckpt', device_map={name})", ip.user_ns) is None


def _config(folder: Path, **fields: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 100, **fields}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_config_declaring_100k_layers_is_refused_from_the_json_quickly(tmp_path: Path) -> None:
    folder = _config(tmp_path / "deep", num_hidden_layers=100_000)
    script = textwrap.dedent(f"""
        import sys
        from oom_magic.fit.preflight import preflight_check
        cell = "from transformers import AutoModelForCausalLM\\nif False:\\n    m = AutoModelForCausalLM.from_pretrained({str(folder)!r})"
        p = preflight_check(cell, {{}}, device="cpu")
        print(p.checks[0].reason)
        print("torch" in sys.modules, "transformers" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    reason, imported = out.stdout.strip().splitlines()[-2:]
    assert "declares 100,000 layers (num_hidden_layers)" in reason and "not sized" in reason, out.stderr
    assert imported == "False False"  # the preflight imported neither


def test_config_sizing_is_bounded_in_time_and_memory(tmp_path: Path, monkeypatch) -> None:
    """The child that builds the model is stopped at its bounds (here a stand-in child that sleeps,
    or takes 64 MiB, so the bound is met the same way with or without torch installed)."""
    from oom_magic.checkpoints import config_size

    folder = _config(tmp_path / "small")
    monkeypatch.setattr(config_size, "_CHILD", "import time\ntime.sleep(60)")
    monkeypatch.setattr(config_size, "TIME_LIMIT", 0.5)
    with pytest.raises(OomMagicError, match=r"took longer than 0.5 s; stopped, not sized"):
        estimate_checkpoint(folder)
    monkeypatch.setattr(config_size, "_CHILD", "import time\nheld = bytearray(64 << 20)\ntime.sleep(60)")
    monkeypatch.setattr(config_size, "TIME_LIMIT", 60.0)
    monkeypatch.setattr(config_size, "MEMORY_LIMIT", 16 << 20)
    with pytest.raises(OomMagicError, match=r"took more than 16.00 MiB of memory; stopped, not sized"):
        estimate_checkpoint(folder)


# --------------------------------------------------------------------------- checkpoints and text reports


def test_a_folder_with_a_looping_symlink_is_still_read(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    write_safetensors(folder / "model.safetensors")
    os.symlink("loop", folder / "loop")  # loops back on itself
    assert estimate_checkpoint(folder).format == "safetensors"  # was "cannot list it"
    assert preflight_check(f"from safetensors.torch import load_file\nsd = load_file({str(folder / 'model.safetensors')!r})",
                           {}, device="cpu").checks[0].need is not None


def test_a_path_that_is_a_looping_symlink_says_so(tmp_path: Path) -> None:
    link = tmp_path / "ckpt"
    os.symlink(link, link)
    with pytest.raises(OomMagicError, match="is a symbolic link that loops back on itself"):
        estimate_checkpoint(link)
    dangling = tmp_path / "gone"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(OomMagicError, match="is a symbolic link to .*nowhere, which does not exist"):
        estimate_checkpoint(dangling)


def test_a_checkpoint_folder_named_with_a_newline_forges_no_line(ip, tmp_path: Path, capsys) -> None:
    folder = tmp_path / f"ckpt\n{FORGED}\x1b[2K\u2028"
    write_safetensors(folder / "model.safetensors")
    cell = f"if False:\n    from safetensors.torch import load_file\n    sd = load_file({str(folder / 'model.safetensors')!r})"
    ip.run_cell_magic("guardload", "", cell)
    preflight = preflight_check(cell, ip.user_ns, device="cpu")
    for text in (capsys.readouterr().out, str(preflight)):
        assert "ckpt\\nFAKE LINE" in text  # shown, escaped, on its own line
        assert not any(line.lstrip().startswith("FAKE LINE") for line in text.splitlines())
        assert "\x1b" not in text and "\u2028" not in text


def test_capped_puts_the_fraction_back_when_interrupted_as_it_is_set() -> None:
    """A FAKE torch.cuda (no GPU here) whose set call is interrupted right after it took effect."""
    from oom_magic.fit.targets import capped

    from tests.fakes.fake_torch_cuda import GiB, FakeTorchCuda

    cuda = FakeTorchCuda(80 * GiB, fraction=0.5, interrupt_first_set=True)
    with pytest.raises(KeyboardInterrupt), capped(cuda, 0, 0.2):
        pass
    assert cuda.get_per_process_memory_fraction(0) == 0.5
