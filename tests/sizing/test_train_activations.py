"""One training step's activations as sized (probe.TrainStep), against the PyTorch profiler's memory
timeline of a real cpu step on tiny models: with and without gradient checkpointing, LoRA, and
bf16/fp16 mixed precision (float32 weights under torch.autocast).

What is compared: the step's peak live bytes during forward and backward, beyond what existed
before the forward (the weights) and what the step leaves (the gradients): the profiler's peak
minus what is still live once the loss is dropped.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from oom_magic.records.job import Job
from oom_magic.sizing.parts import size_job
from oom_magic.sizing.probe import TrainStep, probe_job
from tests.sizing.families import build, profiled_peak

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
BATCH, CONTEXT = 2, 64
TOLERANCE = 0.15  # the tolerance for a transient peak


def _enable_checkpointing(model) -> None:
    # transformers' own; 5.x names it activation_checkpointing_enable (gradient_checkpointing_enable warns)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def _real_step(model, batch: int = BATCH, mixed=None) -> tuple[int, int]:
    """(peak beyond what is left, bytes left) of one real cpu step, from the profiler's [memory] events."""
    ids = torch.randint(3, 256, (batch, CONTEXT))

    def step() -> None:
        with torch.autocast("cpu", dtype=mixed or torch.bfloat16, enabled=mixed is not None):
            loss = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
        loss.backward()

    peak, live = profiled_peak(step)
    return peak - live, live


def _grad_bytes(model) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


def _prepared(family: str, checkpointing: bool, root: Path, dtype=None):
    model = build(family, dtype).train()
    model.set_attn_implementation("eager")  # as sized: sdpa/flash kernels hold less
    model.config.save_pretrained(root)
    if checkpointing:
        _enable_checkpointing(model)
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("family", ["llama-gqa", "gpt2", "mistral-sliding", "mixtral-moe", "gemma2-alternating"])
def test_a_training_steps_activations_are_within_15_percent_of_the_profiler(family, checkpointing, tmp_path):
    model = _prepared(family, checkpointing, tmp_path)
    real, left = _real_step(model)
    probe = probe_job(tmp_path / "config.json", "float32", batch=BATCH, prompt=CONTEXT, context=CONTEXT,
                      train_step=TrainStep(gradient_checkpointing=checkpointing))

    assert left == _grad_bytes(model) > 0  # what the step leaves is its gradients
    assert probe.train_activations is not None and real > 0
    assert abs(probe.train_activations - real) <= TOLERANCE * real, (probe.train_activations, real)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_lora_steps_activations_flow_through_the_frozen_base_within_15_percent(checkpointing, tmp_path):
    peft = pytest.importorskip("peft")
    base = _prepared("llama-gqa", checkpointing, tmp_path)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, task_type="CAUSAL_LM"))
    model.train()
    real, left = _real_step(model)
    probe = probe_job(tmp_path / "config.json", "float32", batch=BATCH, prompt=CONTEXT, context=CONTEXT, lora_r=8,
                      train_step=TrainStep(gradient_checkpointing=checkpointing))

    assert left == _grad_bytes(model) == sum(row[3] for row in probe.adapters)  # only the adapters' gradients
    assert probe.train_activations is not None
    assert abs(probe.train_activations - real) <= TOLERANCE * real, (probe.train_activations, real)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("family,precision", [("llama-gqa", "bf16"), ("gpt2", "bf16"), ("llama-gqa", "fp16")])
def test_mixed_precision_under_autocast_is_within_15_percent_and_float32_to_the_byte(family, precision, checkpointing,
                                                                                     tmp_path):
    # batch 4: the cpu's bf16 matmul allocates a weight-sized scratch buffer inside aten::mm (a kernel
    # workspace, like cuBLAS's on a GPU, not a tensor: 165,632 bytes at gpt2's checkpointed peak); these tiny
    # models' activations are small beside one weight, so at batch 2 that scratch alone is 15% of them
    batch = 4
    model = _prepared(family, checkpointing, tmp_path / "config")
    model.save_pretrained(tmp_path / "model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real, left = _real_step(model, batch=batch, mixed={"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    optimizer.step()
    job = Job(context=CONTEXT, batch=batch, train="adamw", gradient_checkpointing=checkpointing,
              mixed_precision=precision)
    parts = size_job(tmp_path / "model", job).parts

    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert parts.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert parts.gradients == left == _grad_bytes(model)
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]  # steps stay on the host
    assert parts.optimizer == sum(v.numel() * v.element_size() for v in state)
    assert parts.activations is not None
    assert abs(parts.activations - real) <= TOLERANCE * real, (parts.activations, real)
    # autocast's cpu rules cast the matmuls' parameters (linear; addmm for gpt2's Conv1D, bias too), not
    # embeddings or norms: a 2-byte copy of each, once (tied weights once)
    cast = {id(p): p for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
            for p in m.parameters(recurse=False)}
    assert parts.weight_casts == sum(2 * p.numel() for p in cast.values()) > 0
