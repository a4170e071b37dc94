"""Estimator vs what a load really holds, and a load's predicted vs measured host-memory peak.

Models: Llama, GPT-2, BERT, T5, Mixtral and Qwen2-MoE from small configs, saved locally in
bfloat16 safetensors (no hub). For bf16/fp16/int8/nf4 each row compares
``estimate_checkpoint(...).bytes_for(dtype)`` (header arithmetic alone, and with transformers'
rules: ``follow_transformers=True``) with what is really held:

- bf16 / fp16: the real model loaded by ``from_pretrained(dtype=...)``, its parameters and
  persistent buffers counted once (transformers applies ``_keep_in_fp32_modules`` itself);
- int8 / nf4: bitsandbytes needs a CUDA GPU and is not installed on this cpu machine, so the real
  model is loaded in bfloat16 and every module bitsandbytes would replace (each ``nn.Linear`` /
  ``Conv1D`` of the *loaded* model outside transformers' not-convert list) is sized by
  bitsandbytes' documented layout: int8 (``Linear8bitLt``) = int8 weight + a float32 ``SCB`` per
  output row; nf4 (``Linear4bit``, blocksize 64) = ceil(n/2) packed bytes + a float32 absmax per
  64 + the layer's 16-float code. The rest counts as loaded.

Load peaks: each load in a fresh interpreter, its resident high-water mark reset just before
(/proc/self/clear_refs) and read after (VmHWM), against ``load_peak``'s prediction.

``run()`` returns the rows; ``markdown(result)`` is benchmarks/ESTIMATES.md (``benchmarks/run.py``
writes it). Run alone: ``python benchmarks/bench_estimate_truth.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("llama", "gpt2", "bert", "t5", "mixtral", "qwen2_moe")
DTYPES = ("bfloat16", "float16", "int8", "nf4")

_MEASURE = r'''
import json, re, sys, gc, torch, transformers as T
path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
def status(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
cls = getattr(T, T.AutoConfig.from_pretrained(path).architectures[0])
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
model = cls.from_pretrained(path, dtype=dtype)
print(json.dumps({"peak": status("VmHWM") - before, "after": status("VmRSS") - before}))
'''


def _build(name: str, big: bool = False):  # type: ignore[no-untyped-def]
    import transformers as T

    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=1024 if big else 128, intermediate_size=2816 if big else 344, num_hidden_layers=4 if big else 2,
            num_attention_heads=8, num_key_value_heads=8 if big else 4, vocab_size=32000 if big else 1000,
            tie_word_embeddings=False))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=256))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=512, vocab_size=1000))
    if name == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=1000, d_model=128, d_kv=32, d_ff=512,
                                                       num_layers=2, num_heads=4))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=8000 if big else 1000, hidden_size=512 if big else 128, intermediate_size=1024 if big else 256,
            num_hidden_layers=4 if big else 2, num_attention_heads=8 if big else 4, num_key_value_heads=4 if big else 2,
            num_local_experts=8, num_experts_per_tok=2))
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=8000 if big else 1000, hidden_size=512 if big else 128, intermediate_size=1024 if big else 256,
        moe_intermediate_size=512 if big else 128, shared_expert_intermediate_size=1024 if big else 256,
        num_hidden_layers=4 if big else 2, num_attention_heads=8 if big else 4, num_key_value_heads=4 if big else 2,
        num_experts=8, num_experts_per_tok=2))


def _held(model, sized=None) -> int:  # type: ignore[no-untyped-def]
    """Parameters and persistent buffers, each once; ``sized`` may size a replaced module's weight."""
    seen: set[int] = set()
    total = 0
    for module_name, module in model.named_modules():
        items = list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, tensor in items:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            custom = sized(module_name, module, name, tensor) if sized else None
            total += custom if custom is not None else tensor.numel() * tensor.element_size()
    return total


def really_held(path: Path, dtype: str) -> int:
    """What the load holds (see the module docstring for int8/nf4)."""
    import torch
    import transformers as T
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    cls = getattr(T, T.AutoConfig.from_pretrained(path).architectures[0])
    if dtype in ("bfloat16", "float16"):
        return _held(cls.from_pretrained(path, dtype=getattr(torch, dtype)))
    model = cls.from_pretrained(path, dtype=torch.bfloat16)
    skip = HfQuantizer.get_modules_to_not_convert(model, None, sorted(model._keep_in_fp32_modules or ()))

    def sized(module_name, module, name, tensor):  # type: ignore[no-untyped-def]
        linear = type(module) is torch.nn.Linear or isinstance(module, Conv1D)
        if name != "weight" or not linear or not should_convert_module(module_name, skip):
            return None
        n = tensor.numel()
        if dtype == "int8":
            return n + 4 * (tensor.shape[1] if isinstance(module, Conv1D) else tensor.shape[0])
        return (n + 1) // 2 + 4 * -(-n // 64) + 64

    return _held(model, sized)


