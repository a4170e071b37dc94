"""Benchmark estimate_checkpoint on Llama-2-70B / 7B-shaped sharded safetensors vs accelerate's meta estimate.

The checkpoints are real: real safetensors headers and a real model.safetensors.index.json, with
tensor names and shapes taken from transformers' own LlamaForCausalLM (built on the meta device),
written over sparse files (file.truncate) so a 138 GB checkpoint costs no disk. The baseline is
what people do today: ``init_empty_weights`` + ``AutoModelForCausalLM.from_config`` +
``accelerate.utils.calculate_maximum_sizes``. Timings are best-of-N with a warm page cache.

Run: ``python benchmarks/bench_estimate.py``; the bench runner calls ``run()``.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oom_magic.checkpoints.estimate import estimate_checkpoint  # noqa: E402
from oom_magic.checkpoints.safetensors_header import read_safetensors_header  # noqa: E402
from oom_magic.render.units import format_bytes  # noqa: E402

SHAPES = {
    # name: (LlamaConfig kwargs, max shard bytes) - shard sizes give 29 shards for 70B, 2 for 7B
    "llama-2-70b": (
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, vocab_size=32000),
        4_900_000_000,
    ),
    "llama-2-7b": (
        dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000),
        10_000_000_000,
    ),
}
_SAFETENSORS_CODE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _best(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best wall time of `repeat` calls (seconds) and the last result."""
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _meta_model(config_kwargs: dict) -> tuple[object, object]:
    """LlamaForCausalLM on the meta device, as accelerate's estimate builds it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**config_kwargs)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def write_sparse_checkpoint(folder: Path, config_kwargs: dict, max_shard: int, dtype: str = "bfloat16") -> int:
    """Write a sharded safetensors checkpoint of the model's real names/shapes over sparse files; return shards."""
    import torch

    config, model = _meta_model(config_kwargs)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # save_pretrained's content: the state dict minus tied duplicates (Llama-2 is untied).
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in tensors:
        size = math.prod(shape) * itemsize
        if shards[-1] and used + size > max_shard:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    total = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for number, shard in enumerate(shards, 1):
        file_name = f"model-{number:05d}-of-{total:05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            size = math.prod(shape) * itemsize
            header[name] = {"dtype": _SAFETENSORS_CODE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file_name
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)  # safetensors pads the header to 8 bytes
        with open(folder / file_name, "wb") as handle:
            handle.write(struct.pack("<Q", len(body)) + body)
            handle.truncate(8 + len(body) + offset)  # sparse: the data costs no disk
        total_size += offset
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = dtype
    config.save_pretrained(folder)
    return total


def _safe_open_headers(folder: Path) -> int:
    """The alternative reader: every shard's header through safetensors.safe_open (mmaps each file)."""
    from safetensors import safe_open

    count = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                count += math.prod(piece.get_shape()) if piece.get_dtype() else 0
    return count


def _own_headers(folder: Path) -> int:
    """Our header reader alone, for the same comparison."""
    return sum(
        math.prod(shape)
        for shard in sorted(folder.glob("*.safetensors"))
        for _, _, shape, _ in read_safetensors_header(shard)
    )


def _accelerate_estimate(config_kwargs: dict) -> tuple[int, int, int]:
    """accelerate's way: meta model + calculate_maximum_sizes. Returns (total bytes, parameters, persisted elements)."""
    from accelerate.utils import calculate_maximum_sizes

    _, model = _meta_model(config_kwargs)
    total_size, _largest = calculate_maximum_sizes(model)
    persisted = {id(t): t.numel() for t in model.state_dict(keep_vars=True).values()}
    return int(total_size), int(model.num_parameters()), sum(persisted.values())


def bench_one(name: str, repeat: int = 50, baseline_repeat: int = 3) -> dict[str, object]:
    """Write one checkpoint shape, time both estimates, and return the figures."""
    config_kwargs, max_shard = SHAPES[name]
    with tempfile.TemporaryDirectory(prefix=f"oom-magic-bench-{name}-") as tmp:
        folder = Path(tmp)
        shards = write_sparse_checkpoint(folder, config_kwargs, max_shard)
        estimate_checkpoint(folder)  # warm imports and page cache
        ours_s, est = _best(lambda: estimate_checkpoint(folder), repeat)
        own_headers_s, _ = _best(lambda: _own_headers(folder), repeat)
        safe_open_s, safe_open_params = _best(lambda: _safe_open_headers(folder), repeat)
        accelerate_s, (acc_bytes, acc_params, acc_persisted) = _best(
            lambda: _accelerate_estimate(config_kwargs), baseline_repeat
        )
        logical = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        on_disk = sum(p.stat().st_blocks * 512 for p in folder.glob("*.safetensors"))
    assert est.parameters == acc_persisted == safe_open_params, (est.parameters, acc_persisted, safe_open_params)
    return {
        "name": name,
        "shards": shards,
        "checkpoint_bytes": logical,
        "disk_bytes_used": on_disk,
        "parameters": est.parameters,
        "accelerate_parameters": acc_params,
        "accelerate_persisted_elements": acc_persisted,
        "estimate_ms": ours_s * 1e3,
        "header_reader_ms": own_headers_s * 1e3,
        "safe_open_headers_ms": safe_open_s * 1e3,
        "accelerate_ms": accelerate_s * 1e3,
        "speedup_vs_accelerate": accelerate_s / ours_s,
        "accelerate_total_size_bytes": acc_bytes,  # meta model in float32, non-persistent buffers included
        "bytes": {
            "float32": est.bytes_for("float32"),
            "bfloat16": est.bytes_for("bfloat16"),
            "int8": est.bytes_for("int8"),
            "nf4": est.bytes_for("nf4"),
            "nf4_double_quant": est.bytes_for("nf4", double_quant=True),
        },
    }


def run() -> dict[str, object]:
    """Benchmark both shapes; the dict the bench runner records."""
    return {name: bench_one(name) for name in SHAPES}


def _report(results: dict[str, object]) -> None:
    for result in results.values():
        r = dict(result)  # type: ignore[arg-type]
        print(f"== {r['name']}: {r['shards']} shards, {r['checkpoint_bytes'] / 1e9:.1f} GB logical, "
              f"{r['disk_bytes_used'] / 1e6:.2f} MB on disk")
        print(f"   estimate_checkpoint      {r['estimate_ms']:9.2f} ms   parameters {r['parameters']:,}")
        print(f"   own header reader        {r['header_reader_ms']:9.2f} ms")
        print(f"   safetensors.safe_open    {r['safe_open_headers_ms']:9.2f} ms")
        print(f"   accelerate meta estimate {r['accelerate_ms']:9.2f} ms   parameters {r['accelerate_parameters']:,}"
              f" (persisted elements {r['accelerate_persisted_elements']:,})")
        print(f"   speedup                  {r['speedup_vs_accelerate']:9.0f} x")
        print("   bytes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in r["bytes"].items()))  # type: ignore[union-attr]


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _report(run())
