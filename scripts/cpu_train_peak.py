"""One AdamW-style training step of GPU check 10's 1.1B Llama on the cpu, against the probe (issue 22).

    .venv/bin/python scripts/cpu_train_peak.py      # ~2 minutes on 2 cores, ~15 GiB of RAM

Prints the sizing's activations for the job (fp32, eager, batch 2 x 512) and, from the PyTorch
profiler's memory events, the real step's peak beyond what it leaves (its gradients) for two loops:
the one the probe sizes and transformers' Trainer runs (the loss alone is kept through backward),
and one that holds the model's outputs (float32 logits) through backward, as the GPU check first
did. Measured 2026-12-04: probe 602,017,800 B; the Trainer's loop 602,017,928 B; the held-output
loop 800,198,792 B (an H200 measured 868,357,120 B for that loop).
"""
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import oom_magic  # noqa: E402
from tests.sizing.families import profiled_peak  # noqa: E402

CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
BATCH, CONTEXT = 2, 512


def main() -> None:
    config = LlamaConfig(**CONFIG)
    folder = tempfile.mkdtemp()
    config.save_pretrained(folder)
    fit = oom_magic.fit_check(folder, train="adamw", target="H200", dtype="float32", batch=BATCH, context=CONTEXT)
    print(f"probe: activations {fit.parts.activations:,} B, optimizer step {fit.parts.optimizer_step:,} B", flush=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.set_attn_implementation("eager")
    model.train()
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, CONTEXT), generator=torch.Generator().manual_seed(1))

    def trainer_loop() -> None:
        loss = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
        loss.backward()

    def outputs_held() -> None:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out

    for name, step in (("the loss alone (Trainer)", trainer_loop), ("outputs held through backward", outputs_held)):
        gc.collect()
        started = time.time()
        peak, left = profiled_peak(step)
        print(f"{name}: peak beyond what is left {peak - left:,} B (left: {left:,} B, "
              f"{time.time() - started:.0f} s)", flush=True)
        for p in model.parameters():
            p.grad = None


if __name__ == "__main__":
    main()
