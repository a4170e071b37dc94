"""estimate_checkpoint on real tiny transformers checkpoints, malformed files, and fuzzed headers."""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from oom_magic.checkpoints.files import read_checkpoint_keys
from oom_magic.common.errors import OomMagicError
from oom_magic.checkpoints.estimate import CheckpointEstimate, estimate_checkpoint, resolve_checkpoint

REPO = Path(__file__).resolve().parents[2]

# Tiny Llama: per layer q 64x64, k/v 32x64, o 64x64, gate/up 128x64, down 64x128 (all Linear),
# untied embed_tokens and lm_head 256x64, two RMSNorms per layer plus the final one.
LLAMA_LINEAR = 2 * (4096 + 2048 + 2048 + 4096 + 8192 * 3)  # 73,728 elements
LLAMA_ROWS = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)  # 1,024 output rows
LLAMA_OTHER = 256 * 64 * 2 + 2 * 2 * 64 + 64  # embeddings, lm_head, norms: 33,088
LLAMA_PARAMS = LLAMA_LINEAR + LLAMA_OTHER  # 106,816
LLAMA_BLOCKS = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 128)  # ceil(n/64) per Linear: 1,152
LLAMA_LINEAR_TENSORS = 14


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's unique parameters and persistent buffers (tied weights once)."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict().values():
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def safetensors_data_bytes(path: Path) -> int:
    """Bytes after a safetensors header: the tensor data as stored."""
    with open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
    return path.stat().st_size - 8 - length


def write_safetensors(path: Path, header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> Path:
    """Write a safetensors-shaped file from a header object (or raw header bytes) and data."""
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tiny Llama saved four ways: single safetensors, sharded, torch.save zip, config only."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )
    model = LlamaForCausalLM(config)
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="50KB")
    (root / "bin").mkdir()
    # transformers 5 writes safetensors even with safe_serialization=False, so save the pickle ourselves.
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    config.save_pretrained(root / "bin")
    config.save_pretrained(root / "config")
    return {"model": model, "root": root}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tiny GPT-2 with lm_head tied to wte, saved as safetensors, torch.save zip and config."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    root = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(root / "single")
    (root / "bin").mkdir()
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    config.save_pretrained(root / "config")
    return {"model": model, "root": root}


# --------------------------------------------------------------------------- real checkpoints


def test_single_safetensors_matches_the_model(llama: dict) -> None:
    model, root = llama["model"], llama["root"]
    est = estimate_checkpoint(root / "single")
    assert isinstance(est, CheckpointEstimate)
    assert est.format == "safetensors"
    assert est.files == (str(root / "single" / "model.safetensors"),)
    assert est.parameters == model.num_parameters() == LLAMA_PARAMS
    assert est.stored_bytes == tensor_bytes(model) == safetensors_data_bytes(root / "single" / "model.safetensors")
    assert est.stored_dtypes == (("float32", LLAMA_PARAMS),)
    assert est.declared_dtype == "float32"
    assert est.dtype is None and est.bytes == est.stored_bytes


def test_sharded_safetensors_reads_every_shard_of_the_index(llama: dict) -> None:
    model, root = llama["model"], llama["root"]
    folder = root / "sharded"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3  # the 50KB limit really sharded it
    est = estimate_checkpoint(folder)
    assert est.format == "safetensors-sharded"
    assert sorted(Path(f).name for f in est.files) == shards
    assert est.parameters == model.num_parameters()
    assert est.stored_bytes == sum(safetensors_data_bytes(folder / s) for s in shards) == tensor_bytes(model)
    # The index file itself names the same checkpoint.
    assert estimate_checkpoint(folder / "model.safetensors.index.json").parameters == LLAMA_PARAMS


def test_torch_zip_sizes_come_from_the_zip_directory(llama: dict) -> None:
    model, root = llama["model"], llama["root"]
    path = root / "bin" / "pytorch_model.bin"
    est = estimate_checkpoint(path)
    assert est.format == "torch-zip"
    assert est.parameters == model.num_parameters()
    with zipfile.ZipFile(path) as archive:
        data = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
    assert est.stored_bytes == data == tensor_bytes(model)
    assert est.stored_dtypes == (("float32", LLAMA_PARAMS),)
    assert est.declared_dtype == "float32"
    assert estimate_checkpoint(root / "bin").format == "torch-zip"


