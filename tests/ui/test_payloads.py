"""Outside strings stay inert in real JupyterLab and Chromium: no dialog opens, no element is injected.

A notebook whose variable names, module and parameter names, output-cache keys and exception
message carry ``<img src=x onerror=alert(…)>`` and ``<script>alert(…)</script>`` payloads runs in a
real kernel under JupyterLab, with the after-cell widget on for every cell, ``%gpumem``'s HTML report
and ``%%guardload``'s output. Chromium would open an alert dialog for any payload that ran, and build
an ``<img>``/``<script>`` element for any that was injected; both are watched for, and the payloads
must show as text. A control cell shows raw HTML on purpose, proving the watch catches one that runs.
"""
from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import pytest

from .conftest import JupyterLab

# nbformat is imported where it is used: importing it costs ~3.5 s (jsonschema's format grammars)
# in the collection of every xdist worker, which mostly runs other tests.
if TYPE_CHECKING:
    import nbformat

# The browser and JupyterLab's kernels share the "jupyter" xdist group with the other real-kernel
# tests: one worker runs them one after another, so they never start side by side on 2 cores.
pytestmark = [pytest.mark.ui, pytest.mark.xdist_group("jupyter")]

IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(2)</script>"
MODULE = "<img src=y onerror=alert(3)>"  # no '.': nn.Module names may not hold one
RUN_S = 240

CELLS = [
    "%load_ext oom_magic\nimport torch\n%gpumem --auto always",
    # a globals() key that is no identifier, holding a tensor
    f"globals()[{IMG!r}] = torch.ones(1 << 20)",
    # a module and a parameter whose names are payloads
    "net = torch.nn.Module()\n"
    f"net.add_module({MODULE!r}, torch.nn.Linear(64, 64))\n"
    f"net.register_parameter({SCRIPT!r}, torch.nn.Parameter(torch.ones(4096)))",
    # an output-cache entry keyed by a payload
    f"{{{SCRIPT!r}: torch.ones(1 << 18) * 2}}",
    "%gpumem --all",
    # a guarded cell whose error message carries a payload
    "%%guardload --quiet\n"
    f"raise RuntimeError({('CUDA out of memory. Tried to allocate 2.00 GiB. ' + IMG)!r})",
    "%freeall",
    # the control: raw HTML shown on purpose, so the watch below is seen to catch a payload that runs
    "from IPython.display import HTML\nHTML('<img src=z onerror=alert(9)>')",
]


def _payload_notebook() -> nbformat.NotebookNode:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nb.cells[5].metadata["tags"] = ["raises-exception"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _run_all(page) -> None:  # type: ignore[no-untyped-def]
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        prompts = page.evaluate("() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]"
                                ".map(p => p.textContent.trim())")
        if len(prompts) == len(CELLS) and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        time.sleep(0.5)
    pytest.fail(f"Run All did not finish within {RUN_S} s: prompts {prompts}")


def test_payloads_stay_inert_in_jupyterlab(browser_page, jupyter_lab: JupyterLab) -> None:  # type: ignore[no-untyped-def]
    import nbformat

    nbformat.write(_payload_notebook(), jupyter_lab.root / "payloads.ipynb")
    page = browser_page
    dialogs: list[str] = []

    def dismiss(dialog) -> None:  # type: ignore[no-untyped-def]
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", dismiss)
    page.goto(jupyter_lab.url("lab/tree/payloads.ipynb"), wait_until="domcontentloaded", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => /\\|\\s*Idle\\s*$/.test(e.textContent))",
        timeout=90_000)
    _run_all(page)
    # Widgets render after their outputs arrive: wait until the last cell's memory view is there.
    page.wait_for_function("() => document.querySelectorAll('.jp-Notebook .widget-vbox .oom-bar').length >= 5",
                           timeout=60_000)
    for summary in page.locator(".jp-Notebook .widget-vbox details.oom-details > summary").all():
        summary.click()  # open every widget's details: their holder tables show too
    time.sleep(2)  # an onerror handler fires asynchronously, once the image fails to load

    outputs = page.locator(".jp-Notebook .jp-OutputArea")
    injected = page.evaluate("""() => {
        const area = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea')];
        return {
          // Lab rewrites a relative src (x -> files/x): every <img> in an output counts.
          img: area.reduce((n, a) => n + a.querySelectorAll('img').length, 0),
          script: area.reduce((n, a) => n + [...a.querySelectorAll('script')]
                                        .filter(s => s.textContent.includes('alert')).length, 0),
          onerror: area.reduce((n, a) => n + a.querySelectorAll('[onerror]').length, 0),
        };
    }""")
    text = "\n".join(outputs.all_inner_texts())
    assert dialogs == ["9"]  # the control's alert, and no other
    assert injected == {"img": 1, "script": 0, "onerror": 1}  # the control's element, and no other
    # The payloads are there, as text: in %gpumem's holder table and the widgets' details.
    assert f"globals()[{IMG!r}]" in text
    assert f"net[{MODULE!r}].weight" in text or f"net.{MODULE}.weight" in text
    assert SCRIPT in text
    assert page.get_by_text("Error displaying widget").count() == 0
