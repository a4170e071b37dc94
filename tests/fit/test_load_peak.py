"""issue 14 point 4: the host-memory peak of a real load, predicted from headers and measured.

Real transformers models from small configs saved locally; each load runs in a fresh interpreter
whose resident high-water mark is reset (/proc/self/clear_refs) just before ``from_pretrained``
and read after (VmHWM), so the figure is the load's own peak. Linux only.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from benchmarks.bench_estimate_truth import measure_peak  # the same measurement as ESTIMATES.md
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.fit.load_peak import load_peak
from oom_magic.fit.preflight import preflight_check

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")



@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peak")
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
                       ).to(torch.bfloat16).save_pretrained(root / "llama")
    T.MixtralForCausalLM(T.MixtralConfig(vocab_size=4000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                         num_experts_per_tok=2)).to(torch.bfloat16).save_pretrained(root / "mixtral")
    return {"llama": root / "llama", "mixtral": root / "mixtral"}


def _measure(path: Path, dtype: str) -> dict[str, int]:
    """A real load's host peak, in a fresh process (the benchmark's own measurement)."""
    return measure_peak(path, dtype)


def test_bf16_checkpoint_loaded_as_float32_peaks_at_weights_plus_file(models):
    est = estimate_checkpoint(models["llama"], follow_transformers=False)
    predicted = load_peak(est, "float32")
    assert predicted is not None
    assert predicted.peak == est.bytes_for("float32") + est.stored_bytes  # 1.5x the float32 weights
    measured = _measure(models["llama"], "float32")
    assert 0.9 <= measured["peak"] / predicted.peak <= 1.1, (measured, predicted)


def test_same_dtype_load_stays_mapped_from_the_file(models):
    est = estimate_checkpoint(models["llama"], follow_transformers=False)
    predicted = load_peak(est, "bfloat16")
    assert predicted is not None and predicted.peak == 0 and predicted.mapped == est.stored_bytes
    measured = _measure(models["llama"], "bfloat16")
    assert measured["peak"] < 0.25 * est.stored_bytes  # the weights are views of the file, not yet resident


def test_moe_load_keeps_its_fused_experts_beside_the_file(models):
    est = estimate_checkpoint(models["mixtral"], follow_transformers=False)
    predicted = load_peak(est, "bfloat16")
    assert predicted is not None and predicted.new_bytes == est._sizes.expert_bytes > 0
    measured = _measure(models["mixtral"], "bfloat16")
    assert 0.85 <= measured["after"] / predicted.peak <= 1.2, (measured, predicted)


def test_preflight_ram_need_includes_the_load_peak(models):
    est = estimate_checkpoint(models["llama"], follow_transformers=False)
    fp32 = est.bytes_for("float32")
    ram = fp32 + est.stored_bytes // 2  # holds the float32 weights, not the peak beside the file
    cell = "m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)"
    result = preflight_check(cell, {"path": str(models["llama"]), "torch": torch}, free_bytes=ram, headroom=0)
    (check,) = result.checks
    assert check.device == "cpu" and check.need == fp32 and check.ram_peak == fp32 + est.stored_bytes
    assert check.verdict == "will-not-fit" and check.margin == ram - check.ram_peak