def test_config_only_builds_on_meta(llama: dict) -> None:
    model, root = llama["model"], llama["root"]
    est = estimate_checkpoint(root / "config")
    assert est.format == "config-only"
    assert est.files == (str(root / "config" / "config.json"),)
    assert est.parameters == model.num_parameters()
    assert est.stored_bytes == LLAMA_PARAMS * 4
    assert est.bytes_for("int8") == estimate_checkpoint(root / "single").bytes_for("int8")


def test_tied_weights_count_once_in_every_format(gpt2: dict) -> None:
    model, root = gpt2["model"], gpt2["root"]
    assert model.lm_head.weight is model.transformer.wte.weight
    expected = model.num_parameters()  # counts the tied matrix once: 30,720
    assert expected == 30720
    for folder, fmt in (("single", "safetensors"), ("bin", "torch-zip"), ("config", "config-only")):
        est = estimate_checkpoint(root / folder)
        assert (est.format, est.parameters) == (fmt, expected)
        assert est.stored_bytes == expected * 4


def test_bytes_for_matches_hand_computed_figures(llama: dict) -> None:
    # Header arithmetic alone (transformers' rules: tests/checkpoints/test_estimate_rules.py).
    est = estimate_checkpoint(llama["root"] / "single", follow_transformers=False)
    assert est.bytes_for("float32") == LLAMA_PARAMS * 4 == 427_264
    assert est.bytes_for("bfloat16") == est.bytes_for("float16") == LLAMA_PARAMS * 2 == 213_632
    # int8: 1 byte per Linear weight + a float32 scale per output row; the rest in bfloat16.
    assert est.bytes_for("int8") == LLAMA_LINEAR + 4 * LLAMA_ROWS + 2 * LLAMA_OTHER == 144_000
    # nf4: half a byte per weight + a float32 absmax per 64; the rest in bfloat16.
    assert est.bytes_for("nf4") == LLAMA_LINEAR // 2 + 4 * LLAMA_BLOCKS + 2 * LLAMA_OTHER == 107_648
    # double quant: 1-byte absmax, a float32 per 256 blocks (one per tensor here) and an offset.
    nested = LLAMA_LINEAR // 2 + LLAMA_BLOCKS + 4 * LLAMA_LINEAR_TENSORS + 4 * LLAMA_LINEAR_TENSORS
    assert est.bytes_for("nf4", double_quant=True) == nested + 2 * LLAMA_OTHER == 104_304
    assert est.bytes_for("int8", unquantized_dtype="float32") == LLAMA_LINEAR + 4 * LLAMA_ROWS + 4 * LLAMA_OTHER


def test_gpt2_conv1d_weights_are_quantized_and_wte_wpe_are_not(gpt2: dict) -> None:
    est = estimate_checkpoint(gpt2["root"] / "single", follow_transformers=False)
    linear = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    rows = 2 * (32 + 32 + 32 + 128)  # shape[0] of each
    other = 30720 - linear  # wte, wpe, biases and layer norms
    assert est.bytes_for("int8") == linear + 4 * rows + 2 * other == 38_656
    # By transformers' rules the scales follow Conv1D's out_features (shape[1]), as bitsandbytes does.
    out_rows = 2 * (96 + 32 + 128 + 32)
    assert estimate_checkpoint(gpt2["root"] / "single").bytes_for("int8") == linear + 4 * out_rows + 2 * other


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("bf16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"),
     ("half", "float16"), ("fp32", "float32"), ("8bit", "int8"), ("4bit", "nf4"), (torch.float16, "float16")],
)
def test_dtype_spellings(llama: dict, alias: object, canonical: str) -> None:
    est = estimate_checkpoint(llama["root"] / "single", dtype=alias)  # type: ignore[arg-type]
    assert est.dtype == canonical
    assert est.bytes == est.bytes_for(canonical) == est.bytes_for(alias)  # type: ignore[arg-type]


