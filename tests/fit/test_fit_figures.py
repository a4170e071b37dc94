"""Issue 25, points 2-7 and 12: the fit check's figures add up, its hints can be followed, and the loads
users write (transformers' pipeline(), vLLM's LLM()) are sized.

Each point goes through the surface the user touched: the `oom-magic fit` command (a subprocess
under a real address-space limit, its real ``main`` in this process elsewhere: tests/fit/command.py),
a real IPython shell running %%guardload (in a child process under a real RLIMIT_AS for the check
before and the diagnosis after), and ``oom_magic.fit_check`` from Python. Real tiny transformers
models, a real GPT-2 trained one AdamW step, a real tokenizer built offline. vLLM is not installed
here: its call is only read and sized, never run.
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import oom_magic
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.fit.options import bitsandbytes_installed
from oom_magic.render.units import format_bytes
from tests.fit.command import ROOT, fit_here, fit_process

# Its module fixtures (two saved models, a command run) are built once, on one xdist worker.
pytestmark = pytest.mark.xdist_group("fit_figures")

MiB = 2**20
# A Llama whose float32 copy (~160 MiB) and its cast's RAM peak differ by tens of MiB.
WIDE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)


def run_fit(*args: str, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m oom_magic fit ARGS`; with ``limit`` (its address-space limit in bytes, as ``ulimit -v``
    sets it) as its own process, else its main here."""
    return fit_here(*args) if limit is None else fit_process(*args, limit=limit, timeout=180)


def _option(stdout: str, label: str) -> str:
    """An option's row and the code lines wrapped below it, joined into one line."""
    lines = stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip().startswith(label))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("      "):  # the code under a row is indented past the rows
            break
        block.append(line.strip())
    return " ".join(block)


def _flat(text: str) -> str:
    """Text with its wrapped lines joined (wrapping is for the eye; the words are the same)."""
    return " ".join(text.split())


def _bytes(text: str) -> float:
    """A size as format_bytes prints it, back to bytes (to its two-decimal rounding)."""
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fitfigs")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**WIDE)).to(torch.bfloat16).save_pretrained(base / "bf16")
    LlamaForCausalLM(LlamaConfig(**WIDE)).to(torch.float32).save_pretrained(base / "fp32")
    return {"bf16": base / "bf16", "fp32": base / "fp32", "base": base}


# --------------------------------------------------------------------------- 2: one budget before and after


CHILD = textwrap.dedent('''
    import json, resource, sys
    import psutil, torch
    from transformers import AutoModelForCausalLM
    from IPython.testing.globalipapp import start_ipython
    path, room, headroom = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ip = start_ipython()
    ip.run_line_magic("load_ext", "oom_magic")
    ip.run_cell(f"import torch\\nfrom transformers import AutoModelForCausalLM\\npath = {path!r}")
    ip.run_cell("_w = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16); del _w")  # imports done
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + room, hard))  # ulimit -v
    try:
        ip.run_cell_magic("guardload", f"--device cpu --headroom {headroom}",
                          "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\\n")
        print(json.dumps({"outcome": "ok"}))
    except MemoryError as exc:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        report = exc.oom_report
        check = report.preflight.checks[0]
        cause = report.diagnosis.cause("too-big")
        rows = lambda options: [[o.kind, o.device_bytes, o.fits, [list(m) for m in o.max_memory]] for o in options]
        print(json.dumps({"outcome": report.outcome, "budget": check.budget, "need": check.need,
                          "before": rows(check.options), "after": rows(cause.options if cause else ())}))
''')


