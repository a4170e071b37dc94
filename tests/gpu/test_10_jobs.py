"""Check 10 — a job's sizing against a real ``generate`` and a real AdamW training step (issue 22).

A Llama-shaped model of ~1.1B parameters with GQA (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 32000), built from a config and saved locally as bf16 safetensors, is sized by the public
``oom_magic.fit_check(folder, context=, batch=, prompt=, train=, target="H200", dtype=)`` and
then run for real on cuda:0:

- inference (bf16, transformers' default attention, sdpa): ``memory_allocated()`` across the
  load against ``parts.weights``; ``generate`` of C − P new tokens after a B × P prompt, whose
  returned ``past_key_values`` (a DynamicCache: one tensor per layer for keys and one for values,
  grown by ``torch.cat``, so no chunks and no spare room) is measured storage by storage against
  ``parts.kv_cache``; and the peak beyond what was held before ``generate`` against
  ``parts.kv_cache + parts.activations`` (sized as transformers' default sdpa runs as a fused kernel).
- training (fp32, eager attention, ``torch.optim.AdamW(lr=1e-4)``, foreach by default on CUDA):
  one step on B × C tokens with labels; the ``.grad`` storages against ``parts.gradients``, the
  device state against ``parts.optimizer`` (AdamW's ``step`` counters are host tensors unless
  ``fused``/``capturable``), and ``memory_allocated()`` after ``optimizer.step()`` minus what was
  held before the step against both.

Ground truth: ``torch.cuda.memory_allocated`` / ``max_memory_allocated``, the tensors' own
storages, and the allocator's own blocks (``memory_snapshot``): ``memory_allocated`` counts a
block's size, which is the request rounded up to 512 bytes (and, in the large pool, a whole free
block when the remainder would be under 1 MiB, which the allocator does not split). Where a
tolerance is that rounding, it is read from those blocks and the row's note says how much it is.

The measuring functions take ``device`` and read the allocator only through ``Meter``, which
answers None on the cpu, so they run on a tiny config without a GPU: every line but the
allocator's readings is exercised there (transformers 5.17 and 5.25 alike).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import block_sizes, build_causal_lm

ITEM = 10
pytestmark = pytest.mark.gpu

TARGET = "H200"
SHAPE = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=32000,
             max_positions=4096)  # Llama 3.2 1B's layers with a 32k vocab: ~1.1B parameters, GQA 32/8
GENERATE = dict(batch=8, prompt=1536, context=2048)  # cache: 8 × 2048 × 16 layers × 2 × 8 heads × 64 × 2 B = 512 MiB
TRAIN = dict(batch=2, context=512)
# cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG's default: 32 MiB on Hopper) is allocated through the
# caching allocator the first time a handle runs on a stream; ``Meter.warm`` creates it before any baseline.
TRAIN_ACTIVATIONS_TOLERANCE = 0.15


# -- reading the device ------------------------------------------------------------------------------


class Meter:
    """The allocator's readings on ``device``; every reading is None on the cpu (no allocator stats)."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.device = device
        self.cuda = str(device).startswith("cuda")

    def settle(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()

    def warm(self) -> None:
        """Run each kind of kernel the checks use once, so workspaces exist before any baseline."""
        torch = self.torch
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.ones(64, 64, device=self.device, dtype=dtype, requires_grad=True)
            b = torch.ones(64, device=self.device, dtype=dtype, requires_grad=True)
            x = torch.ones(2, 8, 64, device=self.device, dtype=dtype)
            q = torch.ones(2, 4, 8, 16, device=self.device, dtype=dtype, requires_grad=True)
            # mm and addmm (cuBLAS / cuBLASLt), batched matmul (eager attention), sdpa
            y = (torch.nn.functional.linear(x, w).float().sum() + torch.nn.functional.linear(x, w, b).float().sum()
                 + torch.matmul(q, q.transpose(-1, -2)).float().sum()
                 + torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum())
            y.backward()
            del w, b, x, q, y
        self.settle()

    def allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated(self.device)) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        self.torch.cuda.synchronize(self.device)
        return int(self.torch.cuda.max_memory_allocated(self.device))

    def blocks(self) -> dict[int, int] | None:
        """Allocated blocks by address (the allocator's own account), or None on the cpu."""
        return block_sizes(self.torch.cuda.memory_snapshot()) if self.cuda else None


