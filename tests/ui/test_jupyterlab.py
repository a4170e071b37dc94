"""quickstart.ipynb in real JupyterLab and headless Chromium: run all, see the widget, click its button.

Screenshots go to test-output/ui/ only (a test never writes over a tracked file); the README's
docs/img/quickstart-widget.png is refreshed from there by scripts/refresh_docs_image.sh, by hand.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .conftest import OUTPUT, REPO, JupyterLab

# The browser and JupyterLab's kernels share the "jupyter" xdist group with the other real-kernel
# tests: one worker runs them one after another, so they never start side by side on 2 cores.
pytestmark = [pytest.mark.ui, pytest.mark.xdist_group("jupyter")]

RUN_ALL_S = 240  # the notebook takes ~15 s in a kernel here; JupyterLab and Chromium share 2 cores

# What every cell's prompt says, whether the kernel is busy, and each error output's text.
_STATE_JS = """
() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    kinds: cells.map(c => c.classList.contains('jp-CodeCell') ? 'code' : 'other'),
    prompts: cells.map(c => (c.querySelector('.jp-InputPrompt')?.textContent || '').trim()),
    status: indicator ? indicator.getAttribute('data-status') : null,
    errors: [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
      .map(e => e.textContent.slice(0, 400)),
  };
}
"""


def _cell_index(cell_id: str) -> int:
    """Position (among all cells) of the quickstart cell with this id, as the DOM lists them."""
    import nbformat  # imported where used: ~3.5 s in every xdist worker's collection otherwise

    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    return next(n for n, cell in enumerate(nb.cells) if cell.get("id") == cell_id)


def _raising_cells() -> set[int]:
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    return {n for n, cell in enumerate(nb.cells) if "raises-exception" in cell.metadata.get("tags", [])}


def _wait_for_idle_kernel(page, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    """Wait until the status bar says the notebook's kernel is started and idle."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => /\\|\\s*Idle\\s*$/.test(e.textContent))",
        timeout=timeout_s * 1000)


