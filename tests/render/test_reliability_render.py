"""Render nothing it reads: outside strings stay inert text in every HTML output.

Payloads (``<img src=x onerror=...>``, ``<script>``, an attribute break-out, an ``<svg onload>``)
are put where a user's session really gets them from: variable names (``globals()`` keys need not
be identifiers), nn.Module child, parameter and buffer names (``add_module``/``register_*``), the
name of a real process (``exec -a`` plus ``prctl(PR_SET_NAME)``, listed by the fake NVML with its
real pid), checkpoint file and folder names on disk, and out-of-memory messages raised in cells.
Every HTML output is then parsed (``html.parser``): no element or ``on*`` attribute may come from a
payload, and the payload must still be readable as text (escaped, not dropped).

HTML outputs checked: ``Snapshot._repr_html_``, ``FreeReport._repr_html_``, ``GuardReport``,
``Preflight`` and ``Diagnosis`` HTML, and the widget's HTML children (bar, details, status), its
mimebundle's text/html, its frozen static view and the ``live_widgets = 0`` static display.

Fake: NVML only (no GPU here), labelled where used; the processes it lists are real.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import psutil
import pytest
import torch
from IPython.utils.capture import capture_output
from safetensors.torch import save_file

from oom_magic.device.nvml import Nvml
from oom_magic.fit.preflight import preflight_check
from oom_magic.notebook.watch import CellReport
from tests.conftest import ready_process
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, GiB

IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(1)</script>"
BREAKOUT = "\"'><svg onload=alert(1)>"
NOSPACE = "<img/src=x/onerror=alert(1)>"  # survives a magic's argument split
PAYLOADS = (IMG, SCRIPT, BREAKOUT, NOSPACE)
ACTIVE_TAGS = {"script", "img", "svg", "iframe", "object", "embed", "math", "style", "link", "meta", "base"}

pytestmark = pytest.mark.usefixtures("fresh_heap")



class _Elements(HTMLParser):
    """Collect the elements, attributes and text a browser would build from the HTML."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += attrs

    handle_startendtag = handle_starttag

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def assert_inert(html: str, *visible: str) -> str:
    """No active element or event attribute in ``html``; each of ``visible`` readable in its text."""
    parsed = _Elements()
    parsed.feed(html)
    parsed.close()
    assert not ACTIVE_TAGS & set(parsed.tags), (ACTIVE_TAGS & set(parsed.tags), html[:2000])
    handlers = [name for name, _ in parsed.attributes if name.lower().startswith("on")]
    assert not handlers, (handlers, html[:2000])
    text = "".join(parsed.text)
    for payload in visible:
        assert payload in text, (payload, text[:2000])
    return text


# --------------------------------------------------------------------------- fixtures


def magics(ip) -> Any:
    return ip.magics_manager.registry["OomMagics"]


@pytest.fixture
def payload_session(ip) -> Any:
    """A session whose variables, module children, parameters and buffers are named with payloads."""
    ip.run_cell(textwrap.dedent(f'''
        import torch
        globals()[{IMG!r}] = torch.ones(1000)
        globals()[{SCRIPT!r}] = [torch.ones(500)]
        globals()[{NOSPACE!r}] = torch.ones(300)
        net = torch.nn.Sequential()
        net.add_module({IMG!r}, torch.nn.Linear(8, 8))
        net.add_module({BREAKOUT!r}, torch.nn.Linear(8, 4))
        net.register_parameter({SCRIPT!r}, torch.nn.Parameter(torch.ones(64)))
        net.register_buffer({BREAKOUT!r} + "buf", torch.ones(32))
        cache = {{{SCRIPT!r}: torch.ones(200)}}
    '''), store_history=True)
    return ip


# --------------------------------------------------------------------------- variable, module and parameter names


def test_gpumem_html_keeps_names_inert(payload_session) -> None:
    snap = payload_session.run_line_magic("gpumem", "-o --all")
    paths = {g.path for g in snap.holders()}
    assert f"globals()[{IMG!r}]" in paths and f"net.{IMG}.weight" in paths and f"cache[{SCRIPT!r}]" in paths
    assert_inert(snap._repr_html_(), IMG, SCRIPT, f"net.{BREAKOUT}.weight", f"net.{SCRIPT}", "buf")