def storages(tensors: Any) -> dict[int, int]:
    """Each distinct storage the tensors use, once: its address and bytes."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def cache_storages(torch: Any, cache: Any) -> dict[int, int]:
    """Every storage a returned cache object holds, each once (its layers' keys/values, any state)."""
    seen: set[int] = set()
    found: list[Any] = []
    stack = [(cache, 0)]
    while stack:
        item, depth = stack.pop()
        if id(item) in seen or depth > 8:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        elif hasattr(item, "__dict__") and not isinstance(item, (torch.nn.Module, type)):
            stack.extend((v, depth + 1) for v in vars(item).values())
    return storages(found)


def rounding(blocks: dict[int, int] | None, held: dict[int, int]) -> tuple[int | None, int]:
    """(what the allocator's blocks for ``held`` add to its bytes, how many of them it has no block for)."""
    if blocks is None:
        return None, len(held)
    missing = sum(1 for address in held if address not in blocks)
    return sum(blocks[a] - n for a, n in held.items() if a in blocks), missing


# -- the two jobs, measured -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """What a real ``generate`` held (None: not readable on this device)."""

    parameter_bytes: int     # the model's parameters' storages
    buffer_bytes: int        # its buffers' (rotary inv_freq: not in the checkpoint)
    load_delta: int | None   # memory_allocated() after the load − before
    load_rounding: int | None  # the model's blocks − its storages' bytes (allocator rounding)
    unblocked: int           # model storages with no block of their own in the snapshot
    cache_bytes: int         # the returned past_key_values' distinct storages
    cache_tokens: int        # the tokens the cache holds (get_seq_length)
    new_tokens: int
    peak: int | None         # max_memory_allocated() during generate − memory_allocated() before it
    attention: str


def measure_generate(torch: Any, folder: Path, device: str, *, batch: int, prompt: int, context: int) -> Generated:
    """Load the model in bf16 on ``device``, generate ``context − prompt`` tokens, and read what it held."""
    from transformers import AutoModelForCausalLM

    meter = Meter(torch, device)
    meter.settle()
    before_load = meter.allocated()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, device_map=device)
    model.eval()
    meter.settle()
    after_load = meter.allocated()
    params = storages(model.parameters())
    buffers = {a: n for a, n in storages(model.buffers()).items() if a not in params}
    load_rounding, unblocked = rounding(meter.blocks(), {**params, **buffers})
    attention = str(getattr(model.config, "_attn_implementation", "?"))

    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=generator).to(device)
    mask = torch.ones_like(ids)
    meter.settle()
    before = meter.allocated()
    meter.reset_peak()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=context - prompt,
                             min_new_tokens=context - prompt, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=0)
    peak = meter.peak()
    cache = getattr(out, "cache", None)  # transformers 5.2x names it cache; 5.17 past_key_values
    if cache is None:
        cache = out.past_key_values
    result = Generated(
        parameter_bytes=sum(params.values()), buffer_bytes=sum(buffers.values()),
        load_delta=None if after_load is None else after_load - before_load,
        load_rounding=load_rounding, unblocked=unblocked,
        cache_bytes=sum(cache_storages(torch, cache).values()), cache_tokens=int(cache.get_seq_length()),
        new_tokens=int(out.sequences.shape[1] - prompt),
        peak=None if peak is None else peak - before, attention=attention)
    del out, cache, model, ids, mask
    meter.settle()
    return result


@dataclass(frozen=True)
class Trained:
    """What one real AdamW step held (None: not readable on this device)."""

    parameters: int            # how many parameter tensors
    gradient_bytes: int        # the .grad storages
    state_bytes: int           # optimizer state tensors on the model's device (the step counters aside)
    step_devices: tuple[str, ...]  # where AdamW's step counters live
    step_counter_bytes: int
    foreach: bool | None       # the implementation torch picked (None: torch did not say)
    held_delta: int | None     # memory_allocated() after optimizer.step() − before the forward
    held_rounding: int | None  # the grads' and state's blocks − their bytes (allocator rounding)
    unblocked: int
    backward_peak: int | None  # max_memory_allocated() during forward + backward (absolute)
    step_peak: int | None      # max_memory_allocated() during optimizer.step() (absolute)
    after_step: int | None     # memory_allocated() after optimizer.step() (absolute)
    loss: float