def _run_all_and_wait(page) -> dict:  # type: ignore[no-untyped-def]
    """Run All Cells through the Run menu; return the final state once every code cell ran."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()
    deadline = time.monotonic() + RUN_ALL_S
    idle_since = None
    state: dict = {}
    while time.monotonic() < deadline:
        state = page.evaluate(_STATE_JS)
        code = [p for p, k in zip(state["prompts"], state["kinds"]) if k == "code"]
        if code and all(re.fullmatch(r"\[\d+\]:", p) for p in code):
            return state
        # Idle with cells not run for a while: Run All stopped at an error.
        if state["status"] == "idle" and not any("*" in p for p in code):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 10:
                break
        else:
            idle_since = None
        time.sleep(0.5)
    pytest.fail(f"Run All did not finish within {RUN_ALL_S} s: prompts {state.get('prompts')}, "
                f"errors {state.get('errors')}")


def _shot(page, name: str) -> Path:  # type: ignore[no-untyped-def]
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / name
    page.screenshot(path=str(path))
    return path


def test_quickstart_runs_in_jupyterlab(browser_page, jupyter_lab: JupyterLab) -> None:  # type: ignore[no-untyped-def]
    page = browser_page
    page.goto(jupyter_lab.url("lab/tree/quickstart.ipynb"), wait_until="domcontentloaded", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
    _wait_for_idle_kernel(page, 90)
    page.keyboard.press("Control+b")  # hide the file browser: the notebook fills the screenshots

    state = _run_all_and_wait(page)
    _shot(page, "quickstart-ran.png")

    cells = page.locator(".jp-Notebook .jp-Cell")
    # Only the cell tagged raises-exception shows a traceback (Lab renders errors as stderr).
    tracebacks = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')]
        .map((cell, n) => [n, [...cell.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                               .some(out => out.textContent.includes('Traceback'))])
        .filter(([n, failed]) => failed).map(([n]) => n)""")
    assert set(tracebacks) == _raising_cells() == {_cell_index("stale-traceback")}, state["errors"]

    # %gpumem's HTML report rendered after %freeall: the stale row reads 0 B.
    after = cells.nth(_cell_index("gpumem-after"))
    after.scroll_into_view_if_needed()
    report = after.locator(".oom-snapshot")
    assert report.count() == 1
    stale_row = report.locator("tr", has=page.locator("td", has_text=re.compile(r"^stale$")))
    assert stale_row.locator("td").nth(1).inner_text() == "0 B"
    # ... while before it, the stale row had the output cache's and the traceback's tensors.
    before = cells.nth(_cell_index("gpumem-stale")).locator(".oom-snapshot")
    before_row = before.locator("tr", has=page.locator("td", has_text=re.compile(r"^stale$")))
    assert before_row.locator("td").nth(1).inner_text() != "0 B"
    freed = cells.nth(_cell_index("freeall")).locator(".oom-free").inner_text()
    assert re.match(r"freed \d+\.\d\d MiB on \w+", freed), freed

    # Every widget output renders a memory view (caption and bar), none an error.
    page.wait_for_function("""() => {
        const views = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output.lm-Panel')];
        return views.length >= 5 && views.every(out => out.querySelector('.widget-vbox .widget-label')
                                                  && out.querySelector('.widget-vbox .oom-bar'));
    }""", timeout=60_000)

    # The memory widget under the last cell: bar, caption, and a button for its 32 MiB.
    last = cells.nth(_cell_index("try-it"))
    last.scroll_into_view_if_needed()
    widget = last.locator(".widget-vbox").first
    caption = widget.locator(".widget-label").first
    caption.wait_for(state="visible", timeout=60_000)
    assert page.get_by_text("Error displaying widget").count() == 0
    assert re.search(r" · stale 32\.00 MiB( \(quick view\))?$", caption.inner_text()), caption.inner_text()
    assert widget.locator(".oom-bar .oom-seg").count() >= 2
    assert widget.locator(".oom-bar .oom-seg-stale").is_visible()
    button = widget.locator("button.widget-button", has_text="Free stale tensors")
    assert button.inner_text().strip() == "Free stale tensors (32.00 MiB)"
    # The bar is labelled: a legend names each colour with its bytes, and a segment's hover gives exact bytes.
    legend = widget.locator(".oom-legend")
    assert legend.is_visible()
    items = [t.strip() for t in legend.locator(".oom-legend-item").all_inner_texts()]
    assert "stale 32.00 MiB" in items, items
    # The quickstart's model is mapped from its safetensors file on the cpu: file pages, not the user's
    # own memory (issue 25); each part is named with its bytes.
    assert any(re.fullmatch(r"user \d+(\.\d\d)? (B|KiB|MiB)", t) for t in items), items
    assert any(re.fullmatch(r"file pages \d+\.\d\d (MiB|GiB)", t) for t in items), items
    stale_segment = widget.locator(".oom-bar .oom-seg-stale")
    assert "stale: 32.00 MiB (33,554,432 bytes)" in (stale_segment.get_attribute("title") or "")
    swatch = legend.locator(".oom-legend-stale span").first
    assert swatch.evaluate("e => getComputedStyle(e).backgroundColor") == \
        stale_segment.evaluate("e => getComputedStyle(e).backgroundColor")  # the legend's colour is the bar's
    # An older widget says which cell its figures are from.
    load_caption = cells.nth(_cell_index("load")).locator(".widget-vbox .widget-label").first
    assert re.match(r"as of In \[\d+\] · ", load_caption.inner_text()), load_caption.inner_text()
    load_caption.scroll_into_view_if_needed()
    cells.nth(_cell_index("load")).screenshot(path=str(OUTPUT / "quickstart-older-widget.png"))
    last.scroll_into_view_if_needed()
    last.screenshot(path=str(OUTPUT / "quickstart-widget-before.png"))
    # Its details, opened: holders, and (for the quick view) what was left out, in plain words.
    widget.locator("details.oom-details > summary").click()
    notes = widget.locator("details.oom-details .oom-notes").all_inner_texts()
    if "(quick view)" in caption.inner_text():
        assert any("%gpumem has the full picture." in n for n in notes), notes
    last.screenshot(path=str(OUTPUT / "quickstart-widget-details.png"))
    widget.locator("details.oom-details > summary").click()

    button.click()
    page.wait_for_function(
        "el => / · stale 0 B · freed 32\\.00 MiB$/.test(el.textContent)", arg=caption.element_handle(),
        timeout=60_000)
    status = widget.locator(".widget-hbox .widget-html").first
    assert status.inner_text().strip() == "freed 32.00 MiB (output-cache 32.00 MiB)"
    assert not button.is_visible()  # nothing stale is left to free
    assert widget.locator(".oom-bar .oom-seg-stale").count() == 0
    assert page.get_by_text("Error displaying widget").count() == 0

    shot = OUTPUT / "quickstart-widget.png"
    last.screenshot(path=str(shot))
    _shot(page, "quickstart-after-click.png")
