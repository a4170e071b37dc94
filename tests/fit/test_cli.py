"""The fit check as a command (`python -m oom_magic fit`) and from Python (`oom_magic.fit_check`).

Real tiny transformers models saved locally (one file, sharded), real torch.save files, and a
Hugging Face cache laid out as huggingface_hub lays it out under a temporary HF_HOME. The
command's stdout, its one-line stderr and its exit status are checked: as a real subprocess for
each exit status (0, 1, 2, an argparse error), the hub cache and the torch-free import, and by its
real ``main`` in this process elsewhere (tests/fit/command.py: the same figures, seconds less each).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import oom_magic
from oom_magic.common.errors import OomMagicError
from oom_magic.fit.preflight import preflight_check
from tests.fit.command import ROOT, fit_here, fit_process

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A one-file model folder, a sharded one, a .bin and a .pt state dict, and a hub cache holding the model."""
    base = tmp_path_factory.mktemp("fit")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.float32)
    model.save_pretrained(base / "single")
    model.save_pretrained(base / "sharded", max_shard_size="100KB")
    torch.save(model.state_dict(), base / "weights.bin")
    torch.save({"w": torch.zeros(128, 64, dtype=torch.float16)}, base / "small.pt")
    (base / "config_only").mkdir()  # what a download that failed after config.json leaves
    shutil.copy(base / "single" / "config.json", base / "config_only" / "config.json")
    shutil.copytree(base / "sharded", base / "incomplete")
    shards = sorted((base / "incomplete").glob("model-*.safetensors"))
    shards[1].unlink()  # the index still names it
    (base / "training").mkdir()  # a real training checkpoint: Adam's state beside the weights
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, base / "training" / "ckpt.pt")
    adam_bytes = sum(t.nbytes for state in optimizer.state.values() for t in state.values())
    home = base / "hf_home"
    repo = home / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(base / "single", repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(base / "half")  # config.json declares bfloat16 (last: casts in place)
    return {"base": base, "params": params, "home": home, "commit": commit, "adam_bytes": adam_bytes}


def run_fit(*args: str, hf_home: Path | None = None, process: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m oom_magic fit ARGS`: as its own process when ``process`` (or a hub cache) is asked for;
    otherwise its ``main`` here (fit_here)."""
    if not process and hf_home is None:
        return fit_here(*args)
    return fit_process(*args, hf_home=hf_home, timeout=120)


def test_a_folder_that_fits_exits_0_with_the_guard_text(models):
    done = run_fit(str(models["base"] / "single"), "--device", "cpu", "--headroom", "0", process=True)
    assert done.returncode == 0, done.stderr
    assert f"{models['params']:,} parameters" in done.stdout
    # the report speaks of the checkpoint named, not of a line of code the user never wrote
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"checkpoint {models['base'] / 'single'} (safetensors, 1 file): "), first
    assert "preflight" not in done.stdout and "from_pretrained" not in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("fits on cpu: ")
    assert done.stderr == ""


def test_will_not_fit_on_a_target_exits_1_with_options_that_fit(models):
    # 15 GiB kept free on a T4 (15.x GiB usable) leaves less than the model: the guard's options follow
    done = run_fit(str(models["base"] / "single"), "--target", "T4", "--headroom", "15GiB")
    assert done.returncode == 1, done.stderr
    assert "→ WILL NOT FIT" in done.stdout and "ways to fit on a T4" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("WILL NOT FIT on a T4: ")
    # --target alone: the load runs on the T4, so this machine is not checked (nor said to lack a GPU)
    assert "and here" not in done.stdout and "this machine has no" not in done.stdout
    record = oom_magic.fit_check(str(models["base"] / "single"), target="T4", headroom="15GiB")
    assert record.checks[0].local is None and record.checks[0].call.runs_here is False
    both = oom_magic.fit_check(str(models["base"] / "single"), device="cuda", target="T4", headroom="15GiB")
    assert both.checks[0].local is not None  # a device given as well: checked here too


def test_the_options_of_a_check_that_does_not_fit_are_sized_in_one_child_process(models):
    # The command imports no torch: transformers' rules for float16, int8 and nf4 are asked of a child
    # Python, and each child costs seconds of imports. Counted by wrapping the one place children start.
    code = ("import sys\n"
            "from oom_magic.checkpoints import config_size\n"
            "from oom_magic.cli import main\n"
            "asked = []\n"
            "real = config_size.run_child\n"
            "config_size.run_child = lambda code, args, label: asked.append(args) or real(code, args, label)\n"
            "status = main(['fit', sys.argv[1], '--target', 'T4', '--headroom', '15GiB'])\n"
            "print('torch' in sys.modules, len(asked), status, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, str(models["base"] / "single")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"), timeout=120)
    assert done.stderr.split()[-3:] == ["False", "1", "1"], done.stderr
    assert all(row in done.stdout for row in ("bf16/fp16 ", "8-bit (bitsandbytes) ", "4-bit nf4, double quant"))


def test_json_holds_the_same_figures_as_fit_check(models):
    path = str(models["base"] / "single")
    done = run_fit(path, "--target", "16GiB", "--dtype", "bfloat16", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    check = oom_magic.fit_check(path, target="16GiB", dtype="bfloat16").checks[0]
    assert data["fits"] is True and data["verdict"] == "fits"
    assert data["checks"][0]["need"] == check.need == 2 * models["params"]
    assert data["checks"][0]["budget"] == check.budget and data["checks"][0]["dtype"] == "bfloat16"
    assert data["checks"][0]["target"]["name"] == "16GiB"


def test_quantization_sizes_follow_the_guard(models):
    path = str(models["base"] / "single")
    data = json.loads(run_fit(path, "--target", "T4", "--quantization", "nf4", "--json").stdout)
    cell = ("from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
            "m = AutoModelForCausalLM.from_pretrained(p, device_map='cuda', "
            "quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))")
    guard = preflight_check(cell, {"p": path}, target="T4")
    assert data["checks"][0]["need"] == guard.checks[0].need
    assert data["checks"][0]["dtype"] == "nf4"


def test_sharded_index_and_its_folder(models):
    folder = models["base"] / "sharded"
    index = folder / "model.safetensors.index.json"
    assert index.is_file()
    shards = len(list(folder.glob("*.safetensors")))
    assert shards > 1
    for path in (folder, index):
        data = json.loads(run_fit(str(path), "--device", "cpu", "--headroom", "0", "--json").stdout)
        assert data["checks"][0]["files"] == shards
        assert data["checks"][0]["parameters"] == models["params"]


def test_bin_and_pt_files(models):
    data = json.loads(run_fit(str(models["base"] / "weights.bin"), "--device", "cpu", "--headroom", "0", "--json").stdout)
    assert data["checks"][0]["parameters"] == models["params"] and data["fits"] is True
    assert data["checks"][0]["loader"] == "torch.load" and data["checks"][0]["source"] is None  # no code generated
    done = run_fit(str(models["base"] / "small.pt"), "--device", "cpu", "--headroom", "0", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "32.00 KiB as float32" in done.stdout  # 8192 fp16 values (16 KiB) cast to fp32


def test_a_cached_hub_id_resolves_offline(models):
    done = run_fit("tiny-org/tiny-llama", "--device", "cpu", "--headroom", "0", "--json", hf_home=models["home"])
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["checks"][0]["parameters"] == models["params"]
    missing = run_fit("tiny-org/not-cached", "--device", "cpu", "--headroom", "0", hf_home=models["home"])
    assert missing.returncode == 2 and missing.stdout == ""
    assert len(missing.stderr.strip().splitlines()) == 1
    # run_fit sets HF_HUB_OFFLINE=1: an uncached id is not read from the hub (tests/checkpoints/test_hub.py)
    assert "tiny-org/not-cached is not in the local hub cache (" in missing.stderr
    assert "HF_HUB_OFFLINE=1 is set, so nothing was checked" in missing.stderr


@pytest.mark.parametrize("args, says", [
    (["/no/such/model"], "no such file or folder: /no/such/model; pass a checkpoint folder"),
    (["{single}", "--target", "X9"], "unknown target 'X9': give a size such as 16GiB or one of T4"),
    (["{single}", "--dtype", "int3"], "unknown dtype 'int3': use one of float32, float16, bfloat16"),
    (["{single}", "--quantization", "int2"], "unknown quantization 'int2': use one of int8, nf4, fp4"),
    (["{single}", "--headroom", "lots"], "cannot read headroom 'lots'"),
    (["{single}", "--device", "cpu", "--headroom", "0", "--target", "T4"], "not allowed with argument"),
    (["{bin}", "--quantization", "int8"], "pass the folder that holds it"),
    (["{single}", "--device", "cuda:0"], "pass --target GPU"),  # this machine has no GPU: nothing to check
    ([], "the following arguments are required: CHECKPOINT"),
])
def test_bad_input_exits_2_with_one_line_naming_the_fix(models, args, says):
    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda:0 can be checked here")
    args = [a.format(single=models["base"] / "single", bin=models["base"] / "weights.bin") for a in args]
    done = run_fit(*args, process=not args or args[0] == "/no/such/model")  # argparse's error and ours, as a process
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oom-magic"), done.stderr
    assert says in lines[0]
    assert "Traceback" not in done.stderr


def test_the_command_does_not_import_torch(models):
    code = ("import sys; from oom_magic.cli import main; rc = main(['fit', sys.argv[1], '--device', 'cpu']); "
            "print('torch' in sys.modules, rc)")
    done = subprocess.run([sys.executable, "-c", code, str(models["base"] / "weights.bin")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "False 0"


def test_console_script_points_at_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["oom-magic"].partition(":")
    assert module == "oom_magic.cli" and func == "main"
    from oom_magic import cli

    assert getattr(cli, func) is cli.main


def test_fit_check_from_python_is_the_guard_record(models):
    path = str(models["base"] / "single")
    record = oom_magic.fit_check(path, device="cpu", headroom="1MiB")
    cell = "model = AutoModelForCausalLM.from_pretrained(p, device_map='cpu')"
    guard = preflight_check(cell, {"p": path}, headroom="1MiB")
    assert isinstance(record, oom_magic.Preflight) and record.fits is True
    assert record.checks[0].need == guard.checks[0].need and record.checks[0].headroom == 2**20
    # code is checked as written, names resolved against the namespace given
    from_code = oom_magic.fit_check(cell, namespace={"p": path}, target="T4")
    assert from_code.checks[0].target is not None and from_code.checks[0].need == guard.checks[0].need
    with pytest.raises(OomMagicError, match="write them in the call"):
        oom_magic.fit_check(cell, dtype="bfloat16")
    with pytest.raises(OomMagicError, match="no such file or folder"):
        oom_magic.fit_check("/no/such/model")


def test_a_config_only_folder_says_no_weights_were_found(models):
    done = run_fit(str(models["base"] / "config_only"), "--device", "cpu", "--headroom", "0")
    assert done.returncode == 0, done.stderr  # sized from the config: a plan before a download is a real use
    first, *_, verdict = done.stdout.strip().splitlines()
    assert first == (f"checkpoint {models['base'] / 'config_only'}: no weight files found; sized from config.json "
                     f"(the model it describes): {models['params']:,} parameters, 417.25 KiB as float32")
    assert verdict.startswith("fits on cpu (no weights found: sized from config.json): needs 417.25 KiB")
    assert 4 * models["params"] == 417.25 * 1024  # the figure printed is the real fp32 size of the model


def test_a_shard_index_naming_missing_shards_is_an_incomplete_download(models):
    done = run_fit(str(models["base"] / "incomplete"), "--device", "cpu")
    assert done.returncode == 2 and "fits" not in done.stdout
    assert done.stdout.count("the download is incomplete") == 1  # the reason said once
    assert "not checked:" in done.stdout and "cannot size" in done.stdout
    assert done.stderr.strip().splitlines() == [
        "oom-magic fit: nothing was checked; download the checkpoint again (its shard index names files that are "
        "not there)"]
    data = run_fit(str(models["base"] / "incomplete"), "--device", "cpu", "--json")
    assert data.returncode == 2 and data.stderr == ""
    parsed = json.loads(data.stdout)
    assert parsed["verdict"] == "unknown" and "the download is incomplete" in parsed["checks"][0]["reason"]
    assert data.stdout.count("the download is incomplete") == 1


@pytest.mark.parametrize("args, says", [
    (["/no/such/model"], "no such file or folder: /no/such/model; pass a checkpoint folder"),
    (["{single}", "--target", "X9"], "unknown target 'X9'"),
    (["{single}", "--device", "cpu", "--target", "T4"], "not allowed with argument"),
    ([], "the following arguments are required: CHECKPOINT"),
])
def test_json_errors_are_json(models, args, says):
    args = [a.format(single=models["base"] / "single") for a in args]
    done = run_fit(*args, "--json", process=not args)
    assert done.returncode == 2 and done.stderr == ""
    data = json.loads(done.stdout)
    assert data["verdict"] == "error" and says in data["error"] and list(data) == ["verdict", "error"]


def test_json_target_source_and_lint_figures(models):
    unsized = json.loads(run_fit(str(models["base"] / "incomplete"), "--target", "T4", "--json").stdout)
    assert unsized["checks"][0]["target"]["name"] == "T4"  # asked about a T4, even though nothing was sized
    ckpt = models["base"] / "training" / "ckpt.pt"
    data = json.loads(run_fit(str(ckpt), "--device", "cpu", "--json").stdout)
    lint = next(x for x in data["lints"] if x["code"] == "training-checkpoint")
    optimizer, total = dict(lint["sizes"])["optimizer"], dict(lint["sizes"])["total"]
    # Adam's exp_avg and exp_avg_sq (fp32) and a step per parameter, as torch holds them, to the byte
    assert optimizer == models["adam_bytes"] > 2 * 4 * models["params"]
    assert "{" not in lint["message"] and "of its" in lint["message"]
    from oom_magic.render.units import format_bytes

    assert f"{format_bytes(optimizer)} of its {format_bytes(total)}" in lint["message"]
    assert lint["line"] is None and lint["text"].startswith("lint: ")
    # a cell's call comes back whole, however long
    cell = ("model = AutoModelForCausalLM.from_pretrained(p, device_map='cpu', low_cpu_mem_usage=True, "
            "attn_implementation='eager', trust_remote_code=False, revision='main', use_safetensors=True)")
    from oom_magic.render.fit import fit_dict

    source = fit_dict(oom_magic.fit_check(cell, namespace={"p": str(models["base"] / "single")}))["checks"][0]["source"]
    assert len(cell.split(" = ", 1)[1]) > 120 and source == cell.split(" = ", 1)[1] and "…" not in source


def test_a_lint_on_a_named_checkpoint_names_the_flag_not_code(models):
    record = oom_magic.fit_check(str(models["base"] / "half"), device="cpu", dtype="float32")
    lint = record.lint("fp32-of-half")
    assert lint is not None and lint.line is None
    assert lint.fix == 'pass --dtype bfloat16 (dtype="bfloat16" in fit_check())'
    assert dict(lint.sizes) == {"fp32": 4 * models["params"], "half": 2 * models["params"]}
    cell = "m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)"
    written = oom_magic.fit_check(cell, namespace={"p": str(models["base"] / "half")}).lint("fp32-of-half")
    assert written is not None and written.fix.startswith("pass dtype=torch.bfloat16") and written.line == 1