def test_auto_dtype_uses_the_declared_dtype(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    est = estimate_checkpoint(tmp_path, dtype="auto")
    assert (est.declared_dtype, est.dtype, est.bytes, est.stored_bytes) == ("bfloat16", "bfloat16", 32, 64)


def test_unknown_dtype_is_refused(llama: dict) -> None:
    with pytest.raises(OomMagicError, match="unknown dtype 'int3'"):
        estimate_checkpoint(llama["root"] / "single", dtype="int3")
    with pytest.raises(OomMagicError, match="unknown dtype"):
        estimate_checkpoint(llama["root"] / "single").bytes_for("float128")


def test_integer_tensors_keep_their_size_and_bf16_fp8_are_read(tmp_path: Path) -> None:
    path = tmp_path / "mixed.safetensors"
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16),
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
            "model.position_ids": torch.zeros(1, 10, dtype=torch.int64),
        },
        str(path),
    )
    est = estimate_checkpoint(path)
    assert est.stored_dtypes == (("bfloat16", 8192), ("float8_e4m3fn", 4096), ("int64", 10))
    assert est.stored_bytes == 8192 * 2 + 4096 + 80
    assert est.bytes_for("float32") == (8192 + 4096) * 4 + 80  # int64 stays 8 bytes each
    assert est.bytes_for("int8") == 8192 + 4096 + 4 * (128 + 64) + 80


def test_torch_zip_reads_untyped_storage_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    shared = torch.zeros(3, 4, dtype=torch.bfloat16)
    torch.save(
        {"a.weight": shared, "tied.weight": shared,
         "scale": torch.zeros(5, dtype=torch.float8_e4m3fn), "ids": torch.zeros(2, dtype=torch.uint16)},
        path,
    )
    est = estimate_checkpoint(path)
    assert est.stored_dtypes == (("bfloat16", 12), ("float8_e4m3fn", 5), ("uint16", 2))
    assert (est.parameters, est.stored_bytes) == (19, 24 + 5 + 4)
    assert est.bytes_for("float32") == 17 * 4 + 4