def measure_training_step(torch: Any, folder: Path, device: str, *, batch: int, context: int,
                          dtype: str = "float32") -> Trained:
    """Load the model on ``device`` (eager attention), run one AdamW step on ``batch × context`` tokens,
    and read what it left and what it peaked at."""
    from transformers import AutoModelForCausalLM

    meter = Meter(torch, device)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), device_map=device,
                                                 attn_implementation="eager")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(device)
    labels = ids.clone()
    meter.settle()
    before = meter.allocated()
    meter.reset_peak()
    # As transformers' Trainer runs a step (compute_loss returns the loss alone, so the outputs and their
    # float32 logits are gone before backward) and as the probe sizes it. Holding the outputs through
    # backward, as this check first did, measured 868,357,120 B on an H200; the same loop on the cpu
    # holds 800,198,792 B, and this one 602,017,928 B (the probe: 602,017,800).
    step_loss = model(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids)).loss
    loss = float(step_loss.detach())
    step_loss.backward()
    del step_loss
    backward_peak = meter.peak()
    meter.reset_peak()
    optimizer.step()
    step_peak = meter.peak()
    gc.collect()
    after_step = meter.allocated()

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = storages(p.grad for p in params)
    steps = [s["step"] for s in optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]
    device_state = storages(t for s in optimizer.state.values() for k, t in s.items()
                            if isinstance(t, torch.Tensor) and not (k == "step" and t.device.type == "cpu"
                                                                     and meter.cuda))
    held_rounding, unblocked = rounding(meter.blocks(), {**grads, **device_state})
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:  # torch picks foreach on CUDA unless told otherwise (a private helper: may move)
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            foreach = bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])
        except (ImportError, TypeError):
            foreach = None
    result = Trained(
        parameters=len(params), gradient_bytes=sum(grads.values()), state_bytes=sum(device_state.values()),
        step_devices=tuple(sorted({s.device.type for s in steps})),
        step_counter_bytes=sum(s.untyped_storage().nbytes() for s in steps), foreach=foreach,
        held_delta=None if after_step is None else after_step - before, held_rounding=held_rounding,
        unblocked=unblocked, backward_peak=backward_peak, step_peak=step_peak, after_step=after_step, loss=loss)
    del optimizer, model, params, grads, steps, ids, labels
    meter.settle()
    return result


# -- rows ----------------------------------------------------------------------------------------------------


def generate_rows(checks: Any, fit: Any, got: Generated, *, prompt: int, context: int) -> None:
    """Compare a real generate with ``fit_check``'s JobFit, row by row."""
    parts = fit.parts
    checks.true(f"fit_check: the inference job fits the {TARGET}", fit.fits, note=f"needs {parts.total} B")
    checks.equal("weights: the loaded parameters' bytes == parts.weights", parts.weights, got.parameter_bytes)
    if got.load_delta is None:
        checks.skip("weights: memory_allocated() grew by parts.weights", "no allocator statistics on this device")
    else:
        extra = got.buffer_bytes + (got.load_rounding if got.load_rounding is not None else 512 * 1024)
        checks.equal("weights: memory_allocated() across the load == parts.weights", parts.weights, got.load_delta,
                     tol=extra, note=f"tolerance: the rotary buffers ({got.buffer_bytes} B, not in the checkpoint) "
                                     f"+ allocator rounding of the model's blocks ({got.load_rounding} B, 512-byte "
                                     f"rounding; {got.unblocked} storages without a block of their own)")
    checks.equal("generate: new tokens == context − prompt", context - prompt, got.new_tokens, unit=None)
    checks.equal("generate: the cache holds context − 1 tokens", context - 1, got.cache_tokens, unit=None,
                 note="generate never feeds its last token back into the model")
    per_token = parts.kv_cache // context
    checks.equal("generate: past_key_values' storages == parts.kv_cache × (C−1)/C", parts.kv_cache - per_token,
                 got.cache_bytes, note=f"fit_check sizes a cache of C = {context} tokens ({parts.kv_cache} B, "
                                       f"{per_token} B a token); DynamicCache grows by torch.cat: no chunks")
    if parts.activations is None:
        checks.skip("generate: peak ≤ kv_cache + activations + slack", "fit_check did not size the activations")
        return
    predicted = parts.kv_cache + parts.activations
    if got.peak is None:
        checks.skip("generate: peak ≤ kv_cache + activations + slack", "no allocator statistics on this device")
        return
    checks.equal("generate: peak beyond what was held ≈ kv_cache + activations (±15%)", predicted, got.peak,
                 tol=int(predicted * 0.15),
                 note=f"activations {parts.activations} B: the prompt's forward as a fused sdpa kernel holds it; this "
                      f"ran {got.attention}; peak ÷ prediction {got.peak / predicted:.3f}")

