"""issue 14 point 3: quantized and float16 sizes follow transformers' own rules.

Real transformers models from small configs, saved locally (no hub). "Really held" is measured on
the real model loaded by ``from_pretrained``: float16 loads are measured directly (transformers
applies ``_keep_in_fp32_modules`` itself). bitsandbytes cannot run here (no GPU), so for int8/nf4
the modules it would replace (every ``nn.Linear``/``Conv1D`` of the *loaded* model outside
transformers' not-convert list) are sized by its documented layout and the rest as loaded.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from benchmarks.bench_estimate_truth import really_held  # the same ground truth as ESTIMATES.md
from oom_magic.checkpoints.estimate import estimate_checkpoint


def _small(name: str):  # type: ignore[no-untyped-def]
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    if name == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2))
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rules")
    paths = {}
    for name in ("mixtral", "qwen2_moe", "t5"):
        torch.manual_seed(0)
        _small(name).to(torch.bfloat16).save_pretrained(root / name)
        paths[name] = root / name
    return paths


def held_as_bitsandbytes(path: Path, kind: str) -> int:
    """int8/nf4 truth: the loaded model with its replaceable weights in bitsandbytes' layout (the benchmark's own)."""
    return really_held(path, kind)


def held_as_loaded(path: Path, dtype: torch.dtype) -> int:
    """What a real load in ``dtype`` holds: parameters and persistent buffers, each once."""
    return really_held(path, str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_moe_keeps_fused_experts_in_16_bit(saved: dict[str, Path], name: str, kind: str) -> None:
    path = saved[name]
    truth = held_as_bitsandbytes(path, kind)
    est = estimate_checkpoint(path, follow_transformers=True)
    assert est.bytes_for(kind) == truth
    # The header arithmetic took every 2-D expert weight for a Linear: far below what is held.
    assert estimate_checkpoint(path, follow_transformers=False).bytes_for(kind) < 0.8 * truth
    held = est.held_by_rules(kind)
    assert held is not None and held.unquantized_floating_bytes > held.quantized_bytes  # experts stay 16-bit


def test_t5_keeps_its_fp32_modules_in_float32_under_float16(saved: dict[str, Path]) -> None:
    path = saved["t5"]
    truth = held_as_loaded(path, torch.float16)
    est = estimate_checkpoint(path, "float16", follow_transformers=True)
    assert est.bytes == truth
    assert estimate_checkpoint(path, "float16", follow_transformers=False).bytes < 0.9 * truth
    held = est.held_by_rules("float16")
    assert held is not None and held.float32_bytes > 0  # the "wo" projections


def test_skip_modules_count_and_rules_are_not_asked_without_transformers_loaded(saved: dict[str, Path]) -> None:
    est = estimate_checkpoint(saved["mixtral"], follow_transformers=True)
    default = est.held_by_rules("nf4")
    # As in transformers, llm_int8_skip_modules replaces the default list (lm_head is in it here).
    skipped = est.held_by_rules("nf4", skip_modules=("lm_head", "q_proj"))
    assert default is not None and skipped is not None and skipped.bytes > default.bytes
    assert {"lm_head", "q_proj"} <= set(skipped.modules_not_converted)
    assert estimate_checkpoint(saved["mixtral"], follow_transformers=False).held_by_rules("nf4") is None


def test_a_from_pretrained_preflight_sizes_a_quantized_moe_by_transformers_rules(saved: dict[str, Path]) -> None:
    from oom_magic.fit.preflight import preflight_check

    path = saved["mixtral"]
    cell = ("q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')\n"
            "m = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)")
    result = preflight_check(cell, {"path": str(path), "torch": torch, "BitsAndBytesConfig": T.BitsAndBytesConfig},
                             free_bytes=1 << 30, headroom="1MiB")
    (check,) = result.checks
    assert check.dtype == "nf4" and check.need == held_as_bitsandbytes(path, "nf4")


def test_huge_models_are_not_built_on_meta(saved: dict[str, Path], monkeypatch) -> None:
    import oom_magic.checkpoints.hf_rules as hf_rules

    monkeypatch.setattr(hf_rules, "MAX_TENSORS", 10)  # this Mixtral has more: it counts as huge
    est = estimate_checkpoint(saved["mixtral"], follow_transformers=True)
    assert est.held_by_rules("nf4") is None
    assert est.bytes_for("nf4") == estimate_checkpoint(saved["mixtral"], follow_transformers=False).bytes_for("nf4")


def test_rules_without_torch_imported_are_asked_of_a_child_process(saved: dict[str, Path]) -> None:
    """The package never imports torch itself: a process without it gets the same figure from a bounded child."""
    import json
    import os
    import subprocess
    import sys

    script = ("import json, sys\nfrom oom_magic.checkpoints.estimate import estimate_checkpoint\n"
              "est = estimate_checkpoint(sys.argv[1], follow_transformers=True)\n"
              "print(json.dumps([est.bytes_for('nf4'), 'torch' in sys.modules, 'transformers' in sys.modules]))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script, str(saved["mixtral"])], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    nf4, torch_imported, transformers_imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert nf4 == estimate_checkpoint(saved["mixtral"], follow_transformers=True).bytes_for("nf4")
    assert nf4 != estimate_checkpoint(saved["mixtral"], follow_transformers=False).bytes_for("nf4")
    assert not torch_imported and not transformers_imported
