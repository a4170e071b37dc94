"""The prompt's transient peak as sized on the meta device, against the PyTorch profiler's memory timeline
of a real cpu forward with the attention transformers picks by default (sdpa: the cpu's fused flash kernel)."""
from __future__ import annotations

import pytest

from oom_magic.sizing.probe import probe_job
from tests.sizing.families import build, profiled_peak

torch = pytest.importorskip("torch")
BATCH, PROMPT = 2, 192


def _profiled_peak(model, ids) -> tuple[int, int]:
    """(peak live bytes, live bytes at the end) of a real cpu forward, from the profiler's [memory] events."""
    held = []

    def forward() -> None:
        with torch.no_grad():
            held.append(model(input_ids=ids, use_cache=True, logits_to_keep=1))  # what it leaves stays counted

    return profiled_peak(forward)


@pytest.mark.parametrize("family", ["llama-gqa", "gemma2-alternating", "gpt2", "mistral-sliding", "mixtral-moe"])
def test_the_prompts_transient_peak_is_within_10_percent_of_the_profiler(family, tmp_path):
    model = build(family)  # with the attention transformers picks for it: sdpa (gemma2: eager)
    model.config.save_pretrained(tmp_path)
    peak, left = _profiled_peak(model, torch.randint(3, 256, (BATCH, PROMPT)))
    real_transient = peak - left + 2 * 256 * 4  # what stays: the cache and the last token's float32 logits
    probe = probe_job(tmp_path / "config.json", "float32", batch=BATCH, prompt=PROMPT, context=PROMPT)

    assert probe.activations is not None
    assert abs(probe.activations - real_transient) <= 0.10 * real_transient
