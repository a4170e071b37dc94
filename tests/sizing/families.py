"""Tiny real models of each family the job sizing is held to, built from small configs."""
from __future__ import annotations

from typing import Any

_ATTN = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (config class name, kwargs); sliding windows are shorter than the prompts used in the tests
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", dict(_ATTN, num_hidden_layers=2)),
    "mistral-sliding": ("MistralConfig", dict(_ATTN, num_hidden_layers=2, sliding_window=8)),
    "gemma2-alternating": ("Gemma2Config", dict(_ATTN, num_hidden_layers=4, head_dim=16, sliding_window=8)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, bos_token_id=1, eos_token_id=2)),
    "mixtral-moe": ("MixtralConfig", dict(_ATTN, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    "t5-encoder-decoder": ("T5Config", dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256,
                                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "mamba-state-space": ("MambaConfig", dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8,
                                              bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "jamba-hybrid": ("JambaConfig", dict(_ATTN, num_hidden_layers=4, num_experts=2, attn_layer_period=2,
                                         attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                         mamba_d_state=8, mamba_dt_rank=8)),
}


def build(family: str, dtype: Any = None) -> Any:
    """The family's tiny model with random weights, in eval mode (float32 unless ``dtype``)."""
    import torch
    import transformers

    name, kwargs = FAMILIES[family]
    config = getattr(transformers, name)(**kwargs)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=dtype or torch.float32)
    return model.eval()


def cache_storage_bytes(cache: Any) -> int:
    """Bytes of the distinct storages a real cache object holds (walked independently of the sizing)."""
    import torch

    seen: set[int] = set()
    total = 0
    stack, visited = [cache], set()
    while stack:
        item = stack.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (torch.nn.Module, type)):
            stack.extend(vars(item).values())
    return total


def profiled_peak(run: Any) -> tuple[int, int]:
    """(peak live bytes, live bytes at the end) while ``run()`` runs on the cpu, from the PyTorch
    profiler's ``[memory]`` events in time order: what real ops allocated and freed, whatever made them."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    # An earlier test's garbage, freed by a collection during run(), would read as a free of memory
    # the profiler never saw allocated (a clean clone's CI run: 48 KiB less left than the gradients).
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        if enabled:
            gc.enable()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak, live
