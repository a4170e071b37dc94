"""issue 14 point 4: bytes mapped from a file are told apart from resident memory (real tensors)."""
from __future__ import annotations

import sys

import pytest
import torch
import transformers as T

from oom_magic.device.mapped import file_mappings, mapped_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _storages(model: torch.nn.Module) -> list[tuple[int, int]]:
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return list(seen.items())


def test_weights_loaded_in_their_stored_dtype_are_mapped_from_the_file(tmp_path):
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
    T.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    same = T.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    cast = T.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    weights = sum(n for _, n in _storages(same))
    assert mapped_bytes(_storages(same)) >= 0.99 * weights  # views of model.safetensors
    assert mapped_bytes(_storages(cast)) == 0  # cast: new, anonymous memory
    assert mapped_bytes([(torch.ones(1 << 20).data_ptr(), 4 << 20)]) == 0


def test_maps_lines_are_read_by_address_and_path():
    maps = ("7f0000000000-7f0000100000 r--s 00000000 08:01 123 /models/model.safetensors\n"
            "7f0000100000-7f0000200000 rw-p 00000000 00:00 0 \n"
            "7f0000200000-7f0000300000 rw-s 00000000 00:05 9 /dev/shm/torch_1 (deleted)\n")
    m = file_mappings(maps)
    assert m is not None and [r[2] for r in m.ranges] == ["/models/model.safetensors"]
    assert mapped_bytes([(0x7f00000ff000, 0x2000)], m) == 0x1000  # half inside the file mapping


def test_gpumem_on_the_cpu_tells_file_mapped_weights_from_resident_ones(ip, tmp_path):
    """%gpumem: a model loaded in its stored dtype is a view of model.safetensors, and the report says so."""
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
    T.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    assert ip.run_cell(f"import torch, transformers as T\n"
                       f"same = T.LlamaForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.bfloat16)\n"
                       f"cast = T.LlamaForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.float32)\n"
                       ).success
    try:
        snap = ip.run_line_magic("gpumem", "-o --device cpu")
        same, cast = snap.held_by("same"), snap.held_by("cast")
        assert same > 0 and cast > 1.9 * same  # float32 weights: twice the bytes (a float32 buffer in both)
        assert 0.99 * same <= snap.user_mapped_bytes <= same  # the bf16 model's weights, none of the cast copy
        assert any("mapped from files" in n for n in snap.notes) and "mapped from files" in str(snap)
        assert snap.to_dict()["user_mapped_bytes"] == snap.user_mapped_bytes
    finally:
        ip.run_cell("del same, cast")
