"""Execute quickstart.ipynb and oom-walkthrough.ipynb in a real kernel (nbclient) and check their reports.

Each notebook runs once per module, in a copy under a temporary folder (so its models are built
there), and the executed copy is kept in test-output/notebooks/ for reading. The figures below are
exact: the notebooks build the same tiny Llama every time (11,356,416 fp32 parameters = 43.32 MiB).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from pathlib import Path

from typing import TYPE_CHECKING

import pytest

from oom_magic.render.units import format_bytes

# nbformat is imported where it is used: importing it costs ~3.5 s (jsonschema's format grammars)
# in the collection of every xdist worker, which mostly runs other tests.
if TYPE_CHECKING:
    import nbformat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

# Real kernels run in the "jupyter" xdist group: one worker, one after another, never side by side.
pytestmark = pytest.mark.xdist_group("jupyter")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
OUTPUT = REPO / "test-output" / "notebooks"
CELL_TIMEOUT_S = 180

MODEL_BYTES = 11_356_416 * 4  # the tiny Llama's parameters in fp32
EMBEDDING_BYTES = 16_000 * 256 * 4  # one 16000×256 fp32 matrix: embed_tokens, lm_head
OUTPUT_BYTES = 8 * 2**20 * 4  # quickstart's torch.ones(8 * 2**20)
MODEL = format_bytes(MODEL_BYTES)  # "43.32 MiB", as the reports print it
MODEL_BF16 = format_bytes(MODEL_BYTES // 2)
EMBEDDINGS = format_bytes(EMBEDDING_BYTES)
OUTPUT_TENSOR = format_bytes(OUTPUT_BYTES)
STALE = format_bytes(OUTPUT_BYTES + MODEL_BYTES)  # quickstart: Out[N] + the failed load's staged weights
DEVICE = r"(?:cpu|cuda:\d+)"  # the notebooks run on cuda when there is one
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def execute(name: str, workdir: Path) -> nbformat.NotebookNode:
    """Run every cell of notebooks/NAME in a fresh python3 kernel with ``workdir`` as its cwd.

    The kernel gets an IPython profile folder of its own, so no startup file or config of the
    machine's user changes what the notebook does.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    try:
        # A fresh kernel's environment: not what an earlier guard in this worker process set (the allocator setting).
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        client.execute(env=dict(env, IPYTHONDIR=str(workdir / ".ipython")))
    finally:
        OUTPUT.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, OUTPUT / name.replace(".ipynb", ".executed.ipynb"))
    return nb


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    return execute("quickstart.ipynb", tmp_path_factory.mktemp("quickstart"))


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    return execute("oom-walkthrough.ipynb", tmp_path_factory.mktemp("walkthrough"))


