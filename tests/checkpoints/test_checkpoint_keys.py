"""A torch.save checkpoint's top-level keys, the bytes under each and its saved devices, read from
data.pkl's opcodes (``oom_magic.checkpoints.files.read_checkpoint_keys``) within fixed bounds.

Real checkpoints only: a tiny Llama trained one AdamW step and saved with torch.save, the same zip
with data.pkl deflated or LZMA-compressed (as a zip tool might repack it), and a 15,000-tensor
state dict to show the caps leave room for big real files.
"""
from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oom_magic.checkpoints import files as checkpoints

from oom_magic.fit import preflight
from oom_magic.checkpoints.files import CheckpointKeys, read_checkpoint_keys
from oom_magic.common.errors import OomMagicError

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture(scope="module")
def train(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """A real training checkpoint: (path, bytes of the model's state dict, bytes of the optimizer's)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    path = tmp_path_factory.mktemp("keys") / "train.pt"
    torch.save({"model_state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    model_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in model.state_dict().values()}.values())
    optimizer_bytes = sum(t.untyped_storage().nbytes() for s in optimizer.state_dict()["state"].values()
                          for t in s.values())
    return path, model_bytes, optimizer_bytes


def _repacked(source: Path, target: Path, method: int) -> Path:
    """The same checkpoint with data.pkl compressed by ``method`` (torch.save stores it)."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            method_here = method if info.filename.endswith("/data.pkl") else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=method_here)
    return target


def test_preflight_reexports_the_reader() -> None:
    assert preflight.read_checkpoint_keys is checkpoints.read_checkpoint_keys
    assert preflight.CheckpointKeys is checkpoints.CheckpointKeys


def test_a_real_training_checkpoint(train: tuple[Path, int, int]) -> None:
    path, model_bytes, optimizer_bytes = train
    keys = read_checkpoint_keys(path)
    assert isinstance(keys, CheckpointKeys)
    assert keys.keys == (("model_state_dict", model_bytes), ("optimizer", optimizer_bytes), ("epoch", 0))
    assert keys.locations == ("cpu",) and keys.total == model_bytes + optimizer_bytes
    assert keys.model_key() == ("model_state_dict", model_bytes)
    assert keys.optimizer_keys() == (("optimizer", optimizer_bytes),)


def test_a_deflated_data_pkl_is_read_as_torch_load_reads_it(train: tuple[Path, int, int], tmp_path: Path) -> None:
    path, _, _ = train
    deflated = _repacked(path, tmp_path / "deflated.pt", zipfile.ZIP_DEFLATED)
    assert set(torch.load(deflated, weights_only=True)) == {"model_state_dict", "optimizer", "epoch"}
    assert read_checkpoint_keys(deflated) == read_checkpoint_keys(path)


@pytest.mark.parametrize("method, name", [(zipfile.ZIP_LZMA, "LZMA"), (zipfile.ZIP_BZIP2, "bzip2")])
def test_a_data_pkl_torch_load_cannot_read_is_refused(train: tuple[Path, int, int], tmp_path: Path,
                                                      method: int, name: str) -> None:
    path, _, _ = train
    packed = _repacked(path, tmp_path / "packed.pt", method)
    with pytest.raises(RuntimeError, match="unsupported method"):
        torch.load(packed, weights_only=True)
    with pytest.raises(OomMagicError) as caught:
        read_checkpoint_keys(packed)
    assert str(caught.value) == (f"packed.pt: data.pkl is compressed with {name}, which torch.load cannot read; "
                                 "re-save it with torch.save or pass a safetensors file")


def test_a_big_real_state_dict_is_within_the_caps(tmp_path: Path) -> None:
    # 15,000 tensors (~450,000 opcodes): more than any dense model's state dict (a 70B Llama: 723).
    state = {f"model.layers.{i // 300}.mlp.experts.{i % 300}.weight": torch.zeros(2) for i in range(15_000)}
    path = tmp_path / "big.pt"
    torch.save(state, path)
    keys = read_checkpoint_keys(path)
    assert keys is not None and len(keys.keys) == 15_000 and keys.total == 15_000 * 8
    assert keys.keys[-1] == ("model.layers.49.mlp.experts.299.weight", 8)


def test_files_that_are_not_torch_zips(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert read_checkpoint_keys(text) is None
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("readme.txt", "no pickle here")
    assert read_checkpoint_keys(other) is None


def test_a_zip_directory_that_claims_too_much_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    raw = bytearray(buffer.getvalue())
    end = raw.rfind(b"PK\x05\x06")
    raw[end + 12:end + 16] = struct.pack("<I", 2**31)  # a 2 GiB central directory
    path = tmp_path / "claims.pt"
    path.write_bytes(bytes(raw))
    with pytest.raises(OomMagicError, match=r"^claims\.pt: a zip directory of 1 members / 2147483648 bytes"):
        read_checkpoint_keys(path)
