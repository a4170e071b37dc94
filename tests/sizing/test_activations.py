"""The prompt's transient peak as sized on the meta device, against the PyTorch profiler's memory timeline
of a real cpu forward with the attention transformers picks by default (sdpa: the cpu's fused flash kernel)."""
from __future__ import annotations

import pytest

from oom_magic.sizing.probe import probe_job
from tests.sizing.families import build

torch = pytest.importorskip("torch")
BATCH, PROMPT = 2, 192


def _profiled_peak(model, ids) -> tuple[int, int]:
    """(peak live bytes, live bytes at the end) of a real cpu forward, from the profiler's [memory] events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    del out
    return peak, live


@pytest.mark.parametrize("family", ["llama-gqa", "gemma2-alternating", "gpt2", "mistral-sliding"])
def test_the_prompts_transient_peak_is_within_10_percent_of_the_profiler(family, tmp_path):
    model = build(family)  # with the attention transformers picks for it: sdpa (gemma2: eager)
    model.config.save_pretrained(tmp_path)
    peak, left = _profiled_peak(model, torch.randint(3, 256, (BATCH, PROMPT)))
    real_transient = peak - left + 2 * 256 * 4  # what stays: the cache and the last token's float32 logits
    probe = probe_job(tmp_path / "config.json", "float32", batch=BATCH, prompt=PROMPT, context=PROMPT)

    assert probe.activations is not None
    assert abs(probe.activations - real_transient) <= 0.10 * real_transient