def test_freeall_report_html_keeps_names_inert(payload_session) -> None:
    ip = payload_session
    ip.run_cell(f"alias = globals()[{NOSPACE!r}]", store_history=True)  # keeps its tensor alive
    report = ip.run_line_magic("freeall", NOSPACE)
    assert report.deleted == (NOSPACE,) and NOSPACE not in ip.user_ns
    assert report.still_held and report.still_held[0].holders == ("alias",)
    assert_inert(report._repr_html_(), NOSPACE)


def test_guard_report_html_keeps_names_inert(payload_session) -> None:
    ip = payload_session
    with capture_output():
        report = ip.run_cell_magic("guardload", "--quiet", f"globals()[{BREAKOUT!r}] = torch.ones(2048)\n")
    assert report.outcome == "ok" and report.variable(f"globals()[{BREAKOUT!r}]") is not None
    from oom_magic.render.guard import guard_report_html

    assert_inert(guard_report_html(report), "'><svg onload=alert(1)>")  # shown as repr() writes it
    assert_inert(report._repr_html_())  # --quiet shows its one summary line


def _every_widget_html(widget: Any) -> list[str]:
    bundle = widget._repr_mimebundle_()
    return [widget.bar.value, widget.details_body.value, widget.status.value, bundle["text/html"],
            widget.static_bundle()["text/html"]]


def test_the_widget_keeps_names_inert(payload_session) -> None:
    ip = payload_session
    ip.run_line_magic("gpumem", "-o --auto always")
    ip.run_cell(f"globals()[{IMG!r} + '2'] = torch.ones(4096)\ntorch.ones(128) * 2", store_history=True)
    widget = magics(ip).cell_watch.live[-1]
    assert widget.report.snapshot.stale_bytes == 512
    texts = [assert_inert(html) for html in _every_widget_html(widget)]
    assert IMG in texts[1]  # the details table shows the name, as text
    widget.button.click()
    assert widget.report.freed is not None
    for html in _every_widget_html(widget):
        assert_inert(html)
    magics(ip).cell_watch._freeze(widget)  # frozen: static HTML only
    assert widget.closed
    assert_inert(widget._repr_mimebundle_()["text/html"], IMG)


def test_the_static_view_keeps_names_inert(payload_session) -> None:
    ip = payload_session
    magics(ip).live_widgets = 0
    ip.run_line_magic("gpumem", "-o --auto always")
    with capture_output() as shown:
        ip.run_cell(f"globals()[{SCRIPT!r} + '2'] = torch.ones(4096)", store_history=True)
    htmls = [o.data["text/html"] for o in shown.outputs if "text/html" in o.data]
    assert htmls
    for html in htmls:
        assert_inert(html, SCRIPT)


# --------------------------------------------------------------------------- process names


@pytest.fixture
def payload_process() -> Iterator[subprocess.Popen]:
    """A real process whose argv[0] and kernel name (comm) are a payload."""
    if sys.platform != "linux" or shutil.which("bash") is None:
        pytest.skip("prctl(PR_SET_NAME) and exec -a need Linux and bash")
    script = ("import ctypes, time; ctypes.CDLL(None).prctl(15, " + repr(IMG.encode()) + ", 0, 0, 0); "
              "print('ready', flush=True); time.sleep(120)")
    with ready_process(["bash", "-c", f'exec -a "{IMG}" "{sys.executable}" -c "{script}"']) as proc:
        yield proc


