"""%gpumem and %freeall through a real IPython shell: values, text, HTML, JSON, usage errors, load/unload."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from IPython.core.error import UsageError

MiB = 1 << 20


def ok(ip, src: str):
    result = ip.run_cell(src, store_history=True)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    return result.result


def test_gpumem_returns_snapshot_with_holder_paths(ip):
    ok(ip, "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))")
    snap = ok(ip, "s = %gpumem --device cpu\ns")
    assert snap.device == "cpu"
    assert snap.user_bytes >= (256 * 1024 + 1024 + 1024 * 16 + 16) * 4
    paths = [g.path for g in snap.holders("user")]
    assert paths[0] == "model[0].weight"
    assert {"model[0].bias", "model[2].weight", "model[2].bias"} <= set(paths)
    text = str(snap)
    assert text.splitlines()[0].startswith("cpu ")
    assert "model[0].weight" in text and "1.00 MiB" in text and "256" in text
    assert "top holders (4 of 4)" in text


def test_top_and_all(ip):
    ok(ip, "import torch\nts = [torch.ones(1000 + i) for i in range(15)]")
    assert "top holders (3 of 15)" in str(ip.run_line_magic("gpumem", "--device cpu --top 3"))
    assert "top holders (15 of 15)" in str(ip.run_line_magic("gpumem", "--device cpu --all"))
    ip.run_line_magic("config", "OomMagics.top = 5")
    try:
        assert "top holders (5 of 15)" in str(ip.run_line_magic("gpumem", "--device cpu"))
    finally:
        ip.run_line_magic("config", "OomMagics.top = 10")


def test_json_view(ip):
    ok(ip, "import torch\nw = torch.zeros(512, 512)")
    snap = ip.run_line_magic("gpumem", "--device cpu --json")
    assert snap.view == "json" and snap._repr_html_() is None
    data = json.loads(snap.to_json_text())
    assert data["device"] == "cpu"
    assert data["bytes_by_kind"]["user"] == data["user_bytes"] >= 512 * 512 * 4
    assert data["holders"][0]["path"] == "w" and data["holders"][0]["bytes"] == 512 * 512 * 4
    assert data["untracked_bytes"] is None  # cpu has no allocator total, said as null, never 0
    formatted = ip.display_formatter.format(snap)[0]
    assert json.loads(formatted["text/plain"])["device"] == "cpu" and "text/html" not in formatted


def test_html_escapes_outside_strings(ip):
    ok(ip, "import torch\nglobals()['<img src=x onerror=alert(1)>'] = torch.ones(300, 300)")
    snap = ip.run_line_magic("gpumem", "--device cpu")
    html = snap._repr_html_()
    assert "<img src=x" not in html
    assert "globals()[&#x27;&lt;img src=x onerror=alert(1)&gt;&#x27;]" in html


def test_freeall_report_text_and_html(ip):
    ok(ip, "import torch\nx = torch.ones(1024, 1024)")
    ok(ip, "x")
    ok(ip, "del x")
    report = ip.run_line_magic("freeall", "--device cpu")
    assert report.freed_bytes == 4 * MiB
    text = str(report)
    assert text.startswith("freed 4.00 MiB on cpu (output-cache 4.00 MiB)")
    assert "cpu: " in text and "→" in text
    assert "<pre class='oom-free'>" in report._repr_html_()


@pytest.mark.parametrize("line, message", [
    ("--bogus", "unrecognized arguments: --bogus"),
    ("--device cuda:9", r"unknown device 'cuda:9': this machine has .*cpu"),
    ("--device tpu", r"unknown device 'tpu'"),
    ("--top -1", r"--top must be 0 or more"),
    ("--top many", r"invalid int value"),
])
def test_gpumem_usage_errors(ip, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("gpumem", line)


def test_freeall_usage_errors(ip):
    with pytest.raises(UsageError, match="unknown device 'cuda:3'"):
        ip.run_line_magic("freeall", "--device cuda:3")
    with pytest.raises(UsageError, match="unrecognized arguments: --force"):
        ip.run_line_magic("freeall", "--force")


def test_help_is_the_argparse_help(ip):
    doc = ip.find_line_magic("gpumem").__doc__
    assert "Show what uses a device's memory" in doc and "--device" in doc and "--json" in doc
    assert "--dry-run" in ip.find_line_magic("freeall").__doc__


def test_load_twice_unload_reload(ip):
    manager = ip.magics_manager
    ip.run_line_magic("load_ext", "oom_magic")  # a second load is harmless
    assert list(manager.registry).count("OomMagics") == 1
    ip.run_line_magic("unload_ext", "oom_magic")
    assert "gpumem" not in manager.magics["line"] and "OomMagics" not in manager.registry
    assert "time" in manager.magics["line"]  # unload removed only ours
    ip.run_line_magic("load_ext", "oom_magic")
    ip.run_line_magic("reload_ext", "oom_magic")
    assert "gpumem" in manager.magics["line"] and "freeall" in manager.magics["line"]


def test_no_torch_import_and_no_cuda_context():
    """In a fresh process: importing, loading and running the magics never imports torch."""
    script = textwrap.dedent("""
        import sys
        import oom_magic
        assert "torch" not in sys.modules
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "oom_magic")
        snap = ip.run_line_magic("gpumem", "")
        report = ip.run_line_magic("freeall", "")
        ip.run_cell("x = 1 + 1", store_history=True)
        assert "torch" not in sys.modules, "torch was imported"
        assert snap.storages == () and "torch is not imported" in " ".join(snap.notes)
        print("OK", snap.device, report.freed_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK cpu 0")


def test_cuda_never_initialized_by_magics(ip):
    ok(ip, "import torch\nt = torch.ones(10)")
    ip.run_line_magic("gpumem", "")
    ip.run_line_magic("freeall", "")
    import torch

    assert torch.cuda.is_initialized() is False
