"""issue 14 point 4: bytes mapped from a file are told apart from resident memory (real tensors)."""
from __future__ import annotations

import json
import struct
import sys

import psutil
import pytest
import torch
import transformers as T

from oom_magic.device.mapped import file_mappings, mapped_bytes
from oom_magic.render.units import format_bytes

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
        assert any("memory-mapped file" in n for n in snap.notes) and "memory-mapped file" in str(snap)
        assert snap.to_dict()["user_mapped_bytes"] == snap.user_mapped_bytes
        pages = snap.file_pages
        assert pages.resident is not None and 0 < pages.resident <= pages.file_bytes  # small: looked up exactly
        mapped = {name: sum(g.mapped_bytes for g in snap.holders("user") if g.path.startswith(name))
                  for name in ("same", "cast")}
        assert mapped == {"same": snap.user_mapped_bytes, "cast": 0}
    finally:
        ip.run_cell("del same, cast")


def _sparse_checkpoint(path, nbytes: int) -> tuple[int, int]:
    """A safetensors file of one bf16 weight of about ``nbytes`` whose data region is a hole (no disk, no RAM)."""
    cols = 4096
    rows = nbytes // (2 * cols)
    size = rows * cols * 2
    header = json.dumps({"w": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.truncate(8 + len(header) + size)  # the data: a sparse hole, read as zeros, never written
    return rows, cols


def test_weights_mapped_beyond_the_machines_memory_still_add_up(ip, tmp_path, fresh_heap):
    """issue 25 point 1: a file mapped twice, its views larger than RAM: every part of the bar adds up
    to the machine, the mapped bytes are file pages (never user memory), in text, HTML, JSON and the
    widget's view alike, and freeing mapped stale tensors says no memory came back for them."""
    total = psutil.virtual_memory().total
    path = tmp_path / "model.safetensors"
    rows, cols = _sparse_checkpoint(path, int(0.6 * total))  # one map fits the overcommit check; two exceed RAM
    ip.run_line_magic("gpumem", "--auto off")
    assert ip.run_cell(f"import torch\nfrom safetensors.torch import load_file\n"
                       f"first = load_file({str(path)!r})\nsecond = load_file({str(path)!r})\n").success
    ip.run_cell("first['w']", store_history=True)  # the output cache holds a third view, then the name goes
    ip.run_cell("third = load_file(" + repr(str(path)) + ")['w']; third", store_history=True)
    ip.run_cell("del third")
    snap = ip.run_line_magic("gpumem", "-o --device cpu")
    weight = rows * cols * 2
    assert snap.user_bytes >= 2 * weight > total  # what the tensors view exceeds the machine
    pages = snap.file_pages
    assert pages is not None and pages.files == 1 and pages.kind_bytes("user") == 2 * weight
    assert pages.mapped_bytes >= 3 * weight and weight <= pages.file_bytes < weight + (1 << 20)
    assert pages.resident is None  # too many pages to look up within the hook's budget: not asked
    parts = dict(snap.parts())
    assert sum(parts.values()) == snap.reading.total == total  # the bar is the machine, not more
    assert parts["user"] < 64 << 20  # the mapped weights are not this process's own memory
    in_memory = min(pages.process_file_resident, snap.reading.free)
    assert parts["mapped"] == in_memory < 1 << 30 and parts["free"] == snap.reading.free - in_memory
    data = json.loads(ip.run_line_magic("gpumem", "-o --device cpu --json").to_json_text())
    assert sum(data["segments"].values()) == data["reading"]["total"]
    assert data["file_pages"]["mapped_by_kind"]["user"] == 2 * weight
    text = str(snap)
    assert f"{rows}×{cols}" in text and "user, file-mapped" in text  # the shape load_file gave, not its flat base
    assert "file pages" in text and "memory-mapped file" in text
    html = snap._repr_html_()
    assert "oom-seg-mapped" in html or pages.resident == 0
    assert "oom-seg-user" not in html or parts["user"] > 0  # no user span drawn from file pages
    assert "user, file-mapped" in html
    from oom_magic.records.cell import CellReport
    from oom_magic.render.cell import cell_html, cell_text
    view = CellReport(None, snap)
    assert "user 0 B" not in cell_text(view) and f"user {format_bytes(weight)}" not in cell_text(view)
    assert "user, file-mapped" in cell_html(view)
    report = ip.run_line_magic("freeall", "--device cpu")
    assert report.freed_bytes >= weight and report.freed_mapped == report.freed_bytes
    assert "no memory came back for them" in str(report)