def measure_peak(path: Path, dtype: str) -> dict[str, int]:
    """A real load's host peak and what it keeps, in a fresh process (VmHWM reset before it)."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(path), dtype], capture_output=True, text=True,
                          timeout=600, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run() -> dict[str, Any]:
    """Every estimate row and every load-peak row."""
    import torch

    sys.path.insert(0, str(ROOT))
    from oom_magic.checkpoints.estimate import estimate_checkpoint
    from oom_magic.fit.load_peak import load_peak

    rows: list[dict[str, Any]] = []
    peaks: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in MODELS:
            torch.manual_seed(0)
            path = root / name
            _build(name).to(torch.bfloat16).save_pretrained(path)
            before = estimate_checkpoint(path, follow_transformers=False)
            now = estimate_checkpoint(path, follow_transformers=True)
            for dtype in DTYPES:
                truth = really_held(path, dtype)
                rows.append({"model": name, "dtype": dtype, "held": truth, "before": before.bytes_for(dtype),
                             "now": now.bytes_for(dtype)})
        for name, saved, dtype in (("llama", "bfloat16", "float32"), ("llama", "float32", "bfloat16"),
                                   ("llama", "bfloat16", "bfloat16"), ("mixtral", "bfloat16", "bfloat16"),
                                   ("mixtral", "bfloat16", "float32"), ("qwen2_moe", "bfloat16", "bfloat16")):
            torch.manual_seed(0)
            path = root / f"big-{name}-{saved}"
            _build(name, big=True).to(getattr(torch, saved)).save_pretrained(path)
            predicted = load_peak(estimate_checkpoint(path, follow_transformers=False), dtype)
            measured = measure_peak(path, dtype)
            peaks.append({"model": name, "saved": saved, "dtype": dtype, "loaded": predicted.loaded if predicted else None,
                          "predicted": predicted.peak if predicted else None, "mapped": predicted.mapped if predicted else None,
                          "measured_peak": measured["peak"], "measured_after": measured["after"]})
    return {"rows": rows, "peaks": peaks, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def _pct(value: int, truth: int) -> str:
    return f"{100 * (value - truth) / truth:+.2f}%" if truth else "n/a"


def markdown(result: dict[str, Any]) -> str:
    """benchmarks/ESTIMATES.md from ``run()``'s result."""
    mib = 1 << 20
    if "error" in result:
        return f"# Estimates vs really held\n\nbench_estimate_truth.py failed: {result['error']}\n"
    lines = ["# Estimates vs really held (bench_estimate_truth.py)", "",
             f"torch {result.get('torch')}, transformers {result.get('transformers')}; models from small configs, "
             "saved as bfloat16 safetensors. *held*: bf16/fp16 = the real `from_pretrained(dtype=...)` model's "
             "parameters and persistent buffers; int8/nf4 = bitsandbytes is not installed on this cpu machine, so "
             "the real bf16 model's replaceable Linear/Conv1D weights are sized by bitsandbytes' documented layout "
             "(int8: int8 + float32 SCB per row; nf4: packed nibbles + float32 absmax per 64 + 16-float code) and "
             "the rest counted as loaded. *before*: header arithmetic alone; *now*: with transformers' rules "
             "(`follow_transformers=True`, hf_rules.py).", "",
             "| model | dtype | held (B) | before (B) | before error | now (B) | now error |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['held']:,} | {r['before']:,} | {_pct(r['before'], r['held'])} "
                     f"| {r['now']:,} | {_pct(r['now'], r['held'])} |")
    worst = max(abs(r["now"] - r["held"]) / r["held"] for r in result["rows"])
    lines += ["", f"Worst error now: {100 * worst:.3f}% over {len(result['rows'])} figures.", "",
              "## Host-memory peak of a cpu load (load_peak.py)", "",
              "Each load in a fresh interpreter; VmHWM reset just before `from_pretrained` and read after. "
              "*mapped*: weights left as views of the file (not resident until read).", "",
              "| model | saved | loaded as | weights (MiB) | predicted peak (MiB) | measured peak (MiB) | "
              "measured / predicted | mapped (MiB) | RSS after (MiB) |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for p in result["peaks"]:
        ratio = f"{p['measured_peak'] / p['predicted']:.2f}" if p["predicted"] else "n/a (nothing copied)"
        lines.append(f"| {p['model']} | {p['saved']} | {p['dtype']} | {p['loaded'] / mib:.1f} | {p['predicted'] / mib:.1f} "
                     f"| {p['measured_peak'] / mib:.1f} | {ratio} | {p['mapped'] / mib:.1f} | {p['measured_after'] / mib:.1f} |")
    lines += ["", "A same-dtype load copies nothing (its peak is the loader's own ~10 MiB); its weights become "
              "resident only as they are read, so the preflight's RAM need is the larger of the peak and the "
              "weights.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    outcome = run()
    (HERE / "ESTIMATES.md").write_text(markdown(outcome))
    print(markdown(outcome))