@pytest.mark.parametrize("headroom", ["0", "5%"])
def test_the_check_before_and_the_diagnosis_after_agree_under_ulimit_v(models, tmp_path, headroom):
    """A real from_pretrained under a real address-space limit fails; both sides size the same options
    against the same budget (before: bf16 'too big' and after 'fits', for the same 80 MiB)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(script), str(models["fp32"]), str(48 * MiB), headroom],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "oom", done.stdout[-3000:]
    assert result["budget"] < result["need"]
    assert result["before"] and result["after"] == result["before"]  # one budget, one set of sizes
    half = {kind: fits for kind, _, fits, _ in result["before"]}
    assert half["bfloat16"] is False  # 80 MiB of bf16 does not fit in < 48 MiB, before or after
    # no plan that gives accelerate no RAM to stage the weights through
    assert not any(["cpu", 0] in plan for *_, plan in result["after"])
    assert "diagnosis (cpu)" in done.stdout


# --------------------------------------------------------------------------- 3: every short subtracts


def test_short_is_need_minus_budget_on_its_line_and_strict_says_the_same(models, ip):
    """bf16 on disk, loaded as float32 on the cpu: the RAM peak (the cast beside the file pages) is the need.

    The budget is set by a real address-space limit (ulimit -v) on the command, so that the weights
    fit it and the peak does not, whatever else runs on this machine.
    """
    estimate = estimate_checkpoint(models["bf16"])
    weights = estimate.bytes_for("float32")
    args = (str(models["bf16"]), "--device", "cpu", "--dtype", "float32", "--headroom", "0")
    probe = json.loads(run_fit(*args, "--json", limit=4 * 2**30).stdout)
    vms = 4 * 2**30 - probe["checks"][0]["free"]  # the command's own address space at the check
    done = run_fit(*args, limit=vms + weights + 30 * MiB)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "WILL NOT FIT" in x)
    m = re.search(r"= ([\d.]+ \w+) → WILL NOT FIT: needs ([\d.]+ \w+) at the load's RAM peak \(copies beside the file "
                  r"pages read; ([\d.]+ \w+) once loaded\), ([\d.]+ \w+) short$", line)
    assert m, line
    budget, peak, loaded, short = (_bytes(g) for g in m.groups())
    assert loaded == _bytes(format_bytes(weights)) and budget > weights  # the weights alone would fit
    assert abs((peak - budget) - short) <= 0.02 * MiB  # need − budget, to the printed rounding (3 figures)
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith(f"WILL NOT FIT on cpu: needs {m.group(2)} at the load's RAM peak")
    assert verdict.endswith(f"{m.group(4)} short") or f"{m.group(4)} short;" in verdict

    from IPython.core.error import UsageError

    ip.user_ns["path"] = str(models["bf16"])
    ip.run_cell("import torch\nfrom transformers import AutoModelForCausalLM")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + weights + 30 * MiB, hard))
    try:
        with pytest.raises(UsageError) as info:  # --strict: the cell is refused, nothing is allocated
            ip.run_cell_magic("guardload", "--strict --device cpu --headroom 0",
                              "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\n")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    strict = str(info.value)
    s = re.search(r"needs ([\d.]+ \w+) at the load's RAM peak \(copies beside the file pages read; ([\d.]+ \w+) "
                  r"once loaded\), ([\d.]+ \w+) short", strict)
    assert s, strict
    assert _bytes(s.group(1)) == peak and _bytes(s.group(2)) == loaded  # the same need as the command's
    assert 0 < _bytes(s.group(3)) < peak - weights + 1 * MiB


# --------------------------------------------------------------------------- 4: a training checkpoint


def test_a_training_checkpoint_counts_the_model_and_shows_its_optimizer_state(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=512, n_positions=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss.backward()
    opt.step()
    path = tmp_path / "train-step1.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, path)

    def elements(tensors) -> int:  # per storage, as torch.save writes them (tied weights once)
        seen = {}
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return sum(seen.values())

    model_elements = elements(model.state_dict().values())
    state = [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    optimizer_elements = elements(state)
    assert optimizer_elements > 2 * model_elements - 1000  # exp_avg + exp_avg_sq (+ steps): the bulk of the file

    done = run_fit(str(path), "--device", "cpu", "--headroom", "0")
    assert done.returncode == 0, done.stderr
    assert (f"{model_elements:,} parameters + optimizer state {optimizer_elements:,} elements "
            f"({format_bytes(sum(t.untyped_storage().nbytes() for t in state))}, read by torch.load too)") in done.stdout
    assert f"{model_elements + optimizer_elements:,} parameters" not in done.stdout
    as_json = json.loads(run_fit(str(path), "--device", "cpu", "--json").stdout)
    check = as_json["checks"][0]
    assert (check["parameters"], check["optimizer_elements"]) == (model_elements, optimizer_elements)


# --------------------------------------------------------------------------- 5: which nf4


@pytest.fixture(scope="module")
def t4_float32(models) -> subprocess.CompletedProcess[str]:
    """The command for the float32 model on a T4 with 14 GiB kept free: it will not fit, options follow."""
    return run_fit(str(models["fp32"]), "--target", "T4", "--headroom", "14GiB", "--dtype", "float32")


def test_each_nf4_figure_says_its_double_quantization(models, t4_float32):
    asked = run_fit(str(models["fp32"]), "--target", "T4", "-q", "nf4", "--dtype", "bfloat16")
    plain = re.search(r"([\d.]+ \w+) as nf4 without double quantization", asked.stdout)
    assert plain, asked.stdout
    row = _option(t4_float32.stdout, "4-bit nf4")
    assert "4-bit nf4, double quant (bitsandbytes)" in row and "bnb_4bit_use_double_quant=True" in row
    double = re.search(r"\)\s+([\d.]+ \w+) on T4", row)
    assert double and _bytes(double.group(1)) < _bytes(plain.group(1))  # the two figures, each with its setting


# --------------------------------------------------------------------------- 6: the lint names the checkpoint's own copy


def test_the_safetensors_lint_names_only_the_checkpoints_own_file(tmp_path):
    from safetensors.torch import save_file

    weights = {"w": torch.zeros(64, 64)}
    torch.save(weights, tmp_path / "train-step1.pt")
    save_file({"emb": torch.zeros(16, 8)}, tmp_path / "unrelated-embeddings.safetensors")
    done = run_fit(str(tmp_path / "train-step1.pt"), "--device", "cpu", "--json")
    codes = [x["code"] for x in json.loads(done.stdout)["lints"]]
    assert "safetensors-sibling" not in codes and "unrelated-embeddings" not in done.stdout

    save_file(weights, tmp_path / "train-step1.safetensors")
    done = run_fit(str(tmp_path / "train-step1.pt"), "--device", "cpu")
    assert "load train-step1.safetensors with safetensors.torch.load_file" in done.stdout
    assert "unrelated-embeddings" not in done.stdout


# --------------------------------------------------------------------------- 7: options that can run here


def test_options_say_what_they_need_and_use_float16_where_bf16_is_not_native(models, t4_float32):
    t4 = t4_float32
    assert t4.returncode == 1, t4.stderr
    half = _option(t4.stdout, "bf16/fp16")
    assert "dtype=torch.float16" in half and "bfloat16" not in half  # T4: compute capability 7.5
    if not bitsandbytes_installed():
        quantized = [x for x in t4.stdout.splitlines() if "(bitsandbytes)" in x]
        assert len(quantized) == 2 and all("needs bitsandbytes" in x for x in quantized), t4.stdout
        assert "need bitsandbytes, not installed here: pip install bitsandbytes (NVIDIA GPUs" in _flat(t4.stdout)
        # the verdict's hint is an option that can run here, never one that needs a missing package
        assert "BitsAndBytesConfig" not in t4.stdout.strip().splitlines()[-1]
    a100 = run_fit(str(models["fp32"]), "--target", "A100-80GB", "--headroom", "79.5GiB", "--dtype", "float32")
    assert "dtype=torch.bfloat16" in _option(a100.stdout, "bf16/fp16")


# --------------------------------------------------------------------------- 12: pipeline() and vLLM's LLM()


@pytest.fixture(scope="module")
def chat_model(models) -> Path:
    """A tiny Llama with a real tokenizer (built offline), so that pipeline() really runs."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = models["base"] / "chat"
    LlamaForCausalLM(LlamaConfig(**dict(WIDE, vocab_size=64))).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(62)} | {"[UNK]": 62, "[EOS]": 63}
    core = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(path)
    return path


