"""Write notebooks/quickstart.ipynb and notebooks/oom-walkthrough.ipynb from the cells below.

The notebooks are generated so they can be reviewed as code: edit this file, run
``python notebooks/make_notebooks.py``, and commit the script together with the two .ipynb files
it writes (outputs empty). ``--check`` exits 1 when a committed notebook differs from what this
script writes (tests/notebook/test_notebooks.py runs it).

Both notebooks run unchanged on a CUDA GPU and on cpu, build their models locally from configs
(under notebooks/_models/, gitignored; no hub, no download) and stay small enough to run in
about a minute on two CPU cores.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Cell ids are stable so tests (tests/notebook/test_notebooks.py) can find a cell by what it is for.
# A cell tagged "raises-exception" is one whose error is the point: nbclient and JupyterLab's
# "Run All" carry on past it.


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell from an indented triple-quoted string."""
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(cell_id: str, source: str, *, raises: bool = False) -> nbformat.NotebookNode:
    """A code cell with a stable id; ``raises`` tags it as failing on purpose."""
    metadata = {"tags": ["raises-exception"]} if raises else {}
    return new_code_cell(textwrap.dedent(source).strip("\n"), id=cell_id, metadata=metadata)


def notebook(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    """A python3 notebook holding ``cells`` with no outputs."""
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    # Markdown cells get ids too, derived from their position, so regenerating is byte-stable.
    for n, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            cell.id = f"md-{n:02d}"
    nbformat.validate(nb)
    return nb


def setup(model_dir: str) -> str:
    """The setup cell of both notebooks (each keeps its model in its own folder)."""
    return SETUP.replace("MODEL_DIR = ...", f"MODEL_DIR = \"{model_dir}\"")


# The same setup for both notebooks: imports, the device, and a tiny Llama saved locally.
SETUP = '''
import gc
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

transformers.utils.logging.disable_progress_bar()
device = "cuda" if torch.cuda.is_available() else "cpu"
MODEL_DIR = ...  # built below from a config: no hub, no download
print(f"device: {device}; torch {torch.__version__}; transformers {transformers.__version__}")
'''

BUILD = '''
def build_tiny_llama(path: str) -> None:
    """Save a randomly initialised 4-layer Llama: 11.4M parameters, 43 MiB in fp32."""
    config = LlamaConfig(vocab_size=16_000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


if not Path(MODEL_DIR, "model.safetensors").exists():
    build_tiny_llama(MODEL_DIR)
gc.collect()  # the builder's model is gone; collect its reference cycles now
print(sorted(os.listdir(MODEL_DIR)))
'''


# A load that fails part-way: the stored exception keeps the function's frame and what it staged.
FAILED_LOAD = '''
from safetensors.torch import load_file


def load_all_at_once(path: str) -> None:
    """Stage every weight, then ask for far more memory than the device has."""
    staged = load_file(f"{path}/model.safetensors", device=device)  # 43 MiB in this frame
    workspace = torch.empty(2**50, dtype=torch.uint8, device=device)  # 1 PiB: out of memory


load_all_at_once(MODEL_DIR)
'''

CHECKPOINTS = '''
TRAIN_CKPT = "_models/train-checkpoint.pt"
PICKLE_CKPT = f"{MODEL_DIR}/pytorch_model.bin"


def save_other_checkpoints() -> None:
    """Write the pickled weights (saved from `device`) and a one-step AdamW training checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).to(device)
    torch.save(model.state_dict(), PICKLE_CKPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.tensor([[1, 2, 3]], device=device)).logits.sum().backward()
    opt.step()
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "step": 1}, TRAIN_CKPT)


if not (Path(TRAIN_CKPT).exists() and Path(PICKLE_CKPT).exists()):
    save_other_checkpoints()
gc.collect()
if device == "cuda":
    torch.cuda.empty_cache()
for path in (f"{MODEL_DIR}/model.safetensors", PICKLE_CKPT, TRAIN_CKPT):
    print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
'''


def quickstart() -> nbformat.NotebookNode:
    """The five-minute tour: load under %%guardload, %gpumem, stale memory, %freeall, the timeline."""
    return notebook([
        md("""
        # oom-magic quickstart

        `oom-magic` shows what is using your GPU's memory and who holds it, frees the memory
        nobody can use any more, and guards the cell that loads a model. This notebook runs
        unchanged on a CUDA GPU and on the cpu (where the figures are the cpu's tensor bytes),
        with a small Llama built from a config and saved under `_models/` — nothing is downloaded.

        Load the extension once per kernel. From then on, a cell that changes device memory gets a
        small memory widget under its output. It keeps to 50 ms: on a heap too big to scan in that
        time (a kernel with torch and transformers imported usually is), it shows the *quick view* —
        what your variables, the output cache and tracebacks hold — and says so; `%gpumem` and the
        widget's button always scan everything.
        """),
        code("load-ext", "%load_ext oom_magic"),
        code("setup", setup("_models/tiny-llama")),
        md("""
        ## A model to load

        A randomly initialised 4-layer Llama (11.4M parameters: 43 MiB in fp32), saved the way
        `save_pretrained` saves any checkpoint. The second run of this cell reuses it.
        """),
        code("build", BUILD),
        md("""
        ## Load it under `%%guardload`

        `%%guardload` reads the cell before running it: it frees stale memory, estimates what the
        checkpoint needs on the target device and says whether it fits. After the cell it reports
        what the load cost, and how many tokens of KV cache the loaded model has room for now; on
        out-of-memory it gives back what the failed load left and says what to change, with this
        model's sizes.
        """),
        code("load", """
        %%guardload
        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, device_map=device)
        """),
        md("""
        ## `%gpumem`: where the memory is, and who holds it

        The bar splits this process's memory into *user* (reachable from your variables), *stale*
        (held only by the output cache, a stored traceback or garbage) and the rest; the table
        names the holders by the paths you would type. Like `%timeit`, `%gpumem` shows its report
        wherever it is in the cell; `%gpumem -o` returns the same figures as a `Snapshot` instead.
        """),
        code("gpumem", "%gpumem --top 5"),
        md("""
        ## Two ways notebooks keep memory you can no longer use

        1. A tensor shown as a cell's result: IPython keeps it in `Out[N]` (and `_`) after you
           delete every variable that pointed at it.
        2. A load that fails: the stored exception keeps the failing function's frames, and with
           them every tensor the function had staged.

        The second cell below fails on purpose, with a real out-of-memory error.
        """),
        code("stale-output", """
        torch.ones(8 * 2**20, device=device)  # 32 MiB shown as this cell's result: Out[] keeps it
        """),
        code("stale-traceback", FAILED_LOAD, raises=True),
        code("gpumem-stale", "%gpumem --top 5"),
        code("gpumem-data", """
        # -o: the Snapshot is returned, not shown; its figures as data
        snap = %gpumem -o
        print(f"stale {snap.stale_bytes / 2**20:.2f} MiB:", {kind: f"{b / 2**20:.2f} MiB" for kind, b in snap.bytes_by_kind})
        """),
        md("""
        ## `%freeall`: give stale memory back

        Without names, `%freeall` drops only what nothing of yours can reach: output-cache entries
        that hold tensors, the stored exception's frames (its printed traceback stays on screen),
        garbage cycles; then it empties PyTorch's cache. It never deletes or changes a variable of
        yours (`%freeall model` would delete `model`, and say what still holds its memory).
        """),
        code("freeall", "%freeall"),
        code("gpumem-after", "%gpumem --top 5"),
        md("""
        ## The widget's button

        Under a cell that left stale memory, the widget offers **Free stale tensors**: the same
        cleanup as `%freeall`, after which the widget shows, in place, what came back and the stale
        figure at 0. Below, a new 32 MiB result, and then, from code, exactly what a click runs
        (`button.click()` calls the button's handler in the kernel). It runs inside a function so
        that no variable is left holding the widget.
        """),
        code("stale-again", """
        torch.zeros(8 * 2**20, device=device)  # another 32 MiB kept by Out[]
        """),
        code("click", '''
        def click_free_button() -> None:
            """Do what a click on "Free stale tensors" under the previous cell does; print the widget's caption."""
            import oom_magic

            widget = oom_magic.latest_widget()  # the widget under the previous cell
            widget.button.click()  # runs the button's handler in the kernel, as a click does
            print(widget.caption.value)
            print(widget.status.value)


        click_free_button()
        '''),
        md("""
        ## The timeline

        `%gpumem --plot` draws the device's memory over the cells this kernel ran: allocated,
        reserved and each cell's peak on a GPU (on the cpu: resident memory, its peak and tensor
        bytes), with out-of-memory cells marked and `%%guardload` cells labelled.
        `%gpumem --plot timeline.png` also saves it.
        """),
        code("plot", "%gpumem --plot"),
        md("""
        ## Before you deploy: will it fit there?

        `oom_magic.fit_check` is `%%guardload`'s fit check from Python: a checkpoint (folder, file,
        or a hub id already in the local cache) checked against a device, or against the GPU it will
        be deployed on, from its headers only. In a CI pipeline the same check is a command whose
        exit status says whether it fits: `oom-magic fit _models/tiny-llama --target T4 --dtype bfloat16`.
        """),
        code("fit-check", """
        import oom_magic

        oom_magic.fit_check(MODEL_DIR, target="T4", dtype="bfloat16")
        """),
        md("""
        ## Fit for the job

        Weights that load can still run out of memory at the first long `generate`. With
        `context=` (tokens the KV cache holds: prompt + generated) and `batch=`, the check sizes
        the job: the KV cache transformers keeps for this model, the prompt's forward, and the
        longest context and largest batch that fit. In a `%%guardload` cell the same comes from
        the cell itself (`model.generate(..., max_new_tokens=N)`, `TrainingArguments`,
        `LoraConfig`) or from `--context N --batch B`.
        """),
        code("fit-job", """
        oom_magic.fit_check(MODEL_DIR, target="T4", dtype="bfloat16", context=512, batch=8)
        """),
        md("""
        ## Your turn

        The cell below leaves one more 32 MiB result in the output cache. In JupyterLab, Notebook 7
        or VS Code, click **Free stale tensors** in the widget under it: the caption's stale figure
        drops to 0 and the widget says what was freed.
        """),
        code("try-it", """
        torch.full((8 * 2**20,), 2.0, device=device)  # 32 MiB for the button to free
        """),
    ])


def walkthrough() -> nbformat.NotebookNode:
    """Each fix of the OOM-during-model-loading playbook, with the extension's report before and after."""
    return notebook([
        md("""
        # Out of memory while loading a model: the fixes, measured

        Each section takes one fix from the playbook for CUDA out-of-memory errors during model
        loading and shows `oom-magic`'s report before and after it: `%gpumem` for what holds the
        device, `%%guardload` for what a load will need and what it cost, `%freeall` for what came
        back. It runs unchanged on a CUDA GPU and, without one, on the cpu with the same small
        models (a 43 MiB Llama built from a config; nothing is downloaded), where the figures are
        the cpu's tensor bytes.
        """),
        code("load-ext", "%load_ext oom_magic"),
        code("setup", setup("_models/walkthrough-llama")),
        code("build", BUILD),
        md("""
        Two more checkpoints of the same model, as other tools write them: a pickled state dict
        saved from the device (`pytorch_model.bin`, beside the safetensors file), and a training
        checkpoint that also holds AdamW's state — two more tensors the size of every weight.
        """),
        code("checkpoints", CHECKPOINTS),
        md("""
        ## Fix 1: clear leftover state

        A notebook collects memory nobody can use: a layer shown as a cell's result stays in
        `Out[N]` (here the output head of a model that was never assigned), and a load that failed
        keeps, in its stored traceback, every tensor it had staged.
        """),
        code("leftover-output", """
        AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, device_map=device).lm_head
        """),
        code("leftover-traceback", FAILED_LOAD, raises=True),
        code("fix1-before", "%gpumem --top 3"),
        md("""
        The playbook's first fix is `gc.collect()` then `torch.cuda.empty_cache()`. Neither frees
        these: the output cache and the stored exception are live references, not garbage, and the
        cache holds only memory that no tensor uses.
        """),
        code("fix1-tutorial", """
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        """),
        code("fix1-tutorial-after", "%gpumem --top 3"),
        md("""
        `%freeall` drops exactly those references — the output-cache entries that hold tensors and
        the stored exception's frames — then collects and empties the cache. It never touches a
        variable of yours.
        """),
        code("fix1-freeall", "%freeall"),
        code("fix1-after", "%gpumem --top 3"),
        md("""
        ## Fix 2: load on the cpu first

        `torch.load` restores every tensor to the device it was saved from, so a checkpoint saved on
        `cuda:0` lands on `cuda:0` — full, or absent — before you decide anything. `%%guardload`
        reads the cell before it runs and, when the file was saved from a GPU, flags the missing
        `map_location`; it flags a missing `weights_only` either way. On a GPU the first cell below
        puts the weights on `cuda:0`; on the cpu the file was saved from the cpu, so both land on
        the cpu and only the `weights_only` lint shows.
        """),
        code("fix2-before", """
        %%guardload
        state = torch.load(PICKLE_CKPT)
        """),
        code("fix2-before-report", "%gpumem --top 3"),
        code("fix2-after", """
        %%guardload
        state = torch.load(PICKLE_CKPT, map_location="cpu", weights_only=True)
        """),
        code("fix2-after-report", "%gpumem --device cpu --top 3"),
        md("""
        With the weights on the cpu you decide when they move: build the model on the cpu, load the
        state dict into it, and move it in one step. `%freeall state --device cpu` then deletes the
        state dict (the model has its own copy) and says what came back on the cpu.
        """),
        code("fix2-move", """
        model = LlamaForCausalLM(transformers.AutoConfig.from_pretrained(MODEL_DIR))
        model.load_state_dict(state)
        model = model.to(device)
        """),
        code("fix2-freeall", "%freeall state --device cpu"),
        md("""
        ## Fix 3: lower precision

        The estimate reads only the checkpoint's header. A 7B model is 28 GiB in fp32 and 14 GiB in
        bf16; 8-bit and 4-bit keep embeddings and the output head in bf16, so they come to more than
        the rule of thumb's 7 and 3.5 GiB. Each load below replaces `model`; `%%guardload` reports
        what the load cost.
        """),
        code("fix3-estimate", """
        import oom_magic
        from oom_magic.render.units import format_bytes

        estimate = oom_magic.estimate_checkpoint(MODEL_DIR)
        for dtype in ("float32", "bfloat16", "int8", "nf4"):
            print(f"{dtype:>9}: {format_bytes(estimate.bytes_for(dtype))}")
        """),
        code("fix3-fp32", """
        %%guardload
        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, device_map=device)
        """),
        code("fix3-fp32-report", "%gpumem --top 3"),
        code("fix3-bf16", """
        %%guardload
        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, device_map=device)
        """),
        code("fix3-bf16-report", "%gpumem --top 3"),
        md("""
        ## Fix 4: sharded and offloaded loading

        `device_map="auto"` fills the devices in order — GPUs, then the cpu, then disk — within
        `max_memory`, and writes what does not fit to `offload_folder`. The budget below is tiny on
        purpose, so that this small model has to be split: on a GPU part of it lands on `cuda:0`
        and the rest on the cpu; on the cpu part of it stays in memory and the rest is offloaded to
        disk. Offloaded weights sit on the `meta` device and cost no memory until they are used.
        """),
        code("fix4-offload", """
        %%guardload
        MAX_MEMORY = {0: "40MiB", "cpu": "1GiB"} if device == "cuda" else {"cpu": "40MiB"}
        model = AutoModelForCausalLM.from_pretrained(
            MODEL_DIR, dtype=torch.float32, device_map="auto", max_memory=MAX_MEMORY,
            offload_folder="_models/offload",
        )
        """),
        code("fix4-map", "print({name: str(where) for name, where in model.hf_device_map.items()})"),
        code("fix4-report", "%gpumem --top 3"),
        md("""
        ## Fix 5: do not load optimizer state

        A training checkpoint holds the weights and AdamW's two moments for each of them: three
        times what inference needs. `%%guardload` flags a training checkpoint loaded whole. (First,
        `%freeall model` deletes the offloaded model of Fix 4.)
        """),
        code("fix5-free-model", "%freeall model"),
        code("fix5-before", """
        %%guardload
        ckpt = torch.load(TRAIN_CKPT, map_location="cpu", weights_only=True)
        """),
        code("fix5-before-report", "%gpumem --device cpu --top 3"),
        md("""
        Load only the weights. With `mmap=True` the file is mapped, not read: the optimizer's
        tensors are never copied into memory, and after `del ckpt` nothing refers to them.
        """),
        code("fix5-freeall", "%freeall ckpt --device cpu"),
        code("fix5-after", """
        ckpt = torch.load(TRAIN_CKPT, map_location="cpu", weights_only=True, mmap=True)
        weights = ckpt["model_state_dict"]
        del ckpt
        """),
        code("fix5-after-report", "%gpumem --device cpu --top 3"),
        md("""
        ## Fix 6: fragmentation

        When the device has enough free memory in total but no single free block as large as the
        request, the load fails anyway. PyTorch's caching allocator can grow its segments instead of
        cutting memory into fixed blocks: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`. The
        setting is read once, when CUDA starts, so it must be in the environment before the first
        CUDA tensor. `%%guardload` sets it when CUDA has not started yet and says so
        (`--no-expandable` leaves it alone); when CUDA is already running it says that the setting
        needs a kernel restart. (In this notebook CUDA starts in the cell that wrote the
        checkpoints, so on a GPU the guard says so; in the quickstart the guarded load comes first.)
        Memory PyTorch keeps reserved but unused shows as *cache* in `%gpumem`, and `%freeall`
        gives it back to the driver.

        The cell below asks the guard's own rule what it does before a load onto `cuda:0`, on a
        copy of the environment, so it runs (and changes nothing) on a machine without a GPU.
        """),
        code("fix6-setting", """
        from oom_magic.guard.pipeline import allocator_setting

        env = dict(os.environ)  # a copy: nothing here changes this kernel
        print(allocator_setting(env, "cuda:0", initialized=torch.cuda.is_initialized()))
        print("PYTORCH_CUDA_ALLOC_CONF =", env.get("PYTORCH_CUDA_ALLOC_CONF"))
        if device == "cuda":
            print("this kernel's PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
            print(torch.cuda.memory_summary(abbreviated=True))
        """),
        md("""
        ## Fix 7: safetensors

        A pickled checkpoint runs code when it is read and is copied whole into memory. A
        safetensors file is a header and raw bytes: it is memory-mapped, read tensor by tensor, and
        put straight on the device. `%%guardload` points at the `.safetensors` file beside a pickle.
        """),
        code("fix7-freeall", "%freeall weights --device cpu"),
        code("fix7-before", """
        %%guardload
        state = torch.load(PICKLE_CKPT, map_location="cpu", weights_only=True)
        """),
        code("fix7-before-report", "%gpumem --device cpu --top 3"),
        code("fix7-after", """
        from safetensors import safe_open

        del state
        with safe_open(f"{MODEL_DIR}/model.safetensors", framework="pt", device=device) as f:
            embeddings = f.get_tensor("model.embed_tokens.weight")  # one tensor; nothing else is read
        """),
        code("fix7-after-report", "%gpumem --top 3"),
    ])


NOTEBOOKS = {"quickstart.ipynb": quickstart, "oom-walkthrough.ipynb": walkthrough}


def main(argv: list[str] | None = None) -> int:
    """Write the notebooks (or, with --check, say which committed ones are out of date)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook differs")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write to (default: notebooks/)")
    args = parser.parse_args(argv)
    stale = []
    for name, build in NOTEBOOKS.items():
        text = nbformat.writes(build()) + "\n"
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python notebooks/make_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
