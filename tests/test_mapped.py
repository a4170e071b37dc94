"""issue 14 point 4: bytes mapped from a file are told apart from resident memory (real tensors)."""
from __future__ import annotations

import sys

import pytest
import torch
import transformers as T

from oom_magic.mapped import file_mappings, mapped_bytes

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