def test_a_guarded_pipeline_cell_is_sized_and_runs(ip, chat_model, capsys):
    ip.user_ns["path"] = str(chat_model)
    cell = ("from transformers import pipeline\n"
            "pipe = pipeline('text-generation', model=path, device='cpu', dtype=torch.float16)\n")
    ip.run_cell("import torch")
    report = ip.run_cell_magic("guardload", "--device cpu --headroom 0", cell)
    (check,) = report.preflight.checks
    assert (check.call.kind, check.device, check.dtype, check.verdict) == ("pipeline", "cpu", "float16", "fits")
    assert check.need == estimate_checkpoint(chat_model).bytes_for("float16")
    assert report.outcome == "ok" and ip.user_ns["pipe"].model.dtype == torch.float16
    assert "no such file or folder" not in capsys.readouterr().out


def test_fit_check_sizes_a_pipeline_call_and_its_model_kwargs(models):
    path = str(models["fp32"])
    estimate = estimate_checkpoint(path)
    on_gpu = oom_magic.fit_check(f"pipe = pipeline('text-generation', model={path!r}, device=0, dtype=torch.float16)",
                                 target="T4")
    (check,) = on_gpu.checks
    assert (check.call.kind, check.verdict, check.need) == ("pipeline", "fits", estimate.bytes_for("float16"))
    kwargs = oom_magic.fit_check(f"pipe = pipeline('text-generation', model={path!r}, device=-1, "
                                 "model_kwargs={'dtype': torch.bfloat16})", device="cpu")
    assert (kwargs.checks[0].device, kwargs.checks[0].need) == ("cpu", estimate.bytes_for("bfloat16"))


