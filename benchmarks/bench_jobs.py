"""A job's parts, predicted (sizing) vs measured on tiny real models, beside the rules of thumb.

For each family: the KV cache's peak of a generate (prompt 48, 16 new tokens, batch 2) as sized
on the meta device, as really held (the cache's storages after the prompt and at the end), and as
a window-sized formula and a full-context formula would say; for fine-tunes: weights + gradients
+ optimizer state after a real AdamW / LoRA step, beside accelerate's estimate-memory rule (4x the
weights for Adam); and one training step's activations (its peak beyond the gradients, from the
PyTorch profiler's memory events) with and without gradient checkpointing and under bf16 autocast.
Written to benchmarks/JOBS.md by ``make bench`` (benchmarks/run.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

BATCH, PROMPT, NEW = 2, 48, 16


def _window_formula(config: Any, tokens: int, dtype_bytes: int) -> int | None:
    """Bytes of a per-layer formula: kv_heads x head_dim x tokens (capped at the window), keys and values."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    hidden, attention_heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not (layers and heads and hidden and attention_heads):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // attention_heads
    window = getattr(config, "sliding_window", None)
    # a config with a window and no per-layer types (Mistral) slides on every layer
    types = getattr(config, "layer_types", None) or [("sliding_attention" if window else "full_attention")] * layers
    total = 0
    for kind in types:
        held = min(tokens, window) if window and kind == "sliding_attention" else tokens
        total += 2 * BATCH * heads * head_dim * held * dtype_bytes
    return total


def _inference(family: str, root: Path) -> dict[str, Any]:
    import torch

    from oom_magic.sizing.probe import probe_job
    from tests.sizing.families import build, cache_storage_bytes

    model = build(family)
    model.config.save_pretrained(root / family)
    ids = torch.randint(3, 256, (BATCH, PROMPT))
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            first = model(input_ids=ids, decoder_input_ids=torch.zeros(BATCH, 1, dtype=torch.long), use_cache=True)
            context = PROMPT + NEW
        else:
            first = model(input_ids=ids, use_cache=True)
            context = PROMPT + NEW - 1
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    measured = max(cache_storage_bytes(first.past_key_values), cache_storage_bytes(out.past_key_values))
    probe = probe_job(root / family / "config.json", "float32", batch=BATCH, prompt=PROMPT, context=context)
    config = model.config
    window = _window_formula(config, context, 4)
    full = None
    if window is not None:
        full = _window_formula(type(config)(**{**config.to_dict(), "sliding_window": None}), context, 4)
    return {"family": family, "job": f"generate {PROMPT}+{NEW}, batch {BATCH}",
            "predicted": max(probe.kv_after_prompt, probe.kv_at_context), "measured": measured,
            "window_formula": window, "full_context_formula": full}


