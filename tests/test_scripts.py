"""oom-magic from a plain Python script (no IPython): the fit check and the guard's hints in script words.

A real script runs as a subprocess with a real CPU out-of-memory error; the diagnosis text of
real Diagnosis records (built from real PyTorch messages, as tests/test_diagnose.py does) is
checked through ``script_wording``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from IPython.utils.capture import capture_output

from oom_magic.guard.diagnose import diagnose
from oom_magic.render.guard import diagnosis_text, script_wording

from tests.guard.test_diagnose import CUDA_OOM, FRAGMENTED, GiB

ROOT = Path(__file__).resolve().parents[1]


def test_a_script_gets_the_fit_check_and_hints_without_magics(tmp_path):
    torch = __import__("torch")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(512, 512)}, tmp_path / "model.safetensors")
    script = textwrap.dedent(f"""
        import torch, oom_magic
        check = oom_magic.fit_check({str(tmp_path)!r}, target="16GiB")  # not this machine's RAM: stable
        print("FIT", check.fits, check.checks[0].need)

        def load():
            partial = torch.ones(32 << 20, dtype=torch.uint8)  # the part that loaded
            return torch.empty(1 << 50, dtype=torch.uint8)     # the part that does not fit

        try:
            with oom_magic.guard_load(device="cpu") as guard:
                model = load()
        except RuntimeError as exc:
            print("RAISED", type(exc).__name__)
        print("LATER")  # issue 25 point 8: printed later, the report keeps the script's words
        print(guard.report)
        print(repr(guard.report.made_in))
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = done.stdout
    assert f"FIT True {512 * 512 * 4}" in out, done.stderr
    assert "RAISED RuntimeError" in out
    assert "what the failed load had allocated (32.00 MiB) was given back" in out
    assert "retry: running the load again needs at least 1024.00 TiB" in out
    for magic_words in ("%freeall", "%%guardload", "failed cell", "the cell", "kernel"):
        assert magic_words not in out, magic_words
    later = out.split("LATER\n", 1)[1]
    assert "what the failed load had allocated (32.00 MiB) was given back" in later
    assert "retry: running the load again needs at least 1024.00 TiB" in later and "'script'" in later


def test_a_report_made_in_ipython_keeps_its_magic_hints(ip):
    """The other side of issue 25 point 8: a report made by %%guardload names the magics, printed when it may be."""
    ip.run_cell("import torch")
    ip.run_line_magic("config", "OomMagics.guard_raise = False")  # the magic returns the report
    try:
        with capture_output():
            report = ip.run_cell_magic("guardload", "--device cpu",
                                       "partial = torch.ones(32 << 20, dtype=torch.uint8)\n"
                                       "w = torch.empty(1 << 50, dtype=torch.uint8)")
    finally:
        ip.run_line_magic("config", "OomMagics.guard_raise = True")
    assert report.made_in == "ipython" and "the failed cell" in str(report)


def test_script_wording_names_python_calls_for_every_magic_hint():
    held = diagnose(CUDA_OOM, device="cuda:0", self_pid=4242, stale_given_back=3 * GiB,
                    holders=(("old_model", 2 * GiB), ("acts", GiB // 2)))
    text = script_wording(diagnosis_text(held))
    assert "→ if you no longer need them: del old_model, acts, then oom_magic.free_stale()" in text
    assert "oom_magic.free_stale() frees it any time" in text and "keep cleanup on (cleanup=True)" in text
    fragmented = diagnose(FRAGMENTED, device="cuda:0", expandable_segments=False, cuda_initialized_before=True)
    text = script_wording(diagnosis_text(fragmented))
    assert "start a new process and enter guard_load before anything initializes CUDA" in text
    for magic_words in ("%freeall", "%%guardload", "--no-cleanup", "kernel"):
        assert magic_words not in script_wording(diagnosis_text(held)) + text, magic_words