def test_vllm_reserves_its_share_and_needs_weights_plus_one_sequence_of_kv_cache(models):
    path = str(models["bf16"])
    estimate = estimate_checkpoint(path)
    config = json.loads((models["bf16"] / "config.json").read_text())
    per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                 * config["hidden_size"] // config["num_attention_heads"] * 2)  # bf16 keys and values
    fits = oom_magic.fit_check(f"llm = LLM(model={path!r}, gpu_memory_utilization=0.5, max_model_len=2048)",
                               target="T4")
    (check,) = fits.checks
    t4 = check.target
    assert check.call.kind == "vllm" and check.verdict == "fits"
    assert check.reserve == int(t4.total * 0.5) and check.kv_cache == per_token * 2048
    assert check.need == estimate.bytes_for("bfloat16") + per_token * 2048
    text = str(fits)
    assert f"vLLM reserves {format_bytes(check.reserve)} up front (gpu_memory_utilization 0.5" in text
    assert f"{format_bytes(per_token * 2048)} of KV cache for one 2,048-token sequence" in text

    # A reservation too small for one full-length sequence: the shortfall and the max_model_len that fits.
    util = (estimate.bytes_for("bfloat16") + per_token * 1000) / t4.total
    short = oom_magic.fit_check(f"llm = LLM(model={path!r}, gpu_memory_utilization={util:.6f})", target="T4")
    (check,) = short.checks
    assert check.verdict == "will-not-fit" and check.max_model_len == config["max_position_embeddings"]
    assert f"{format_bytes(check.need - check.reserve)} short" in str(short)
    room = check.reserve - estimate.bytes_for("bfloat16")
    assert f"max_model_len={room // per_token:,} fits in the reservation" in str(short)
    assert math.isclose(room // per_token, 1000, abs_tol=20)  # util is written to 6 decimals

    # More than the GPU has free: vLLM refuses to start.
    greedy = oom_magic.fit_check(f"llm = LLM(model={path!r}, gpu_memory_utilization=0.99)", target="T4")
    assert greedy.checks[0].verdict == "will-not-fit" and "vLLM refuses to start" in str(greedy)


def test_code_without_a_load_call_says_so_in_one_line():
    result = oom_magic.fit_check("x = 1 + 1")
    assert result.fits is None and result.notes == (
        "no load call found (from_pretrained, pipeline, vllm.LLM, llama_cpp.Llama, torch.load, load_file): nothing to size",)
    done = run_fit("x = 1 + 1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no load call found" in done.stderr


def test_a_local_t4_gets_float16_not_bfloat16(models, use_nvml, ip):
    """This machine's own GPU (a FAKE NVML T4: compute capability 7.5, no GPU here) decides the half dtype too."""
    from oom_magic.device.nvml import Nvml
    from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

    use_nvml(Nvml(FakeNvml([FakeGpu(name="Tesla T4", total=15360 * MiB, used=15000 * MiB,
                                    compute_capability=(7, 5))]).module))
    from IPython.core.error import UsageError

    ip.user_ns["path"] = str(models["fp32"])
    with pytest.raises(UsageError) as info:  # --strict: refused before anything runs
        ip.run_cell_magic("guardload", "--strict --device cuda:0 --headroom 0",
                          "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map='cuda')\n")
    assert "will not fit on cuda:0" in str(info.value)
    check = oom_magic.fit_check(f"m = AutoModelForCausalLM.from_pretrained({str(models['fp32'])!r}, "
                                "dtype=torch.float32, device_map='cuda')").checks[0]
    half = next(o for o in check.options if o.kind == "bfloat16")
    assert half.dtype == "float16" and half.code() == "dtype=torch.float16"
