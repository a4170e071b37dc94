"""issue 14 point 4: %freeall on the cpu reports the resident memory that really came back.

A real model loaded from a bfloat16 safetensors file in bfloat16: its weights stay views of the
file (mapped, not resident), so deleting it frees tensor bytes that RSS never held.
"""
from __future__ import annotations

import torch
import transformers as T


def test_freeall_of_a_mapped_model_says_what_resident_memory_came_back(ip, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "llama"
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                                     tie_word_embeddings=False)).to(torch.bfloat16).save_pretrained(path)
    ip.user_ns["path"] = str(path)
    result = ip.run_cell("import torch, transformers\n"
                         "model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)")
    assert result.error_in_exec is None
    report = ip.run_line_magic("freeall", "model --device cpu")
    weights = sum(p.numel() * 2 for p in T.LlamaForCausalLM(T.LlamaConfig.from_pretrained(path)).parameters())
    assert report.freed_bytes >= 0.99 * weights  # the tensors are gone
    assert report.resident_freed is not None and report.resident_freed < 0.5 * report.freed_bytes
    text = str(report)
    # issue 25 point 1: the mapped part is named as file pages, and only the rest is compared with RSS.
    assert report.freed_mapped is not None and report.freed_mapped >= 0.99 * weights
    assert "were views of a memory-mapped file: file pages" in text and "no memory came back for them" in text
