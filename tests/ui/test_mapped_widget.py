"""issue 25 point 1 in real JupyterLab: weights mapped beyond the machine's memory, seen in the widget.

A sparse safetensors file (its data a hole: no disk, no RAM) is loaded twice with
``safetensors.torch.load_file`` in a real kernel, so the tensors view more bytes than the machine
has. The widget under the cell must not draw them as user memory: its legend adds up to the
machine, the file pages are named, the holder table's columns line up (header and cells), and the
free button says that freeing a mapped stale view gives no memory back.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import psutil
import pytest

from tests.device.test_mapped import _sparse_checkpoint

from .conftest import OUTPUT, JupyterLab
from .test_jupyterlab import _run_all_and_wait, _wait_for_idle_kernel

pytestmark = pytest.mark.ui

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@pytest.fixture
def lab_root(tmp_path: Path) -> Path:
    """A server root with the sparse checkpoint and a notebook that loads it twice, then leaves a stale view."""
    root = tmp_path / "root"
    root.mkdir()
    _sparse_checkpoint(root / "model.safetensors", int(0.6 * psutil.virtual_memory().total))
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext oom_magic\nimport torch\nfrom safetensors.torch import load_file"),
        nbformat.v4.new_code_cell("first = load_file('model.safetensors')\nsecond = load_file('model.safetensors')"),
        # The output cache holds a mapped view; 32 MiB of its own make the cell one that changed memory.
        nbformat.v4.new_code_cell("scratch = torch.ones(8 << 20)\nload_file('model.safetensors')['w'][:1]"),
    ]
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nbformat.write(nb, root / "mapped.ipynb")
    return root


def _bytes(text: str) -> int:
    number, unit = text.rsplit(" ", 1)
    return int(float(number) * _UNITS[unit])


def test_the_widget_shows_mapped_weights_as_file_pages(browser_page, jupyter_lab: JupyterLab) -> None:  # type: ignore[no-untyped-def]
    page = browser_page
    page.goto(jupyter_lab.url("lab/tree/mapped.ipynb"), wait_until="domcontentloaded", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
    _wait_for_idle_kernel(page, 90)
    page.keyboard.press("Control+b")
    _run_all_and_wait(page)
    last = page.locator(".jp-Notebook .jp-Cell").nth(2)
    widget = last.locator(".widget-vbox").first
    caption = widget.locator(".widget-label").first
    caption.wait_for(state="visible", timeout=60_000)
    last.scroll_into_view_if_needed()
    assert page.get_by_text("Error displaying widget").count() == 0
    items = [t.strip() for t in widget.locator(".oom-legend .oom-legend-item").all_inner_texts()]
    total = psutil.virtual_memory().total
    # Two 0.6×RAM maps: were they user memory, "user" would read more than the machine.
    shown = {item.rsplit(" ", 2)[0]: _bytes(" ".join(item.rsplit(" ", 2)[1:])) for item in items}
    assert shown.get("user", 0) < 64 << 20, items
    assert sum(shown.values()) <= total * 1.01, items  # the legend adds up to the machine (2-decimal rounding)
    # The holder table: every column's header and cells share one alignment (JupyterLab right-aligns by default).
    widget.locator("details > summary").first.click()
    table = widget.locator("table.oom-holders")
    aligns = table.evaluate("""t => [...t.rows].map(r => [...r.cells].map(c => getComputedStyle(c).textAlign))""")
    assert all(row == aligns[0] for row in aligns) and aligns[0][:2] == ["left", "right"], aligns
    kinds = table.locator("tbody tr td:nth-child(5)").all_inner_texts()
    assert any("file-mapped" in k for k in kinds), kinds
    last.screenshot(path=str(OUTPUT / "mapped-widget-details.png"))
    widget.locator("details > summary").first.click()
    button = widget.locator("button.widget-button", has_text="Free stale tensors")
    button.click()
    page.wait_for_function("el => / · freed .*file pages: no memory back\\)$/.test(el.textContent)",
                           arg=caption.element_handle(), timeout=60_000)
    status = widget.locator(".widget-hbox .widget-html").first.inner_text()
    assert re.search(r"were views of a memory-mapped file: file pages .*no memory came back for them", status), status
    last.screenshot(path=str(OUTPUT / "mapped-widget-freed.png"))