def test_sharded_torch_zips_with_an_index(llama: dict, tmp_path: Path) -> None:
    model = llama["model"]
    state = model.state_dict()
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        torch.save({k: state[k] for k in keys}, tmp_path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    est = estimate_checkpoint(tmp_path, dtype="int8")
    assert est.format == "torch-zip-sharded"
    assert [Path(f).name for f in est.files] == list(halves)
    assert (est.parameters, est.stored_bytes, est.bytes) == (LLAMA_PARAMS, LLAMA_PARAMS * 4, 144_000)


def test_oversized_pickle_falls_back_to_sizes(llama: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the data.pkl cap the sizes stay exact; elements assume the declared dtype (float32)."""
    from oom_magic.checkpoints import torch_zip

    monkeypatch.setattr(torch_zip, "MAX_PICKLE_BYTES", 64)
    est = estimate_checkpoint(llama["root"] / "bin")
    assert est.stored_dtypes == (("unknown", LLAMA_PARAMS),)
    assert (est.parameters, est.stored_bytes) == (LLAMA_PARAMS, LLAMA_PARAMS * 4)
    assert est.bytes_for("bf16") == LLAMA_PARAMS * 2


def test_estimate_reads_headers_only_over_a_sparse_file(tmp_path: Path) -> None:
    """A 4 GiB tensor over a sparse file: the estimate needs no data, so it costs no disk."""
    n = 1 << 31
    header = {"model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [1 << 15, 1 << 16], "data_offsets": [0, 2 * n]}}
    path = write_safetensors(tmp_path / "model.safetensors", header)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size + 2 * n)
    est = estimate_checkpoint(path, dtype="nf4")
    assert (est.parameters, est.stored_bytes) == (n, 2 * n)
    assert est.bytes == n // 2 + 4 * (n // 64)


def test_the_core_never_imports_torch() -> None:
    code = (
        "import sys, tempfile, json, struct, pathlib\n"
        "from oom_magic.checkpoints.estimate import estimate_checkpoint\n"
        "d = pathlib.Path(tempfile.mkdtemp()) / 'model.safetensors'\n"
        "h = json.dumps({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}}).encode()\n"
        "d.write_bytes(struct.pack('<Q', len(h)) + h + bytes(8))\n"
        "print(estimate_checkpoint(d).parameters, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "False", "False"]


def test_safetensors_preferred_over_pickle_in_one_folder(llama: dict, tmp_path: Path) -> None:
    root = llama["root"]
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((root / "single" / name).read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02 legacy pickle that must not be read")
    est = estimate_checkpoint(tmp_path)
    assert (est.format, est.parameters) == ("safetensors", LLAMA_PARAMS)


# --------------------------------------------------------------------------- hub cache


def fake_hub_repo(cache: Path, repo_id: str, source: Path, *, ref: bool = True) -> Path:
    """Lay out a hub-cache repo the way huggingface_hub does: blobs + symlinked snapshot + refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_resolves_through_hf_hub_cache(llama: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = fake_hub_repo(tmp_path / "hub", "org/tiny-llama", llama["root"] / "single")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("org/tiny-llama") == snapshot
    est = estimate_checkpoint("org/tiny-llama", dtype="bf16")
    assert est.path == str(snapshot)
    assert est.files == (str(snapshot / "model.safetensors"),)  # the snapshot name, not the blob
    assert (est.parameters, est.bytes) == (LLAMA_PARAMS, LLAMA_PARAMS * 2)


def test_hub_id_resolves_through_hf_home_without_refs(llama: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = fake_hub_repo(tmp_path / "home" / "hub", "tiny", llama["root"] / "single", ref=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("tiny") == snapshot  # the only snapshot, refs/main missing


def test_uncached_hub_id_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    # As HF_HUB_OFFLINE=1 set before huggingface_hub is imported (it reads it once); online: tests/checkpoints/test_hub.py
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OomMagicError, match=r"org/missing is not in the local hub cache \(.*hub\) and HF_HUB_OFFLINE=1"
                       ) as info:
        estimate_checkpoint("org/missing")
    assert "\n" not in str(info.value)
    with pytest.raises(OomMagicError, match="no such file or folder: ./nope/model.safetensors"):
        estimate_checkpoint("./nope/model.safetensors")


# --------------------------------------------------------------------------- malformed input


def valid_header() -> dict[str, object]:
    return {
        "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]},
    }


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ("not json", "the header is not valid JSON"),
        ([1, 2], "the header is a JSON array, not an object"),
        ({"a": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}}, "tensor 'a' has unknown dtype 'F7'"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "tensors 'a' and 'b' overlap"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "4 bytes before tensor 'a' belong to no tensor"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, r"float32 \[3\] = 12 bytes, but its data_offsets span 8"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 8]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"x": 1}}, "__metadata__"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "ends at data byte 16, but the file holds only 8"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "4 bytes after the last tensor"),
    ],
)
def test_malformed_headers_are_one_line_errors(tmp_path: Path, header: object, match: str) -> None:
    raw = header.encode() if isinstance(header, str) else None
    path = write_safetensors(tmp_path / "model.safetensors", header, bytes(8), raw_header=raw)
    with pytest.raises(OomMagicError, match=f"^model.safetensors: .*({match})") as info:
        estimate_checkpoint(path)
    assert "\n" not in str(info.value)


def test_header_length_past_the_end(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + bytes(1016))
    message = (
        "model.safetensors: header length 18446744073709551615 is past the end of the 1024-byte file; "
        "the file is truncated or not safetensors"
    )
    with pytest.raises(OomMagicError) as info:
        estimate_checkpoint(path)
    assert str(info.value) == message


def test_header_over_the_100mb_limit(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 150_000_000))
    with open(path, "r+b") as handle:
        handle.truncate(200_000_000)  # sparse: costs no disk
    with pytest.raises(OomMagicError, match="header length 150000000 is over safetensors' 100000000-byte limit"):
        estimate_checkpoint(path)


