"""Gradients, optimizer state and LoRA adapters as sized, against a real optimizer step on tiny models."""
from __future__ import annotations

from pathlib import Path

import pytest

from oom_magic.sizing.probe import probe_job
from oom_magic.sizing.training import gradient_bytes, optimizer_bytes, optimizer_step_bytes
from tests.sizing.families import build, profiled_peak

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _step(model, optimizer) -> tuple[int, int]:
    """One real training step; (bytes of the .grad tensors, bytes of the optimizer's state tensors)."""
    ids = torch.randint(3, 256, (2, 10))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _storages(grads), _storages(states)


def _config(model, root: Path) -> Path:
    model.config.save_pretrained(root)
    return root / "config.json"


@pytest.mark.parametrize("family,dtype,optimizer", [("llama-gqa", "float32", "adamw"), ("llama-gqa", "bfloat16", "sgd"),
                                                    ("mixtral-moe", "bfloat16", "adamw"), ("gpt2", "float32", "adamw")])
def test_gradients_and_optimizer_state_equal_a_real_step_to_the_byte(family, dtype, optimizer, tmp_path):
    model = build(family, getattr(torch, dtype)).train()
    real = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    real_grads, real_state = _step(model, real)

    probe = probe_job(_config(model, tmp_path), dtype, batch=1, prompt=4, context=4)

    assert gradient_bytes(probe.parameters) == real_grads > 0
    assert optimizer_bytes(probe.parameters, optimizer, on_host_too=True) == real_state > 0


def test_adamw_steps_stay_on_the_host_so_the_device_figure_leaves_them_out(tmp_path):
    model = build("llama-gqa").train()
    real = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, real)
    steps = [s["step"] for s in real.state.values()]
    probe = probe_job(_config(model, tmp_path), "float32", batch=1, prompt=4, context=4)

    assert all(s.device.type == "cpu" and s.dtype == torch.float32 and s.dim() == 0 for s in steps)
    assert optimizer_bytes(probe.parameters, "adamw") + 4 * len(steps) == \
        optimizer_bytes(probe.parameters, "adamw", on_host_too=True)


def _step_temporary(model, optimizer) -> int:
    """What a real step allocates for a moment above what it leaves: the profiler's memory events of
    the step alone (the first step also creates the state, which stays)."""
    ids = torch.randint(3, 256, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    peak, live = profiled_peak(optimizer.step)
    return peak - live


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_foreach_adamw_step_holds_the_sqrt_of_its_state_for_a_moment(dtype, tmp_path):
    """A GPU's AdamW runs foreach (every parameter a CUDA tensor): _multi_tensor_adamw's sqrt of
    exp_avg_sq is a tensor per parameter while the gradients and state are alive (measured on an
    H200: the step's peak above what it leaves == the gradients' bytes). foreach=True runs the same
    code on the cpu; the per-parameter loop (the cpu's default) holds one parameter's at a time."""
    from oom_magic.records.job import Job
    from oom_magic.sizing.parts import size_job

    model = build("llama-gqa", getattr(torch, dtype)).train()
    foreach = _step_temporary(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    model.zero_grad(set_to_none=True)
    loop = _step_temporary(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
    model.save_pretrained(tmp_path)
    parts = size_job(tmp_path, Job(context=10, batch=2, train="adamw"), dtype=dtype).parts
    probe = probe_job(_config(model, tmp_path), dtype, batch=1, prompt=4, context=4)

    assert parts.optimizer_step == optimizer_step_bytes(probe.parameters, "adamw") == parts.gradients
    # the cpu's foreach step also makes a few scalar tensors (its step and bias-correction values; a
    # CUDA step keeps those on the host: exact there)
    assert 0 <= foreach - parts.optimizer_step <= 64
    assert optimizer_step_bytes(probe.parameters, "adamw", foreach=False) == 0
    # the loop: one parameter's sqrt and its quotient at a time (_single_tensor_adamw's denom)
    assert loop - 1024 <= 2 * max(row[3] for row in probe.parameters) < foreach  # and its scalars
    assert parts.total == parts.held + max(parts.activations or 0, parts.optimizer_step)
    assert optimizer_step_bytes(probe.parameters, "sgd") == optimizer_step_bytes(probe.parameters, "adamw8bit") == 0


@pytest.mark.parametrize("family,targets", [("llama-gqa", ()), ("llama-gqa", ("q_proj", "v_proj", "o_proj")),
                                            ("t5-encoder-decoder", ()), ("mistral-sliding", ("all-linear",))])
def test_lora_adapters_gradients_and_state_equal_peft_and_a_real_step_to_the_byte(family, targets, tmp_path):
    peft = pytest.importorskip("peft")
    base = build(family, torch.bfloat16)
    config = _config(base, tmp_path)
    task = "SEQ_2_SEQ_LM" if base.config.is_encoder_decoder else "CAUSAL_LM"
    wanted = targets[0] if targets == ("all-linear",) else (list(targets) or None)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=wanted, task_type=task))
    model.train()
    adapters = [p for p in model.parameters() if p.requires_grad]
    real = torch.optim.AdamW(adapters, lr=1e-4)
    ids = torch.randint(3, 256, (2, 10))
    extra = {"decoder_input_ids": ids} if base.config.is_encoder_decoder else {}
    model(input_ids=ids, labels=ids, **extra).loss.backward()
    real.step()
    real_grads = _storages([p.grad for p in model.parameters() if p.grad is not None])
    real_state = _storages([v for s in real.state.values() for v in s.values()])

    probe = probe_job(config, "bfloat16", batch=1, prompt=4, context=4, lora_r=8, lora_targets=targets)

    assert sum(row[3] for row in probe.adapters) == _storages(adapters) > 0
    assert [row[0] for row in probe.adapters] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert gradient_bytes(probe.adapters) == real_grads
    assert optimizer_bytes(probe.adapters, "adamw", on_host_too=True) == real_state