def cell(nb: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode:
    """The code cell with this id (ids are set by notebooks/make_notebooks.py)."""
    return next(c for c in nb.cells if c.get("id") == cell_id)


def text(nb: nbformat.NotebookNode, cell_id: str) -> str:
    """Everything a cell printed or returned, as plain text, in order."""
    parts = []
    for out in cell(nb, cell_id).outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "\n".join(parts)


def result(nb: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode:
    """The report a cell showed: its execute_result (%freeall, %%guardload) or what it displayed (%gpumem
    shows its report as display_data wherever it is in the cell); never the memory widget under it."""
    outs = [o for o in cell(nb, cell_id).outputs if o.output_type in ("execute_result", "display_data")
            and WIDGET_VIEW not in o.data and "oom-cell" not in o.data.get("text/html", "")]
    assert len(outs) == 1, f"{cell_id}: expected one result, got {[o.output_type for o in cell(nb, cell_id).outputs]}"
    return outs[0]


def segment(nb: nbformat.NotebookNode, cell_id: str, label: str) -> str:
    """One figure of a %gpumem report's 'this process' table: ``'43.32 MiB'`` or ``'0 B'``."""
    report = result(nb, cell_id).data["text/plain"]
    match = re.search(rf"^\s+{re.escape(label)}\s{{2,}}(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB))\b", report, re.M)
    assert match, f"no '{label}' row in {cell_id}'s report:\n{report}"
    return match.group(1)


def tensors(nb: nbformat.NotebookNode, cell_id: str, label: str) -> float:
    """MiB the tensors of one holder kind take: the bar's row plus, on the cpu, the part that views a
    memory-mapped file (file pages, which the bar shows apart and the row's note or the stale line names)."""
    report = result(nb, cell_id).data["text/plain"]
    total = mib(segment(nb, cell_id, label))
    row = re.search(rf"^\s+{re.escape(label)}\s{{2,}}.*$", report, re.M)
    mapped = re.search(r"\(the (\d+(?:\.\d+)? \w+) mapped from files are file pages\)", row.group(0) if row else "")
    if label == "stale":
        mapped = re.search(r"^\s+stale is .*\((\d+(?:\.\d+)? \w+) of it file pages, not in the bar\)", report, re.M)
    return total + (mib(mapped.group(1)) if mapped else 0.0)


def same(figure_mib: float, expected: str) -> bool:
    """A sum of printed figures against one printed figure: equal to the printing's two decimals."""
    return abs(figure_mib - mib(expected)) <= 0.011 * max(1.0, mib(expected) / 1024)


def mib(figure: str) -> float:
    """'15.62 MiB' -> 15.62; '0 B' -> 0.0 (for comparisons, never for equality)."""
    number, unit = figure.split()
    return float(number) * {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}[unit]


def errors(nb: nbformat.NotebookNode) -> dict[str, str]:
    """Cell id -> 'ename: evalue' for every cell that raised."""
    return {c.id: f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"}


def raising(nb: nbformat.NotebookNode) -> set[str]:
    return {c.id for c in nb.cells if "raises-exception" in c.metadata.get("tags", [])}


def memory_widget(nb: nbformat.NotebookNode, cell_id: str) -> dict[str, dict]:
    """The memory widget under a cell, as the notebook saved its models' last state.

    Returns ``caption`` (Label), ``bar`` (HTML), ``button`` (Button, with its ``layout``),
    ``status`` (HTML beside the button) and ``bundle`` (the output's text/plain and text/html).
    """
    views = [o for o in cell(nb, cell_id).outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) == 1, f"{cell_id}: expected one widget, got {len(views)}"
    models = nb.metadata["widgets"][WIDGET_STATE]["state"]

    def model(ref: str) -> dict:
        return models[ref.removeprefix("IPY_MODEL_")]

    root = model(views[0].data[WIDGET_VIEW]["model_id"])
    assert root["model_name"] == "VBoxModel"
    caption, bar, row = (model(ref) for ref in root["state"]["children"][:3])
    button, status = (model(ref) for ref in row["state"]["children"])
    assert (caption["model_name"], bar["model_name"], button["model_name"], status["model_name"]) == (
        "LabelModel", "HTMLModel", "ButtonModel", "HTMLModel")
    button = dict(button["state"], layout=model(button["state"]["layout"])["state"])
    bundle = {k: v for k, v in views[0].data.items() if k != WIDGET_VIEW}
    return {"caption": caption["state"], "bar": bar["state"], "button": button, "status": status["state"],
            "bundle": bundle}


def widget_text(nb: nbformat.NotebookNode, cell_id: str) -> str:
    """The text/plain a cell's memory widget leaves beside its view (live or frozen)."""
    outs = [o for o in cell(nb, cell_id).outputs
            if o.output_type == "display_data" and ("oom-cell" in o.data.get("text/html", ""))]
    assert len(outs) == 1, f"{cell_id}: expected one memory view, got {len(outs)}"
    return outs[0].data["text/plain"]


# --------------------------------------------------------------------------- the generator


def test_notebooks_match_their_generator() -> None:
    """The committed .ipynb files are what make_notebooks.py writes, with no outputs."""
    import nbformat

    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "make_notebooks.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.main(["--check"]) == 0, "run: python notebooks/make_notebooks.py"
    for name in ("quickstart.ipynb", "oom-walkthrough.ipynb"):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code[0].source == "%load_ext oom_magic"
        assert all(c.outputs == [] and c.execution_count is None for c in code)
        assert len({c.id for c in nb.cells}) == len(nb.cells)


def test_binder_installs_cpu_torch_then_this_package() -> None:
    """binder/: torch from the PyTorch CPU index, never PyPI's CUDA build; then this repo, editable."""
    lines = [line.strip() for line in (REPO / "binder" / "requirements.txt").read_text().splitlines()]
    assert [line for line in lines if line and not line.startswith("#")] == [
        "--index-url https://download.pytorch.org/whl/cpu", "torch>=2.1"]
    post_build = REPO / "binder" / "postBuild"
    assert os.access(post_build, os.X_OK)
    assert 'python -m pip install --no-cache-dir -e ".[hf]"' in post_build.read_text()
    # A runtime.txt would put the kernel in a second environment, away from the widget frontend.
    assert not (REPO / "binder" / "runtime.txt").exists()


@pytest.mark.skipif(tomllib is None, reason="reading pyproject.toml needs tomllib (Python 3.11+)")
def test_binder_provides_every_module_the_notebooks_import() -> None:
    import nbformat

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installed = {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].replace("-", "_")
                 for spec in pyproject["dependencies"] + pyproject["optional-dependencies"]["hf"]}
    installed |= {"oom_magic"}
    for name in ("quickstart.ipynb", "oom-walkthrough.ipynb"):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        imported = set()
        for c in nb.cells:
            if c.cell_type != "code":
                continue
            python = "\n".join(re.sub(r"=\s*%.*$", "= None", line)  # snap = %gpumem -o
                                for line in c.source.splitlines() if not line.lstrip().startswith("%"))
            for node in ast.walk(ast.parse(python)):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    imported.add(node.module.split(".")[0])
        third_party = {m for m in imported if m not in sys.stdlib_module_names}
        assert third_party <= installed, f"{name} imports {sorted(third_party - installed)}, which Binder does not install"
        assert {"torch", "transformers"} <= imported


# --------------------------------------------------------------------------- quickstart


def test_quickstart_only_the_failed_load_raises(quickstart: nbformat.NotebookNode) -> None:
    failures = errors(quickstart)
    assert set(failures) == raising(quickstart) == {"stale-traceback"}
    # A real out-of-memory: 1 PiB asked of the cpu allocator (or of CUDA on a GPU).
    assert re.search(r"can't allocate memory|OutOfMemoryError|out of memory", failures["stale-traceback"])


def test_quickstart_load_runs_under_guardload(quickstart: nbformat.NotebookNode) -> None:
    printed = text(quickstart, "load")
    # Before the cell: cleanup, then the preflight read from the cell's source with the checkpoint's size.
    assert re.search(r"^preflight \(line 1\) → model: AutoModelForCausalLM\.from_pretrained\(MODEL_DIR, ", printed, re.M)
    assert f"(safetensors, 1 file): 11,356,416 parameters, {MODEL} as float32" in printed
    assert re.search(r" → fits, [\d.]+ [KMG]iB to spare$", printed, re.M), printed
    assert "lint" not in printed  # from_pretrained on a safetensors folder: nothing to change
    # After it: what the load cost, by variable.
    report = result(quickstart, "load").data["text/plain"]
    assert re.match(rf"%%guardload: ran in [\d.]+ s on {DEVICE} · ", report), report
    assert re.search(rf"^  model: {MODEL} float32 on {DEVICE} \(new\)$", report, re.M), report
    # and the room the loaded model has for KV cache now: what is free ÷ what its cache grows by per token
    room = re.search(rf"^  room for ([\d,]+) tokens of KV cache at batch 1 \(float32\) now: ([\d.]+) ([KMG])iB "
                     rf"(?:available|free) ÷ (.+) per token$", report, re.M)
    assert room is not None, report
    model = _notebook_llama("float32")
    per_token = (_cache_bytes(model, 1, 65) - _cache_bytes(model, 1, 1)) / 64
    assert room.group(4) == format_bytes(round(per_token))
    free = float(room.group(2)) * 2 ** (10 * "KMG".index(room.group(3)) + 10)  # as printed, to 2 decimals
    assert abs(int(room.group(1).replace(",", "")) * per_token - free) <= 0.005 * free + per_token


def test_quickstart_gpumem_names_the_model(quickstart: nbformat.NotebookNode) -> None:
    assert same(tensors(quickstart, "gpumem", "user"), MODEL)
    assert segment(quickstart, "gpumem", "stale") == "0 B"
    report = result(quickstart, "gpumem")
    assert re.search(rf"model\.lm_head\.weight\s+{EMBEDDINGS}\s+float32\s+16000×256\s+user", report.data["text/plain"])
    html = report.data["text/html"]
    assert "class='oom-snapshot'" in html and "model.model.embed_tokens.weight" in html


def test_quickstart_stale_memory_is_found(quickstart: nbformat.NotebookNode) -> None:
    # The output cache keeps the 32 MiB result; the stored traceback keeps the 43.32 MiB staged.
    assert same(tensors(quickstart, "gpumem-stale", "stale"), STALE)
    assert same(tensors(quickstart, "gpumem-stale", "user"), MODEL)
    report = result(quickstart, "gpumem-stale").data["text/plain"]
    assert f"stale is output-cache {OUTPUT_TENSOR}, traceback {MODEL}" in report
    assert re.search(rf"Out\[\d+\]\s+{OUTPUT_TENSOR}\s+float32\s+8388608\s+output-cache", report)
    assert re.search(r"sys\.last_traceback → frame load_all_at_once → local staged\['lm_head\.weight'\]", report)


def test_quickstart_gpumem_shows_and_o_returns(quickstart: nbformat.NotebookNode) -> None:
    # %gpumem as a cell's only line: displayed (display_data), nothing returned as the cell's result
    assert [o.output_type for o in cell(quickstart, "gpumem").outputs
            if "oom-cell" not in o.get("data", {}).get("text/html", "")] == ["display_data"]
    # snap = %gpumem -o: nothing shown, the Snapshot's figures printed from Python
    printed = text(quickstart, "gpumem-data")
    assert printed.startswith(f"stale {STALE}: "), printed
    assert f"'traceback': '{MODEL_BYTES / 2**20:.2f} MiB'" in printed and "'output-cache': '32.00 MiB'" in printed
    assert not [o for o in cell(quickstart, "gpumem-data").outputs if o.output_type != "stream"
                and "oom-cell" not in o.get("data", {}).get("text/html", "")]


def test_quickstart_fit_check_for_a_deployment_gpu(quickstart: nbformat.NotebookNode) -> None:
    report = result(quickstart, "fit-check").data["text/plain"]
    # the report speaks of the checkpoint named, not of a line of code the notebook never wrote
    assert report.startswith("checkpoint ") and "preflight (line" not in report and "from_pretrained" not in report
    assert re.search(rf"^checkpoint .+ \(safetensors, 1 file\): 11,356,416 parameters, {re.escape(MODEL_BF16)} as "
                     "bfloat16$", report, re.M), report
    assert re.search(rf"on a T4 this load needs {re.escape(MODEL_BF16)} of [\d.]+ GiB usable .*→ fits", report), report


def _notebook_llama(dtype: str):
    """The notebooks' tiny Llama (notebooks/make_notebooks.py's BUILD), built here in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16_000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def _cache_bytes(model, batch: int, tokens: int) -> int:
    """The bytes of the KV cache a real forward of ``batch`` x ``tokens`` leaves."""
    import torch

    from tests.sizing.families import cache_storage_bytes

    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 16_000, (batch, tokens)), use_cache=True)
    return cache_storage_bytes(out.past_key_values)


def test_quickstart_fit_for_the_job(quickstart: nbformat.NotebookNode) -> None:
    report = result(quickstart, "fit-job").data["text/plain"]
    assert re.match(r"\S*_models/tiny-llama: inference at context 512, batch 8 on T4 \([\d.]+ GiB usable each\)\n"
                    r"  fits, [\d.]+ GiB to spare\n", report), report
    kv = format_bytes(_cache_bytes(_notebook_llama("bfloat16"), 8, 512))  # the real cache of that job
    assert re.search(rf"^    weights +{re.escape(MODEL_BF16)}$", report, re.M), report
    assert re.search(rf"^    KV cache +{re.escape(kv)}$", report, re.M), report
    assert re.search(r"^  largest context at batch 8: [\d,]+ tokens", report, re.M), report


def test_quickstart_freeall_gives_stale_memory_back(quickstart: nbformat.NotebookNode) -> None:
    report = result(quickstart, "freeall").data["text/plain"]
    assert re.fullmatch(rf"freed {STALE} on {DEVICE} \(output-cache {OUTPUT_TENSOR}, traceback {MODEL}\)",
                        report.splitlines()[0]), report
    assert "%debug of that error is gone" in report
    # After it: nothing stale, and the user's model untouched.
    assert segment(quickstart, "gpumem-after", "stale") == "0 B"
    assert same(tensors(quickstart, "gpumem-after", "user"), MODEL)
    assert "Out[" not in result(quickstart, "gpumem-after").data["text/plain"]


def test_quickstart_widget_under_the_load(quickstart: nbformat.NotebookNode) -> None:
    caption = widget_text(quickstart, "load").splitlines()[0]
    assert re.fullmatch(rf"{DEVICE} · .+ used · this cell .+ · variables \+{MODEL} · stale 0 B( \(quick view\))?", caption), caption


def test_quickstart_widget_under_the_failed_load(quickstart: nbformat.NotebookNode) -> None:
    plain = widget_text(quickstart, "stale-traceback")
    # The after-cell view is the quick view (no heap scan) when a full scan would not fit its budget.
    assert re.search(rf" · out of memory · stale {STALE}( \(quick view\))?( \(\S+ \S+ of it file pages\))?$",
                     plain.splitlines()[0]), plain
    assert f"%freeall frees the {STALE} of stale tensors" in plain


def test_quickstart_button_code_path_frees_and_updates_in_place(quickstart: nbformat.NotebookNode) -> None:
    # What the cell printed after button.click() ...
    printed = text(quickstart, "click").splitlines()
    assert re.search(rf" · stale 0 B · freed {OUTPUT_TENSOR}$", printed[0]), printed
    assert printed[1] == f"freed {OUTPUT_TENSOR} (output-cache {OUTPUT_TENSOR})"
    # ... is the state the widget under "stale-again" was saved with: updated in place, button hidden.
    widget = memory_widget(quickstart, "stale-again")
    # newer widgets showed since: its caption says its figures are those of the click
    assert widget["caption"]["value"] == f"as of the click · {printed[0]}"
    assert widget["status"]["value"] == printed[1]
    assert widget["button"]["layout"]["display"] == "none"
    assert "oom-seg-stale" not in widget["bar"]["value"]
    # The export beside the view keeps what the cell showed when it ran (32 MiB stale).
    assert re.search(rf"stale {OUTPUT_TENSOR}( \(quick view\))?$", widget["bundle"]["text/plain"].splitlines()[0])
    assert "oom-cell" in widget["bundle"]["text/html"]


def test_quickstart_ends_with_a_button_to_click(quickstart: nbformat.NotebookNode) -> None:
    widget = memory_widget(quickstart, "try-it")
    assert widget["button"]["description"] == f"Free stale tensors ({OUTPUT_TENSOR})"
    assert widget["button"]["layout"]["display"] is None and widget["button"]["disabled"] is False
    assert re.search(rf" · stale {OUTPUT_TENSOR}( \(quick view\))?$", widget["caption"]["value"])
    assert "oom-seg-stale" in widget["bar"]["value"] and "oom-seg-user" in widget["bar"]["value"]
    assert widget["status"]["value"] == ""


def test_quickstart_plots_the_timeline(quickstart: nbformat.NotebookNode) -> None:
    plot = result(quickstart, "plot")
    assert plot.data["image/png"]
    # Every cell that ran before it, the failed load marked as out of memory.
    match = re.fullmatch(r"<Timeline (\S+): (\d+) cells, (\d+) out of memory, (\d+) labelled>", plot.data["text/plain"])
    assert match, plot.data["text/plain"]
    assert int(match.group(2)) >= 10 and match.group(3) == "1"


# --------------------------------------------------------------------------- walkthrough


def test_walkthrough_only_the_failed_load_raises(walkthrough: nbformat.NotebookNode) -> None:
    assert set(errors(walkthrough)) == raising(walkthrough) == {"leftover-traceback"}


def test_walkthrough_fix1_clear_leftovers(walkthrough: nbformat.NotebookNode) -> None:
    leftovers = format_bytes(EMBEDDING_BYTES + MODEL_BYTES)  # Out[N] (lm_head) + the traceback
    assert same(tensors(walkthrough, "fix1-before", "stale"), leftovers)
    # The playbook's gc.collect() + empty_cache() frees none of it ...
    assert same(tensors(walkthrough, "fix1-tutorial-after", "stale"), leftovers)
    # ... %freeall frees all of it.
    freed = result(walkthrough, "fix1-freeall").data["text/plain"].splitlines()[0]
    assert freed.startswith(f"freed {leftovers} on ") and f"(output-cache {EMBEDDINGS}, traceback {MODEL})" in freed
    assert segment(walkthrough, "fix1-after", "stale") == "0 B"


def test_walkthrough_fix2_cpu_first(walkthrough: nbformat.NotebookNode) -> None:
    assert same(tensors(walkthrough, "fix2-after-report", "user"), MODEL)
    assert "state['lm_head.weight']" in result(walkthrough, "fix2-after-report").data["text/plain"]
    report = result(walkthrough, "fix2-freeall").data["text/plain"]
    assert report.splitlines()[0] == "deleted `state`"
    assert re.search(rf"^freed {MODEL} on \S+ \(user {MODEL}\)$", report, re.M)


def test_walkthrough_fix2_guardload_lints_torch_load(walkthrough: nbformat.NotebookNode) -> None:
    before, after = text(walkthrough, "fix2-before"), text(walkthrough, "fix2-after")
    # The map_location lint fires only for a file saved from a GPU (a cpu-saved file comes back to the cpu).
    saved_from_gpu = "cuda:" in text(walkthrough, "fix2-before-report")
    map_lint = "lint (line 1): torch.load without map_location restores each tensor to the device it was saved from"
    assert (map_lint in before) == saved_from_gpu
    assert "without weights_only=True" in before
    assert "torch.load without map_location" not in after and "without weights_only=True" not in after
    for printed in (before, after):  # a pickle beside a safetensors file: say so either way
        assert "lint (line 1): pytorch_model.bin is a pickle, and model.safetensors beside it" in printed


def test_walkthrough_fix3_lower_precision(walkthrough: nbformat.NotebookNode) -> None:
    estimates = dict(re.findall(r"^\s*(\w+): (.+)$", text(walkthrough, "fix3-estimate"), re.M))
    assert estimates["float32"] == MODEL and estimates["bfloat16"] == MODEL_BF16
    assert mib(estimates["nf4"]) < mib(estimates["int8"]) < mib(MODEL_BF16)
    assert same(tensors(walkthrough, "fix3-fp32-report", "user"), MODEL)
    assert same(tensors(walkthrough, "fix3-bf16-report", "user"), MODEL_BF16)
    # %%guardload's own figures: the preflight's estimate for the dtype asked, then the cost.
    assert f"11,356,416 parameters, {MODEL_BF16} as bfloat16" in text(walkthrough, "fix3-bf16")
    assert re.search(rf"^  model: {MODEL_BF16} bfloat16 on {DEVICE} \(reassigned\)$",
                     result(walkthrough, "fix3-bf16").data["text/plain"], re.M)


def test_walkthrough_fix4_offloaded(walkthrough: nbformat.NotebookNode) -> None:
    device_map = text(walkthrough, "fix4-map")
    assert "'lm_head': 'disk'" in device_map or "'lm_head': 'cpu'" in device_map
    in_memory = tensors(walkthrough, "fix4-report", "user")
    assert mib(EMBEDDINGS) <= in_memory < mib(MODEL)
    assert "meta/fake tensors hold no device bytes" in result(walkthrough, "fix4-report").data["text/plain"]


def test_walkthrough_fix5_no_optimizer_state(walkthrough: nbformat.NotebookNode) -> None:
    whole = format_bytes(3 * MODEL_BYTES)  # weights + AdamW's exp_avg and exp_avg_sq (+ 4-byte step counters)
    optimizer = format_bytes(2 * MODEL_BYTES)
    assert (f"train-checkpoint.pt is a training checkpoint: 'optimizer_state_dict' holds {optimizer} of its {whole}"
            in text(walkthrough, "fix5-before"))
    assert same(tensors(walkthrough, "fix5-before-report", "user"), whole)
    assert "ckpt['optimizer_state_dict']['state'][0]['exp_avg']" in result(walkthrough, "fix5-before-report").data["text/plain"]
    assert re.search(rf"^freed {whole} on \S+ \(user {whole}\)$", result(walkthrough, "fix5-freeall").data["text/plain"], re.M)
    assert same(tensors(walkthrough, "fix5-after-report", "user"), MODEL)


def test_walkthrough_fix6_expandable_segments(walkthrough: nbformat.NotebookNode) -> None:
    printed = text(walkthrough, "fix6-setting").splitlines()
    if "device: cuda" in text(walkthrough, "setup"):  # CUDA started when the checkpoints were written
        assert printed[0].startswith("AllocatorSetting(action='needs-restart'"), printed
    else:  # before CUDA starts the guard turns expandable segments on
        assert printed[:2] == ["AllocatorSetting(action='set', variable='PYTORCH_CUDA_ALLOC_CONF', "
                               "value='expandable_segments:True')",
                               "PYTORCH_CUDA_ALLOC_CONF = expandable_segments:True"]


def test_walkthrough_fix7_safetensors(walkthrough: nbformat.NotebookNode) -> None:
    assert "lint (line 1): pytorch_model.bin is a pickle, and model.safetensors beside it" in text(walkthrough, "fix7-before")
    assert same(tensors(walkthrough, "fix7-before-report", "user"), MODEL)
    assert same(tensors(walkthrough, "fix7-after-report", "user"), EMBEDDINGS)
    assert "embeddings" in result(walkthrough, "fix7-after-report").data["text/plain"]