def test_truncated_and_tiny_files(llama: dict, tmp_path: Path) -> None:
    whole = (llama["root"] / "single" / "model.safetensors").read_bytes()
    path = tmp_path / "model.safetensors"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(OomMagicError, match="model.safetensors: tensor .* the file is truncated"):
        estimate_checkpoint(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(OomMagicError, match="the file is 2 bytes, too short for a safetensors header"):
        estimate_checkpoint(path)


def test_non_utf8_and_duplicate_keys(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "model.safetensors", None, raw_header=b'{"a\xff": {}}')
    with pytest.raises(OomMagicError, match=r"the header is not UTF-8 \(byte 11\)"):
        estimate_checkpoint(path)
    body = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    write_safetensors(path, None, bytes(2), raw_header=body)
    with pytest.raises(OomMagicError, match="the header names 'a' twice"):
        estimate_checkpoint(path)


def test_legacy_pickle_and_unknown_bin(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(
        OomMagicError,
        match=r"^pytorch_model.bin: legacy pickle checkpoint: re-save with torch.save \(zip\) or convert to safetensors$",
    ):
        estimate_checkpoint(path)
    path.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(OomMagicError, match="neither safetensors nor a torch.save zip"):
        estimate_checkpoint(tmp_path)


def rewrite_zip(source: Path, target: Path, keep=lambda name: True, rename=lambda name: name) -> None:  # type: ignore[no-untyped-def]
    """Copy a zip member by member (stored), dropping or renaming members."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if keep(info.filename):
                dst.writestr(rename(info.filename), src.read(info))


def test_damaged_torch_zips(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(4), "v": torch.ones(2)}, good)
    missing = tmp_path / "missing.pt"
    rewrite_zip(good, missing, keep=lambda n: not n.endswith("/data/1"))
    with pytest.raises(OomMagicError, match=r"missing.pt: data.pkl names storage '1' but the zip has no data/1"):
        estimate_checkpoint(missing)
    nopickle = tmp_path / "nopickle.pt"
    rewrite_zip(good, nopickle, keep=lambda n: not n.endswith("data.pkl"))
    with pytest.raises(OomMagicError, match="nopickle.pt: a zip without a top-level data.pkl"):
        estimate_checkpoint(nopickle)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:300])
    with pytest.raises(OomMagicError, match="truncated.pt: no zip end-of-directory record"):
        estimate_checkpoint(truncated)


def test_zip_with_too_many_members_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "many.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    raw = bytearray(path.read_bytes())
    end = raw.rfind(b"PK\x05\x06")
    raw[end + 8:end + 12] = struct.pack("<HH", 0xFFFE, 0xFFFE)  # claim 65534 members
    raw[end + 12:end + 16] = struct.pack("<I", 0x7FFFFFFF)  # and a 2 GiB directory
    path.write_bytes(bytes(raw))
    with pytest.raises(OomMagicError, match="is not a torch checkpoint"):
        estimate_checkpoint(path)


def test_index_problems(llama: dict, tmp_path: Path) -> None:
    source = llama["root"] / "sharded"
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first_shard).unlink()
    with pytest.raises(OomMagicError, match=f"names shard '{first_shard}', which is not in .*; the download is incomplete"):
        estimate_checkpoint(tmp_path)
    (tmp_path / first_shard).write_bytes((source / first_shard).read_bytes())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(OomMagicError, match=f"names tensor '{name}' in {other}, which does not hold it"):
        estimate_checkpoint(tmp_path)
    index["weight_map"][name] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(OomMagicError, match="points outside the checkpoint folder"):
        estimate_checkpoint(tmp_path)


def test_folders_without_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(OomMagicError, match="no checkpoint here"):
        estimate_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(OomMagicError, match="config.json: transformers cannot read it"):
        estimate_checkpoint(tmp_path)
    save_file({"w": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(OomMagicError, match=r"holds several checkpoints \(a.safetensors, b.safetensors\)"):
        estimate_checkpoint(tmp_path)


# --------------------------------------------------------------------------- fuzz

_FUZZ_SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_bytes() -> bytes:
    body = json.dumps(valid_header()).encode()
    return struct.pack("<Q", len(body)) + body + bytes(24)


def _check_outcome(path: Path) -> None:
    """The only outcomes allowed: a consistent estimate, or a one-line OomMagicError."""
    try:
        est = estimate_checkpoint(path)
    except OomMagicError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert est.parameters >= 0 and est.stored_bytes >= 0
    assert sum(n for _, n in est.stored_dtypes) == est.parameters
    assert est.bytes_for("bfloat16") >= 0 and est.bytes_for("nf4") >= 0


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@_FUZZ_SETTINGS
@given(
    edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 200)),
    length=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_fuzz_mutated_safetensors_bytes(fuzz_dir: Path, edits: list, cut: int | None, length: int | None) -> None:
    data = bytearray(_valid_bytes())
    for at, value in edits:
        if at < len(data):
            data[at] = value
    if length is not None:
        data[:8] = struct.pack("<Q", length)
    if cut is not None:
        del data[cut:]
    path = fuzz_dir / "model.safetensors"
    path.write_bytes(bytes(data))
    _check_outcome(path)


_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=6)
)
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "BOOL", "F8_E4M3", "F4", "F6_E2M3", "C64", "X"]),
        "shape": st.lists(st.integers(-1, 5), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 64), min_size=0, max_size=3),
    }
) | _json


@_FUZZ_SETTINGS
@given(header=st.dictionaries(st.text(max_size=5), _entry, max_size=4) | _json, data=st.integers(0, 64))
def test_fuzz_random_header_json(fuzz_dir: Path, header: object, data: int) -> None:
    path = write_safetensors(fuzz_dir / "model.safetensors", header, bytes(data))
    _check_outcome(path)


@pytest.fixture(scope="module")
def zip_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w.weight": torch.zeros(2, 2, dtype=torch.bfloat16), "s": torch.zeros(3, dtype=torch.float8_e5m2)}, buffer)
    return buffer.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), min_size=1, max_size=4),
    inside_pickle=st.booleans(),
)
def test_fuzz_mutated_torch_zip(fuzz_dir: Path, zip_bytes: bytes, edits: list, inside_pickle: bool) -> None:
    """Mutate the zip itself, or data.pkl inside a well-formed zip (so the opcode walker sees it)."""
    path = fuzz_dir / "pytorch_model.bin"
    if inside_pickle:
        with zipfile.ZipFile(io.BytesIO(zip_bytes)) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                member = bytearray(src.read(info))
                if info.filename.endswith("data.pkl"):
                    for at, value in edits:
                        member[at % len(member)] = value
                dst.writestr(info.filename, bytes(member))
    else:
        data = bytearray(zip_bytes)
        for at, value in edits:
            data[at % len(data)] = value
        path.write_bytes(bytes(data))
    _check_outcome(path)


def _flag_data_pkl(zip_bytes: bytes, bits: int) -> bytes:
    """The zip with data.pkl's central-directory flag bits OR'd with bits (what zipfile checks on open)."""
    data = bytearray(zip_bytes)
    at = data.index(b"PK\x01\x02")
    while not data[at + 46:].startswith(b"archive/data.pkl"):
        at = data.index(b"PK\x01\x02", at + 4)
    flags = int.from_bytes(data[at + 8:at + 10], "little") | bits
    data[at + 8:at + 10] = flags.to_bytes(2, "little")
    return bytes(data)


@pytest.mark.parametrize(
    "bits, says",
    [(0x1, "data.pkl is marked encrypted"), (0x20, "damaged zip archive"), (0x40, "damaged zip archive")],
    ids=["encrypted", "patched-data", "strong-encryption"],
)
def test_a_data_pkl_zipfile_cannot_open_is_a_one_line_error(tmp_path: Path, zip_bytes: bytes, bits: int, says: str) -> None:
    """Found by test_fuzz_mutated_torch_zip: one flipped flag bit made zipfile raise RuntimeError
    (encrypted) or NotImplementedError out of the checkpoint readers; both refuse it in one line."""
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(_flag_data_pkl(zip_bytes, bits))
    with pytest.raises(OomMagicError, match=says) as estimated:
        estimate_checkpoint(path)
    with pytest.raises(OomMagicError, match=says) as keyed:
        read_checkpoint_keys(path)
    for exc in (estimated.value, keyed.value):
        assert "\n" not in str(exc) and "pytorch_model.bin" in str(exc)