def test_process_names_stay_inert(use_nvml, ip, monkeypatch, payload_process) -> None:
    assert psutil.Process(payload_process.pid).name() == IMG  # the payload really is its name
    gpu = FakeGpu(used=5 * GiB, processes=[(payload_process.pid, 3 * GiB), (os.getpid(), 2 * GiB)])
    use_nvml(Nvml(FakeNvml([gpu]).module))  # FAKE NVML, real pids
    ip.run_cell("import torch", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
    (other,) = snap.reading.processes
    assert (other.pid, other.name, other.used_bytes) == (payload_process.pid, IMG, 3 * GiB)
    assert_inert(snap._repr_html_(), IMG)
    widget = magics(ip).cell_watch.show(CellReport(None, snap))
    assert widget is not None
    assert IMG in assert_inert(widget.details_body.value)
    for html in _every_widget_html(widget):
        assert_inert(html)


# --------------------------------------------------------------------------- file paths


@pytest.fixture
def payload_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints whose folder, or file, is named with a payload; one damaged."""
    folder = tmp_path / IMG
    folder.mkdir()
    save_file({"w.weight": torch.zeros(16, 16)}, str(folder / "model.safetensors"))
    nested = tmp_path / SCRIPT  # the '/' in </script> makes a folder inside a folder
    nested.mkdir(parents=True)
    save_file({"w.weight": torch.zeros(8, 8)}, str(nested / f"{BREAKOUT}.safetensors"))
    damaged = tmp_path / "damaged" / IMG
    damaged.mkdir(parents=True)
    (damaged / f"{IMG}.safetensors").write_bytes(b"\xff" * 32)
    return {"folder": folder, "file": nested / f"{BREAKOUT}.safetensors",
            "damaged": damaged / f"{IMG}.safetensors", "missing": tmp_path / IMG / "nope" / SCRIPT}


def test_checkpoint_paths_stay_inert_in_the_preflight(payload_checkpoints: dict[str, Path]) -> None:
    for name, path in payload_checkpoints.items():
        cell = f"from safetensors.torch import load_file\nsd = load_file({str(path)!r})\n"
        pre = preflight_check(cell, {}, device="cpu")
        text = assert_inert(pre._repr_html_())
        assert str(path) in text or path.name in text, (name, text)


def test_checkpoint_paths_stay_inert_in_the_guard_report(ip, payload_checkpoints: dict[str, Path]) -> None:
    path = payload_checkpoints["folder"] / "model.safetensors"
    with capture_output():
        report = ip.run_cell_magic("guardload", "--quiet",
                                   f"from safetensors.torch import load_file\nsd = load_file({str(path)!r})\n")
    assert report.outcome == "ok" and report.variable("sd").bytes == 1024
    assert_inert(report.preflight._repr_html_(), IMG)  # the fit check names the file
    from oom_magic.render.guard import guard_report_html

    assert_inert(guard_report_html(report))
    assert_inert(report._repr_html_())


# --------------------------------------------------------------------------- exception messages

OOM_WITH_PAYLOADS = f"CUDA out of memory. Tried to allocate 2.00 GiB {IMG} {SCRIPT} {BREAKOUT}"


def test_an_out_of_memory_message_stays_inert_in_the_guard_report(ip) -> None:
    magics(ip).guard_raise = False
    with capture_output() as printed:
        report = ip.run_cell_magic("guardload", "--quiet",
                                   f"import torch\nraise torch.OutOfMemoryError({OOM_WITH_PAYLOADS!r})\n")
    assert report.outcome == "oom" and IMG in printed.stdout  # the forensics show the real message
    from oom_magic.render.guard import guard_report_html

    assert_inert(guard_report_html(report))  # its details do not repeat the forensics printed above
    assert_inert(report._repr_html_())
    assert IMG in str(report)  # the text form tells it all, the real message included
    if report.diagnosis is not None:
        assert_inert(report.diagnosis._repr_html_())
    if report.preflight is not None:
        assert_inert(report.preflight._repr_html_())


def test_an_out_of_memory_message_stays_inert_in_the_widget(ip) -> None:
    ip.run_cell("import torch", store_history=True)
    ip.run_line_magic("gpumem", "-o --auto changes")
    with capture_output():
        ip.run_cell(f"raise RuntimeError({OOM_WITH_PAYLOADS!r})", store_history=True)
    widget = magics(ip).cell_watch.live[-1]
    assert widget.report.change is not None and widget.report.change.oom
    for html in _every_widget_html(widget):
        assert_inert(html)


def test_a_failing_button_shows_the_error_inert(ip) -> None:
    ip.run_line_magic("gpumem", "-o --auto always")
    ip.run_cell("import torch\nx = torch.ones(8 << 20)", store_history=True)
    widget = magics(ip).cell_watch.live[-1]

    def failing(device: str) -> Any:
        """FAKE: the cleanup fails with a message carrying payloads."""
        raise RuntimeError(OOM_WITH_PAYLOADS)

    widget._free = failing
    widget.button.layout.display = None
    widget.button.click()
    assert_inert(widget.status.value, IMG, SCRIPT)