def training_rows(checks: Any, fit: Any, got: Trained) -> None:
    """Compare a real AdamW step with ``fit_check``'s JobFit for train='adamw', row by row."""
    parts = fit.parts
    checks.true(f"fit_check: the training job fits the {TARGET}", fit.fits, note=f"needs {parts.total} B")
    checks.equal("train: the .grad storages == parts.gradients", parts.gradients, got.gradient_bytes)
    checks.equal("train: AdamW's device state (exp_avg, exp_avg_sq) == parts.optimizer", parts.optimizer,
                 got.state_bytes, note=f"foreach={got.foreach}; step counters: {got.parameters} × 4 B on "
                                       f"{'/'.join(got.step_devices)}")
    checks.true("train: AdamW's step counters are host tensors (not fused, not capturable)", got.step_devices,
                expected=("cpu",), note=f"{got.step_counter_bytes} B for {got.parameters} parameters")
    if got.held_delta is None:
        checks.skip("train: memory_allocated() after step − before == gradients + optimizer",
                    "no allocator statistics on this device")
    else:
        tol = got.held_rounding if got.held_rounding is not None else 512 * 3 * got.parameters
        checks.equal("train: memory_allocated() after step − before == gradients + optimizer",
                     parts.gradients + parts.optimizer, got.held_delta, tol=tol,
                     note=f"tolerance: allocator rounding of the grads' and state's blocks ({got.held_rounding} B; "
                          f"≤ 512 B a tensor unless a block was left unsplit; {got.unblocked} without a block)")
    if got.after_step is None or got.backward_peak is None or got.step_peak is None:
        checks.skip("train: the step's peak beyond weights + grads + state", "no allocator statistics on this device")
        return
    # A loop's later steps run forward/backward with the state already there (the first has none yet).
    forward_backward = got.backward_peak + got.state_bytes
    transient = max(forward_backward, got.step_peak) - got.after_step
    phase = "forward/backward" if forward_backward >= got.step_peak else "optimizer.step"
    phases = (f"forward/backward peak + state − after step {forward_backward - got.after_step} B, "
              f"optimizer.step peak − after step {got.step_peak - got.after_step} B"
              + (" (the foreach step holds a temporary as large as exp_avg_sq, its sqrt)" if got.foreach else ""))
    if parts.activations is None:
        checks.skip("train: the step's peak beyond weights + grads + state vs parts.activations",
                    "fit_check does not size training activations yet (parts.activations is None)")
        checks.row("train: the step's peak beyond weights + grads + state (informational)", None, transient, None,
                   unit="bytes", note=f"peaked in {phase}; {phases}")
        return
    step = got.step_peak - got.after_step
    checks.equal("train: optimizer.step's peak − after == parts.optimizer_step (foreach's sqrt of its state)",
                 parts.optimizer_step, step, tol=512 * got.parameters,
                 note=f"foreach={got.foreach}; tolerance: 512-byte rounding of each temporary's block")
    checks.equal("train: forward/backward's peak + state − after ≈ parts.activations (±15%)",
                 parts.activations, forward_backward - got.after_step,
                 tol=int(parts.activations * TRAIN_ACTIVATIONS_TOLERANCE),
                 note=f"{phases}; eager attention, as the meta-device probe runs it")
    checks.at_most("train: the step's whole peak beyond weights + grads + state ≤ the larger of the two",
                   max(parts.activations, parts.optimizer_step) * (1 + TRAIN_ACTIVATIONS_TOLERANCE), transient,
                   note=f"peaked in {phase}")

# -- the checks -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama-1b-gqa-bf16"
    info = build_causal_lm(path, dtype="bfloat16", **SHAPE)
    assert 1.0e9 < info["parameters"] < 1.2e9, info
    return path


def test_generate_holds_what_fit_check_sized(cuda, checks, model_dir):
    import oom_magic

    torch = cuda
    fit = oom_magic.fit_check(str(model_dir), target=TARGET, dtype="bfloat16", **GENERATE)
    meter = Meter(torch, "cuda:0")
    meter.warm()
    got = measure_generate(torch, model_dir, "cuda:0", **GENERATE)
    generate_rows(checks, fit, got, prompt=GENERATE["prompt"], context=GENERATE["context"])
    checks.verify()


def test_a_training_step_holds_what_fit_check_sized(cuda, checks, model_dir):
    import oom_magic

    torch = cuda
    fit = oom_magic.fit_check(str(model_dir), train="adamw", target=TARGET, dtype="float32", **TRAIN)
    meter = Meter(torch, "cuda:0")
    meter.warm()
    got = measure_training_step(torch, model_dir, "cuda:0", dtype="float32", **TRAIN)
    training_rows(checks, fit, got)
    checks.verify()