def _training(family: str, kind: str, root: Path) -> dict[str, Any]:
    import torch

    from oom_magic.sizing.probe import probe_job
    from oom_magic.sizing.training import gradient_bytes, optimizer_bytes
    from tests.sizing.families import build

    model = build(family, torch.bfloat16).train()
    model.config.save_pretrained(root / family)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if kind == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    ids = torch.randint(3, 256, (BATCH, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    real = sum(p.numel() * p.element_size() for p in model.parameters())  # weights + adapters
    real += sum(p.grad.numel() * p.grad.element_size() for p in trained)
    real += sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    probe = probe_job(root / family / "config.json", "bfloat16", batch=1, prompt=4, context=4,
                      lora_r=8 if kind == "lora" else 0)
    rows = probe.adapters if kind == "lora" else probe.parameters
    predicted = (sum(r[3] for r in probe.parameters) + sum(r[3] for r in probe.adapters)
                 + gradient_bytes(rows) + optimizer_bytes(rows, "adamw"))
    return {"family": family, "job": f"{kind} AdamW step, bf16", "predicted": predicted, "measured": real,
            "accelerate_4x": 4 * weights}


def _split(root: Path, gpus: int = 2) -> dict[str, Any]:
    """llama-gqa, 8 layers, over 2 GPUs: each GPU's weights + cache, oom-magic vs accelerate's map and a real
    generate's cache (layer i with decoder layer i), beside the even share the sum of the GPUs implies."""
    import torch
    import transformers
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    from oom_magic.fit.job_fit import job_fit
    from oom_magic.fit.targets import parse_target
    from oom_magic.records.job import Job
    from tests.sizing.families import FAMILIES, cache_storage_bytes

    name, kwargs = FAMILIES["llama-gqa"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(getattr(transformers, name)(**{**kwargs, "num_hidden_layers": 8})).eval()
    model.save_pretrained(root / "split")
    usable = 50 << 20
    memory = {i: usable for i in range(gpus)}
    balanced = get_balanced_memory(model, max_memory=memory, no_split_module_classes=sorted(model._no_split_modules))
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=sorted(model._no_split_modules))

    def placed(key: str) -> Any:
        while key not in device_map:
            key = key.rpartition(".")[0]
        return device_map[key]

    measured = [0] * gpus
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
        measured[placed(key)] += tensor.numel() * tensor.element_size()
    ids = torch.randint(3, 256, (BATCH, PROMPT))
    with torch.no_grad():
        cache = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True).past_key_values
    for index, layer in enumerate(cache.layers):
        measured[placed(f"model.layers.{index}")] += cache_storage_bytes(layer)
    reserve = (1 << 40) - parse_target(f"{1 << 40}B").usable
    fit = job_fit(root / "split", Job(context=PROMPT + NEW - 1, batch=BATCH, prompt=PROMPT),
                  f"{gpus}x{usable + reserve}B")
    assert fit.parts.split is not None
    return {"job": f"llama-gqa 8 layers, generate {PROMPT}+{NEW}, batch {BATCH}, {gpus} GPUs",
            "measured": measured, "predicted": [s.weights + s.kv_cache for s in fit.parts.split.shares],
            "with_forward": list(fit.parts.per_device), "even_share": -(-fit.parts.total // gpus)}


STEP_BATCH, STEP_CONTEXT = 4, 64


def _step_activations(family: str, checkpointing: bool, mixed: bool, root: Path) -> dict[str, Any]:
    """One real cpu training step's peak beyond what it leaves (the profiler), beside the probe's figure."""
    import torch

    from oom_magic.sizing.probe import TrainStep, probe_job
    from tests.sizing.families import build, profiled_peak

    model = build(family).train()
    model.set_attn_implementation("eager")
    model.config.save_pretrained(root / family)
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = torch.randint(3, 256, (STEP_BATCH, STEP_CONTEXT))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
        loss.backward()

    peak, live = profiled_peak(step)
    probe = probe_job(root / family / "config.json", "float32", batch=STEP_BATCH, prompt=STEP_CONTEXT,
                      context=STEP_CONTEXT, train_step=TrainStep(checkpointing, "bf16" if mixed else None))
    how = ("bf16 autocast, " if mixed else "") + ("checkpointing" if checkpointing else "no checkpointing")
    return {"family": family, "job": how, "predicted": probe.train_activations, "measured": peak - live,
            "weight_casts": probe.weight_casts}


def run() -> dict[str, Any]:
    from tests.sizing.families import FAMILIES

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        inference = [_inference(family, root) for family in sorted(FAMILIES)]
        # peft has no default LoRA targets for Mixtral: it is fine-tuned in full only
        training = [_training(family, kind, root) for family, kind in (
            ("llama-gqa", "full"), ("llama-gqa", "lora"), ("gpt2", "full"), ("gpt2", "lora"), ("mixtral-moe", "full"))]
        split = [_split(root)]
        steps = [_step_activations(family, checkpointing, False, root)
                 for family in ("llama-gqa", "gpt2", "mistral-sliding", "mixtral-moe", "gemma2-alternating")
                 for checkpointing in (False, True)]
        steps += [_step_activations(family, checkpointing, True, root)
                  for family in ("llama-gqa", "gpt2") for checkpointing in (False, True)]
    return {"inference": inference, "training": training, "split": split, "step_activations": steps}


def _cell(value: int | None, truth: int) -> str:
    if value is None:
        return "n/a"
    return f"{value:,} ({(value - truth) / truth:+.0%})" if truth else f"{value:,}"


def markdown(result: dict[str, Any]) -> str:
    """JOBS.md: predicted vs measured per family and job, beside the rules of thumb."""
    lines = ["# A job's parts: predicted vs measured", "",
             "Written by `make bench` (benchmarks/bench_jobs.py) on tiny real models on the cpu, float32 caches. "
             "Bytes; in brackets the error against what was measured.", "",
             "## KV cache at its peak (a generate: the prompt's forward, then decoding)", "",
             "| family | job | measured | oom-magic | window formula | full-context formula |",
             "|---|---|---|---|---|---|"]
    for row in result.get("inference", []):
        m = row["measured"]
        lines.append(f"| {row['family']} | {row['job']} | {m:,} | {_cell(row['predicted'], m)} | "
                     f"{_cell(row['window_formula'], m)} | {_cell(row['full_context_formula'], m)} |")
    lines += ["", "## Fine-tuning: weights + adapters + gradients + optimizer state after one AdamW step", "",
              "AdamW's `step` counters live on the host and are left out of both columns.", "",
              "| family | job | measured | oom-magic | accelerate estimate-memory (4x weights) |", "|---|---|---|---|---|"]
    for row in result.get("training", []):
        m = row["measured"]
        lines.append(f"| {row['family']} | {row['job']} | {m:,} | {_cell(row['predicted'], m)} | "
                     f"{_cell(row['accelerate_4x'], m)} |")
    lines += ["", f"## Fine-tuning: one training step's activations (batch {STEP_BATCH} x {STEP_CONTEXT} tokens, "
              "eager attention, float32 weights)", "",
              "The step's peak during forward and backward beyond what it leaves (the gradients): measured by the "
              "PyTorch profiler's memory events of a real cpu step, predicted on fake tensors in the sizing child. "
              "Under bf16 autocast the prediction includes autocast's bf16 copies of the weights (shown); the cpu's "
              "bf16 matmul also allocates a weight-sized scratch buffer inside the kernel, which it leaves out.", "",
              "| family | step | measured | oom-magic | of which autocast's weight copies |", "|---|---|---|---|---|"]
    for row in result.get("step_activations", []):
        m = row["measured"]
        lines.append(f"| {row['family']} | {row['job']} | {m:,} | {_cell(row['predicted'], m)} | "
                     f"{row['weight_casts']:,} |")
    lines += _split_markdown(result.get("split", []))
    return "\n".join(lines) + "\n"


def _split_markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Inference over several GPUs: each GPU's weights + KV cache under device_map=\"auto\"", "",
             "Measured: accelerate's map (balanced max_memory) of the real model, its tensors and a real generate's "
             "cache summed per GPU. With the prompt's forward: what the verdict checks on each GPU. The even share is "
             "the whole job over the GPUs, as judging against the sum of their memory did; in brackets its error "
             "against the figure with the forward.", "",
             "| job | GPU | measured | oom-magic | with the prompt's forward | even share |", "|---|---|---|---|---|---|"]
    for row in rows:
        for gpu, (m, p, f) in enumerate(zip(row["measured"], row["predicted"], row["with_forward"], strict=True)):
            lines.append(f"| {row['job']} | {gpu} | {m:,} | {_cell(p, m)} | {f:,} | {_cell(row['even_share'], f)} |")
    return lines


if __name__ == "__main__":
    import json
    import sys

    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
    outcome = run()
    print(json.dumps(outcome, indent=1))
    (Path(__file__).resolve().parent / "JOBS.md").write_text(markdown(outcome))
