"""Size a checkpoint before loading it: parameters and bytes per dtype, from file headers only.

``estimate_checkpoint("meta-llama/Llama-2-7b-hf", dtype="bfloat16")`` reads safetensors headers
(or a torch.save zip's directory and pickle opcodes, never executing them) and answers in
milliseconds, without reading tensor data, importing torch, or going online. A folder with only
a config.json is sized by building the model on the meta device through transformers, in a
child process bounded in time and memory (config_size.py).

The tutorial's rule of thumb for a 7B model (28 / 14 / 7 / ~3.5 GiB in fp32 / fp16 / int8 /
int4) is the naive bound ``parameters x bytes per element``. What bitsandbytes really allocates
when transformers loads Llama-2-7B (6,738,415,616 parameters) that way is 25.10 / 12.55 / 6.53 /
3.88 GiB (3.60 GiB with double quantization): 8-bit and 4-bit quantize only the Linear layers'
weights, keep embeddings, ``lm_head`` and norms in 16-bit, and add per-row / per-block scales.
"""
from __future__ import annotations

import json
import math
import os
import pickletools
import re
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .checkpoints import (
    CheckpointFiles,
    check_zip_directory,
    find_checkpoint_files,
    one_line,
    read_config,
    resolve_checkpoint,
    sniff_format,
)
from .errors import OomMagicError

if TYPE_CHECKING:
    from .hf_rules import HeldBytes

__all__ = ["CheckpointEstimate", "estimate_checkpoint", "resolve_checkpoint"]

# Bits per element of every dtype a checkpoint may hold (torch names).
_DTYPE_BITS: dict[str, int] = {
    "float64": 64, "float32": 32, "float16": 16, "bfloat16": 16,
    "float8_e4m3fn": 8, "float8_e5m2": 8, "float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8,
    "float8_e8m0fnu": 8, "float4_e2m1fn_x2": 8,
    "float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4,
    "int64": 64, "int32": 32, "int16": 16, "int8": 8,
    "uint64": 64, "uint32": 32, "uint16": 16, "uint8": 8, "bool": 8,
    "complex128": 128, "complex64": 64, "complex32": 32,
    "qint8": 8, "quint8": 8, "qint32": 32, "quint4x2": 8, "quint2x4": 8,
}
_SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn", "F4": "float4_e2m1fn",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
}
# Legacy typed-storage classes torch.save names in data.pkl (torch.storage._dtype_to_storage_type_map).
_STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QInt32Storage": "qint32", "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}
_UNKNOWN = "unknown"  # a torch storage whose dtype the pickle does not say
_FLOATING = frozenset(n for n in _DTYPE_BITS if n.startswith(("float", "bfloat"))) | {_UNKNOWN}

# The dtypes a load can ask for, and the spellings people use for them.
_CAST_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_QUANTIZED = ("int8", "nf4", "fp4")
_ALIASES = {
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "8bit": "int8", "int8": "int8", "llm.int8": "int8", "llm_int8": "int8", "load_in_8bit": "int8",
    "4bit": "nf4", "int4": "nf4", "load_in_4bit": "nf4",
}

# bitsandbytes figures (functional.quantize_4bit / Int8Params), see bytes_for.
_NF4_BLOCK = 64  # BitsAndBytesConfig's default blocksize for 4-bit weights
_NESTED_BLOCK = 256  # quantize_4bit(compress_statistics=True) -> quantize_blockwise(absmax, blocksize=256)

_MAX_HEADER_BYTES = 100_000_000  # safetensors' own MAX_HEADER_SIZE: the library refuses larger headers
# What we parse, so that sizing stays within ~1 s and ~50 MB of memory (JSON objects take 10-30x
# their text): 4 MiB and 500,000 JSON values hold ~40,000 tensors; real headers are under 1 MiB.
_MAX_READ_HEADER_BYTES = 4 * 1024 * 1024
_MAX_HEADER_VALUES = 500_000
_MAX_ZIP_MEMBERS = 100_000  # a torch.save zip holds one member per storage plus ~6
_MAX_PICKLE_BYTES = 16 * 1024 * 1024  # a 70B state dict's data.pkl is ~100 KB
_ZIP_ENCRYPTED = 0x1  # zip general-purpose flag bit 0: zipfile refuses to open the member without a password
# The opcode walk stops (sizes stay exact, dtypes unknown) past these: ~10,000 tensors' worth of
# opcodes, and a bound on what the symbolic stack and memo hold, whatever the bytes say.
_MAX_PICKLE_OPS = 250_000
_MAX_PICKLE_ITEMS = 250_000
_MAX_ELEMENTS = 1 << 64

# Module names bitsandbytes leaves alone (see bytes_for); "embed", "norm" and "ln*" match as parts.
_EMBEDDING_MODULES = frozenset({"wte", "wpe", "shared", "lm_head"})
# A per-expert weight of a MoE layer ("...block_sparse_moe.experts.3.w1.weight", "mlp.experts.0.up_proj...").
_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")
_LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.(\d+)\.")
_HEAD_MODULES = frozenset({"lm_head", "output", "embed_out", "score", "classifier", "qa_outputs"})


class _Stored(NamedTuple):
    """One stored tensor (or torch storage): what it costs now and whether 8/4-bit would shrink it."""

    dtype: str
    elements: int
    nbytes: int
    # (elements, rows) of each Linear weight it holds; empty when bitsandbytes would leave it as is
    linear: tuple[tuple[int, int], ...] = ()
    expert: bool = False  # one expert's weight of a MoE layer (transformers 5 fuses them on load)
    layer: int | None = None  # the "layers.N" index in its name, for expert weights


@dataclass(frozen=True)
class _Sizes:
    """The sums bytes_for needs, so that any dtype is answered without the tensor list."""

    fixed_bytes: int  # integer/bool/complex tensors: no load dtype changes them
    float_elements: int  # every floating element, Linear weights included
    linear_elements: int
    linear_rows: int
    linear_tensors: int
    linear_packed_bytes: int  # sum of ceil(n / 2): two 4-bit codes per byte
    linear_blocks: int  # sum of ceil(n / 64)
    linear_nested_blocks: int  # sum of ceil(ceil(n / 64) / 256)
    expert_elements: int = 0  # floating elements of per-expert MoE weights (fused on load)
    expert_bytes: int = 0  # the same, as stored
    expert_layers: int = 0  # how many layers hold expert weights
    stored_tensors: int = 0  # tensors (torch: storages) in the checkpoint


@dataclass(frozen=True)
class CheckpointEstimate:
    """What a checkpoint holds and what loading it costs in device memory, before loading it."""

    path: str
    format: str  # 'safetensors' | 'safetensors-sharded' | 'torch-zip' | 'torch-zip-sharded' | 'config-only'
    files: tuple[str, ...]
    parameters: int  # elements of every stored tensor; tied weights are stored, and counted, once
    stored_bytes: int  # tensor data as stored (for 'config-only': at the declared dtype)
    dtype: str | None  # the dtype asked for ('bfloat16', 'nf4', ...); None = as stored
    bytes: int  # bytes_for(dtype), or stored_bytes when dtype is None
    stored_dtypes: tuple[tuple[str, int], ...]  # (dtype name, elements), most elements first
    declared_dtype: str | None  # config.json's "dtype"/"torch_dtype" beside the weights
    _sizes: _Sizes = field(repr=False, compare=False)
    # The folder whose config.json transformers' rules are asked about (quantized / float16
    # loads, see hf_rules); None: header arithmetic only.
    _rules_dir: str | None = field(default=None, repr=False, compare=False)

    def bytes_for(
        self, dtype: str, *, double_quant: bool = False, unquantized_dtype: str = "bfloat16",
        skip_modules: tuple[str, ...] | None = None,
    ) -> int:
        """Return the bytes the weights take once loaded as `dtype` (tensor data, no allocator slack).

        'float32' / 'float16' / 'bfloat16' (also 'fp32', 'bf16', 'torch.float16', ...): floating
        tensors are cast, integer and bool tensors keep their stored size.

        'int8' ('8bit') and 'nf4' / 'fp4' ('4bit') follow bitsandbytes as transformers applies it
        (``BitsAndBytesConfig(load_in_8bit=True)`` / ``load_in_4bit=True``): only Linear weights
        are quantized; embeddings, the output head and norms and biases stay floating, in
        `unquantized_dtype` (the ``dtype=`` passed to from_pretrained; bfloat16 unless told).
        int8 (LLM.int8): 1 byte per weight plus one float32 scale per output row (``SCB``).
        nf4/fp4: half a byte per weight plus a float32 absmax per block of 64; with
        `double_quant` (``bnb_4bit_use_double_quant``) the absmax is 1 byte per block, plus a
        float32 per 256 blocks and one float32 offset per weight. Per-layer lookup tables
        (≤ 1 KiB) are left out.

        A Linear weight is told from its name and shape (the checkpoint has no module types): a
        2-D floating ``*.weight`` whose module name is not an embedding (contains "embed", or is
        wte / wpe / shared / word_embeddings / position_embeddings), not an output head (lm_head,
        output, embed_out, score, classifier, qa_outputs: transformers keeps the head and tied
        weights unquantized) and not a norm. Rows are ``shape[0]``, nn.Linear's out_features
        (GPT-2's Conv1D stores [in, out]: its int8 scale count is off by in - out per layer).

        Made with ``follow_transformers``, int8/nf4/fp4 and float16 follow transformers' own rules
        instead (``held_by_rules``): which modules bitsandbytes replaces (fused MoE experts stay
        16-bit; ``skip_modules`` = ``llm_int8_skip_modules``), which stay float32, and each
        replaced weight in bitsandbytes' layout including its per-layer code table.
        """
        canonical = _canonical_request(dtype)
        held = self.held_by_rules(canonical, double_quant=double_quant, unquantized_dtype=unquantized_dtype,
                                  skip_modules=skip_modules)
        if held is not None:
            return held.bytes
        return _bytes_for(self._sizes, canonical, double_quant, unquantized_dtype)

    def held_by_rules(self, dtype: str, *, double_quant: bool = False, unquantized_dtype: str = "bfloat16",
                      skip_modules: tuple[str, ...] | None = None) -> HeldBytes | None:
        """What transformers' own rules say a quantized or float16 load holds (see hf_rules), or None.

        None when this estimate was made without them (``follow_transformers``), the load is not
        quantized or float16, or the model cannot be built on the meta device.
        """
        canonical = _canonical_request(dtype)
        if self._rules_dir is None or (canonical not in _QUANTIZED and canonical != "float16"):
            return None
        from .hf_rules import MAX_TENSORS, held_bytes

        if self._sizes.stored_tensors > MAX_TENSORS:
            return None  # a model this size is not built on meta before the load: header arithmetic answers

        rest = _canonical_request(unquantized_dtype)
        return held_bytes(self._rules_dir, canonical, unquantized_dtype=rest, double_quant=double_quant,
                          skip_modules=skip_modules)

    def __repr__(self) -> str:
        return (
            f"CheckpointEstimate(path={self.path!r}, format={self.format!r}, files={len(self.files)},"
            f" parameters={self.parameters}, stored_bytes={self.stored_bytes},"
            f" dtype={self.dtype!r}, bytes={self.bytes})"
        )


def estimate_checkpoint(
    path_or_id: str | os.PathLike[str], dtype: str | None = None, *, follow_transformers: bool | None = None
) -> CheckpointEstimate:
    """Size a checkpoint (file, folder, or cached hub id) from its headers; `dtype` picks `bytes`.

    `follow_transformers`: size quantized and float16 loads by transformers' own rules (fused MoE
    experts stay 16-bit under bitsandbytes, ``_keep_in_fp32_modules`` stay float32; see hf_rules)
    on a meta model built when such a figure is asked for. None (default): only when torch and
    transformers are already imported, so that this never imports them on its own.

    `dtype` is None (as stored), 'auto' (config.json's dtype, else as stored), a float dtype
    ('bfloat16', 'fp16', 'torch.float32', ...) or a bitsandbytes load ('int8', 'nf4'); see
    CheckpointEstimate.bytes_for. Raises OomMagicError, one line naming the file, for anything
    that is missing, malformed or not a checkpoint.
    """
    if follow_transformers is None:
        follow_transformers = "torch" in sys.modules and "transformers" in sys.modules
    try:
        return _estimate(path_or_id, dtype, follow_transformers)
    except OomMagicError as exc:
        message = str(exc)
        if one_line(message, limit=1000) != message:  # a file name with a newline in it, say
            raise OomMagicError(one_line(message, limit=1000)) from None
        raise


def _estimate(path_or_id: str | os.PathLike[str], dtype: str | None, follow_transformers: bool) -> CheckpointEstimate:
    found = find_checkpoint_files(resolve_checkpoint(path_or_id))
    rules_dir = str(found.config.parent) if follow_transformers and found.config is not None else None
    declared = _declared_dtype(found)
    request = None if dtype is None else str(dtype)
    if request is not None and request.strip().lower() == "auto":
        request = declared if declared in _CAST_BYTES else None
    canonical = None if request is None else _canonical_request(request)
    stored = _read_stored(found, declared)
    sizes = _summarize(stored)
    stored_bytes = sum(item.nbytes for item in stored)
    estimate = CheckpointEstimate(
        path=str(found.path),
        format=found.format,
        files=tuple(str(p) for p in found.files),
        parameters=sum(item.elements for item in stored),
        stored_bytes=stored_bytes,
        dtype=canonical,
        bytes=stored_bytes,
        stored_dtypes=_dtype_census(stored),
        declared_dtype=declared,
        _sizes=sizes,
        _rules_dir=rules_dir,
    )
    return estimate if canonical is None else replace(estimate, bytes=estimate.bytes_for(canonical))


# --------------------------------------------------------------------------- dtype arithmetic


def _canonical_request(dtype: object) -> str:
    """Normalise a requested load dtype ('bf16', 'torch.bfloat16', '4bit') to its canonical name."""
    text = str(dtype).strip().lower().removeprefix("torch.")
    name = _ALIASES.get(text, text)
    if name in _CAST_BYTES or name in _QUANTIZED:
        return name
    raise OomMagicError(
        f"unknown dtype {str(dtype)!r}: use float32, float16, bfloat16, int8 or nf4 (or fp32, fp16, bf16, 8bit, 4bit)"
    )


def _bytes_for(sizes: _Sizes, dtype: str, double_quant: bool, unquantized_dtype: str) -> int:
    """Bytes of the weights loaded as canonical `dtype`; see CheckpointEstimate.bytes_for."""
    if dtype in _CAST_BYTES:
        return sizes.fixed_bytes + sizes.float_elements * _CAST_BYTES[dtype]
    rest = _canonical_request(unquantized_dtype)
    if rest not in _CAST_BYTES:
        raise OomMagicError(f"unquantized_dtype must be a float dtype, not {unquantized_dtype!r}")
    other = (sizes.float_elements - sizes.linear_elements) * _CAST_BYTES[rest]
    if dtype == "int8":
        linear = sizes.linear_elements + 4 * sizes.linear_rows
    elif double_quant:
        linear = (
            sizes.linear_packed_bytes
            + sizes.linear_blocks
            + 4 * sizes.linear_nested_blocks
            + 4 * sizes.linear_tensors
        )
    else:
        linear = sizes.linear_packed_bytes + 4 * sizes.linear_blocks
    return sizes.fixed_bytes + other + linear


def _is_floating(dtype: str) -> bool:
    """Say whether a load dtype would cast this stored dtype (torch's is_floating_point)."""
    return dtype in _FLOATING


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Guess from a tensor's name and shape whether bitsandbytes would quantize it (see bytes_for)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    modules = name.lower().split(".")[:-1]
    if not modules or modules[-1] in _HEAD_MODULES:
        return False
    for part in modules:
        if "embed" in part or "norm" in part or part.startswith("ln") or part in _EMBEDDING_MODULES:
            return False
    return True


def _summarize(stored: Iterable[_Stored]) -> _Sizes:
    """Add up what bytes_for needs from the stored tensors."""
    fixed = floating = elements = rows = tensors = packed = blocks = nested = expert_elements = expert_bytes = 0
    layers: set[int | None] = set()
    count = 0
    for item in stored:
        count += 1
        if not _is_floating(item.dtype):
            fixed += item.nbytes
            continue
        floating += item.elements
        if item.expert:
            expert_elements += item.elements
            expert_bytes += item.nbytes
            layers.add(item.layer)
        for n, r in item.linear:
            elements += n
            rows += r
            tensors += 1
            packed += -(-n // 2)
            nblocks = -(-n // _NF4_BLOCK)
            blocks += nblocks
            nested += -(-nblocks // _NESTED_BLOCK)
    return _Sizes(fixed, floating, elements, rows, tensors, packed, blocks, nested, expert_elements, expert_bytes,
                  len(layers), count)


def _dtype_census(stored: Iterable[_Stored]) -> tuple[tuple[str, int], ...]:
    """Elements per stored dtype, most first."""
    census: dict[str, int] = {}
    for item in stored:
        census[item.dtype] = census.get(item.dtype, 0) + item.elements
    return tuple(sorted(census.items(), key=lambda kv: (-kv[1], kv[0])))


def _tensor(dtype: str, name: str, shape: tuple[int, ...], elements: int, nbytes: int) -> _Stored:
    """A named stored tensor, marked quantizable when it looks like a Linear weight."""
    linear = ((elements, shape[0]),) if _is_floating(dtype) and is_linear_weight(name, shape) else ()
    expert = _is_floating(dtype) and _EXPERT.search(name) is not None
    layer = _LAYER.search(name) if expert else None
    return _Stored(dtype, elements, nbytes, linear, expert, int(layer.group(1)) if layer else None)


# --------------------------------------------------------------------------- dispatch


def _read_stored(found: CheckpointFiles, declared: str | None) -> list[_Stored]:
    """Return the stored tensors of the checkpoint `found` describes."""
    if found.format == "config-only":
        return list(_config_only(found.files[0], declared))
    if found.format.startswith("safetensors"):
        return _read_safetensors_shards(found)
    assumed_bits = _DTYPE_BITS[declared] if declared in _CAST_BYTES else 32
    stored: list[_Stored] = []
    for file in found.files:
        # Shards of a pickle index are judged by content too: a legacy pickle gets its own message.
        if sniff_format(file) == "safetensors":
            stored += _read_safetensors(file)
        else:
            stored += _read_torch_zip(file, assumed_bits)
    return stored


def _declared_dtype(found: CheckpointFiles) -> str | None:
    """Return config.json's "dtype" / "torch_dtype" as a torch dtype name, when it names one."""
    if found.config is None:
        return None
    try:
        config = read_config(found.config)
    except OomMagicError:
        if found.format == "config-only":
            raise
        return None  # a bad config beside good weights does not stop sizing the weights
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            name = value.strip().removeprefix("torch.")
            if name in _DTYPE_BITS:
                return name
    return None


# --------------------------------------------------------------------------- safetensors
# Parsed here, not with safetensors.safe_open: safe_open is ~1.3x faster on 30 headers (2.2 vs 2.9 ms,
# benchmarks/bench_estimate.py), but it is an optional dependency and its errors don't name the tensor.


def _read_safetensors_shards(found: CheckpointFiles) -> list[_Stored]:
    """Every tensor of a single or sharded safetensors checkpoint, checked against its index."""
    owner: dict[str, str] = {}
    stored: list[_Stored] = []
    for file in found.files:
        label = file.name
        for name, dtype, shape, nbytes in read_safetensors_header(file):
            if name in owner:
                raise OomMagicError(
                    f"{label}: tensor {_short(name)} is also in {owner[name]}; a tensor belongs to one shard"
                )
            owner[name] = label
            stored.append(_tensor(dtype, name, shape, math.prod(shape), nbytes))
    if found.weight_map is not None and found.index is not None:
        basenames: dict[str, str] = {}
        for name, shard in found.weight_map.items():
            basename = basenames.get(shard)
            if basename is None:
                basename = basenames[shard] = shard.replace("\\", "/").rsplit("/", 1)[-1]
            if owner.get(name) != basename:
                raise OomMagicError(
                    f"{found.index.name}: names tensor {_short(name)} in {shard}, which does not hold it; "
                    "the index and the shards do not match"
                )
    return stored


def read_safetensors_header(path: Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """Read and check one safetensors header: [(name, dtype, shape, nbytes)], no tensor data read.

    Checks what the safetensors loader checks: the header fits the file and the 100 MB limit,
    is UTF-8 JSON holding an object, every dtype is known, every tensor's byte span matches its
    shape x dtype, and the spans tile the data area exactly (no gap, overlap or trailing bytes).
    """
    label = path.name
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                raise OomMagicError(
                    f"{label}: the file is {size} bytes, too short for a safetensors header; "
                    "it is truncated or not safetensors"
                )
            length = int.from_bytes(handle.read(8), "little")
            if length > size - 8:
                raise OomMagicError(
                    f"{label}: header length {length} is past the end of the {size}-byte file; "
                    "the file is truncated or not safetensors"
                )
            if length > _MAX_HEADER_BYTES:
                raise OomMagicError(
                    f"{label}: header length {length} is over safetensors' {_MAX_HEADER_BYTES}-byte limit; "
                    "not a safetensors file"
                )
            if length > _MAX_READ_HEADER_BYTES:
                raise OomMagicError(
                    f"{label}: header of {length} bytes is over the {_MAX_READ_HEADER_BYTES} bytes oom-magic reads "
                    "(about 40,000 tensors; real checkpoints' headers are far smaller)"
                )
            raw = handle.read(length)
    except OSError as exc:
        raise OomMagicError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) != length:
        raise OomMagicError(f"{label}: the file shrank while it was read; try again")
    # Every JSON value but the first follows one of these bytes: an upper bound, counted at C speed.
    values = raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{")
    if values > _MAX_HEADER_VALUES:
        raise OomMagicError(
            f"{label}: the header holds over {_MAX_HEADER_VALUES} JSON values (a tensor takes about 12); "
            "not a checkpoint oom-magic will parse"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OomMagicError(
            f"{label}: the header is not UTF-8 (byte {8 + exc.start}); the file is damaged or not safetensors"
        ) from None
    try:
        header = json.loads(text)
        if isinstance(header, dict) and _may_repeat_keys(text, header):
            header = None  # the first parse is dropped before the second one is built
            header = json.loads(text, object_pairs_hook=_unique_keys)  # slow path names the repeat
    except _DuplicateKey as exc:
        raise OomMagicError(f"{label}: the header names {_short(exc.key)} twice") from None
    except (ValueError, RecursionError) as exc:
        detail = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        raise OomMagicError(f"{label}: the header is not valid JSON ({detail}); the file is damaged") from None
    if not isinstance(header, dict):
        raise OomMagicError(
            f"{label}: the header is a JSON {_json_kind(header)}, not an object; not a safetensors file"
        )
    data_size = size - 8 - length
    tensors: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            _check_metadata(label, info)
            continue
        tensors.append(_check_entry(label, name, info, data_size))
    tensors.sort(key=lambda t: (t[0], t[1]))
    end, last = 0, None
    for begin, stop, name, _, _ in tensors:
        if begin < end:
            raise OomMagicError(
                f"{label}: tensors {_short(last or '')} and {_short(name)} overlap (bytes {begin}-{end}); "
                "the header is corrupt"
            )
        if begin > end:
            raise OomMagicError(
                f"{label}: {begin - end} bytes before tensor {_short(name)} belong to no tensor; "
                "safetensors refuses such files"
            )
        end, last = stop, name
    if end != data_size:
        raise OomMagicError(
            f"{label}: {data_size - end} bytes after the last tensor belong to no tensor; "
            "safetensors refuses such files"
        )
    return [(name, dtype, shape, stop - begin) for begin, stop, name, dtype, shape in tensors]


def _read_safetensors(path: Path) -> list[_Stored]:
    """The tensors of one safetensors file."""
    return [
        _tensor(dtype, name, shape, math.prod(shape), nbytes)
        for name, dtype, shape, nbytes in read_safetensors_header(path)
    ]


def _check_metadata(label: str, info: object) -> None:
    """__metadata__ must map strings to strings, as the safetensors loader demands."""
    if info is None:
        return
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise OomMagicError(f"{label}: __metadata__ must map strings to strings; the header is corrupt")


def _check_entry(
    label: str, name: str, info: object, data_size: int
) -> tuple[int, int, str, str, tuple[int, ...]]:
    """Check one tensor entry; return (begin, end, name, dtype, shape)."""
    if not isinstance(info, dict):
        raise OomMagicError(f"{_what(label, name)} is described by a JSON {_json_kind(info)}, not an object")
    code = info.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        what = _what(label, name)
        raise OomMagicError(
            f"{what} has unknown dtype {_short(str(code))}; known: {', '.join(_SAFETENSORS_DTYPES)}"
        )
    shape = info.get("shape")
    if type(shape) is not list:
        raise OomMagicError(f"{_what(label, name)} has shape {_short(str(shape))}; a shape is a list of non-negative integers")
    elements = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise OomMagicError(f"{_what(label, name)} has shape {_short(str(shape))}; a shape is a list of non-negative integers")
        elements *= dim
        if elements > _MAX_ELEMENTS:
            raise OomMagicError(f"{_what(label, name)} has shape {_short(str(shape))}, over 2**64 elements")
    offsets = info.get("data_offsets")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise OomMagicError(
            f"{_what(label, name)} has data_offsets {_short(str(offsets))}; they must be [begin, end] with 0 <= begin <= end"
        )
    begin, end = offsets
    bits = elements * _DTYPE_BITS[dtype]
    if bits % 8:
        raise OomMagicError(f"{_what(label, name)}: {elements} {dtype} elements do not fill whole bytes")
    if end - begin != bits // 8:
        raise OomMagicError(
            f"{_what(label, name)} is {dtype} {shape} = {bits // 8} bytes, but its data_offsets span {end - begin} bytes"
        )
    if end > data_size:
        raise OomMagicError(
            f"{_what(label, name)} ends at data byte {end}, but the file holds only {data_size} bytes of tensor data; "
            "the file is truncated"
        )
    return begin, end, name, dtype, tuple(shape)


def _what(label: str, name: str) -> str:
    """How an error names one header entry (built only when there is an error to report)."""
    return f"{label}: tensor {_short(name)}"


def _json_kind(value: object) -> str:
    """Name a parsed JSON value the way JSON does (array, string, null, ...)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _may_repeat_keys(text: str, header: dict[str, object]) -> bool:
    """Cheap test for a repeated key (json.loads keeps the last): fewer entries than field names."""
    entries = len(header) - ("__metadata__" in header)
    return any(text.count(f'"{key}"') != entries for key in ("dtype", "shape", "data_offsets"))


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json object hook that refuses a key named twice (the Rust loader does too)."""
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _short(text: str, limit: int = 80) -> str:
    """repr() of an outside string, cut to one short line."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


# --------------------------------------------------------------------------- torch.save zip


class _Global(NamedTuple):
    module: str
    name: str


class _StorageRef(NamedTuple):
    key: str


class _Call(NamedTuple):
    func: object
    args: object


class _View(NamedTuple):
    key: str
    offset: int
    shape: tuple[int, ...]


_MARK = object()
_ANYTHING = object()
_PUSHES_ARG = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8",
})
_REBUILD_TENSOR = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"})
_REBUILD_PARAMETER = frozenset({"_rebuild_parameter", "_rebuild_parameter_with_state"})


class _Malformed(Exception):
    """The opcode stream is not one torch.save writes."""


class _TooBig(Exception):
    """The opcode stream is longer, or builds more, than the walk's budget."""


def _read_torch_zip(path: Path, assumed_bits: int) -> Iterator[_Stored]:
    """Yield the storages of a torch.save zip: sizes from the zip directory, dtypes from data.pkl.

    Nothing is decompressed or unpickled: member sizes come from the central directory, and
    data.pkl is walked with pickletools.genops, reading the persistent ids torch.save writes,
    ``('storage', <torch.XStorage | torch.storage.UntypedStorage>, key, location, numel)``, and
    the dtype argument of ``_rebuild_tensor_v3`` for untyped storages (fp8, uint16, ...).
    """
    label = path.name
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            check_zip_directory(handle, label)
            try:
                archive = zipfile.ZipFile(handle)
            except zipfile.BadZipFile as exc:
                raise OomMagicError(f"{label}: not a readable zip archive ({exc}); the file is damaged") from None
            with archive:
                infos = archive.infolist()
                if len(infos) > _MAX_ZIP_MEMBERS:
                    raise OomMagicError(f"{label}: {len(infos)} zip members is not a torch checkpoint")
                pickles = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
                if len(pickles) != 1:
                    raise OomMagicError(
                        f"{label}: a zip without a top-level data.pkl; not a torch.save checkpoint"
                    )
                prefix = pickles[0].filename[: -len("data.pkl")] + "data/"
                members = {
                    i.filename[len(prefix):]: i
                    for i in infos
                    if i.filename.startswith(prefix) and "/" not in i.filename[len(prefix):]
                }
                for info in members.values():
                    if info.header_offset + info.compress_size > size:
                        raise OomMagicError(
                            f"{label}: member {_short(info.filename)} runs past the end of the file; it is truncated"
                        )
                pickle_info = pickles[0]
                if pickle_info.file_size > _MAX_PICKLE_BYTES:
                    # Too big to walk: sizes stay exact, element counts assume the declared dtype.
                    for info in members.values():
                        yield _Stored(_UNKNOWN, info.file_size * 8 // assumed_bits, info.file_size)
                    return
                if pickle_info.compress_type != zipfile.ZIP_STORED:
                    raise OomMagicError(
                        f"{label}: data.pkl is compressed, which torch.save never does; not a torch checkpoint"
                    )
                if pickle_info.flag_bits & _ZIP_ENCRYPTED:
                    raise OomMagicError(
                        f"{label}: data.pkl is marked encrypted, which torch.save never does; not a torch checkpoint"
                    )
                with archive.open(pickle_info) as member:
                    raw = member.read(_MAX_PICKLE_BYTES + 1)
    except OSError as exc:
        raise OomMagicError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    except (
        zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, OverflowError,
        struct.error, IndexError, KeyError, RuntimeError,  # zipfile: encrypted or unsupported members
    ) as exc:
        if isinstance(exc, OomMagicError):
            raise
        raise OomMagicError(f"{label}: damaged zip archive ({str(exc)[:100]})") from None
    try:
        storages, dtypes, views = _scan_pickle(raw, label)
    except _TooBig:
        # As for a data.pkl too big to walk: sizes stay exact, element counts assume the declared dtype.
        for info in members.values():
            yield _Stored(_UNKNOWN, info.file_size * 8 // assumed_bits, info.file_size)
        return
    yield from _torch_storages(label, storages, dtypes, views, members, assumed_bits)


def _torch_storages(
    label: str,
    storages: dict[str, tuple[_Global, int]],
    dtypes: dict[str, str],
    views: dict[str, dict[_View, list[str]]],
    members: dict[str, zipfile.ZipInfo],
    assumed_bits: int,
) -> Iterator[_Stored]:
    """Turn the storages data.pkl names into stored records, checked against the zip members."""
    for key, (kind, numel) in storages.items():
        info = members.get(key)
        if info is None:
            raise OomMagicError(
                f"{label}: data.pkl names storage {_short(key)} but the zip has no data/{key}; the file is incomplete"
            )
        nbytes = info.file_size
        if kind.name == "UntypedStorage":
            dtype = dtypes.get(key, "uint8")  # a bare UntypedStorage is bytes
            bits = _DTYPE_BITS.get(dtype)
            expected = numel
        else:
            dtype = _STORAGE_DTYPES.get(kind.name, _UNKNOWN)
            bits = _DTYPE_BITS.get(dtype)
            expected = None if bits is None else numel * bits // 8
        if bits is None:
            dtype, elements = _UNKNOWN, nbytes * 8 // assumed_bits
        else:
            elements = numel if kind.name != "UntypedStorage" else numel * 8 // bits
        if expected is not None and expected != nbytes:
            raise OomMagicError(
                f"{label}: data.pkl says storage {_short(key)} is {expected} bytes but data/{key} holds {nbytes}; "
                "the file is damaged"
            )
        yield _Stored(dtype, elements, nbytes, _linear_views(dtype, elements, views.get(key, {})))


def _linear_views(dtype: str, elements: int, views: dict[_View, list[str]]) -> tuple[tuple[int, int], ...]:
    """Quantizable parts of one storage: only when every tensor viewing it is a Linear weight."""
    if not views or not _is_floating(dtype):
        return ()
    parts = []
    for view, names in views.items():
        if not all(is_linear_weight(name, view.shape) for name in names):
            return ()
        parts.append((math.prod(view.shape), view.shape[0]))
    if sum(n for n, _ in parts) != elements:
        return ()
    return tuple(parts)


def _scan_pickle(
    raw: bytes, label: str
) -> tuple[dict[str, tuple[_Global, int]], dict[str, str], dict[str, dict[_View, list[str]]]]:
    """Walk data.pkl's opcodes without executing them: storages, v3 dtypes, named tensor views."""
    if len(raw) > _MAX_PICKLE_BYTES:
        raise OomMagicError(f"{label}: data.pkl is over {_MAX_PICKLE_BYTES} bytes")
    try:
        return _walk_opcodes(raw)
    except _TooBig:
        raise
    except _Malformed as exc:
        raise OomMagicError(f"{label}: data.pkl is not what torch.save writes ({exc})") from None
    # genops parses untrusted bytes; whatever it trips on means the pickle is damaged.
    except Exception as exc:  # noqa: BLE001
        detail = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        raise OomMagicError(f"{label}: data.pkl is not a valid pickle ({detail}); the file is damaged") from None


def _walk_opcodes(
    raw: bytes,
) -> tuple[dict[str, tuple[_Global, int]], dict[str, str], dict[str, dict[_View, list[str]]]]:
    """A symbolic pickle machine: tracks strings, ints, tuples, globals and calls, nothing else."""
    stack: list[object] = []
    memo: dict[int, object] = {}
    storages: dict[str, tuple[_Global, int]] = {}
    dtypes: dict[str, str] = {}
    views: dict[str, dict[_View, list[str]]] = {}

    def pop() -> object:
        if not stack:
            raise _Malformed("stack underflow")
        return stack.pop()

    def pop_to_mark() -> list[object]:
        items: list[object] = []
        while True:
            item = pop()
            if item is _MARK:
                items.reverse()
                return items
            items.append(item)

    named = 0

    def name_views(pairs: list[object]) -> None:
        nonlocal named
        for key, value in zip(pairs[0::2], pairs[1::2]):
            view = _tensor_view(value)
            if isinstance(key, str) and view is not None:
                views.setdefault(view.key, {}).setdefault(view, []).append(key)
                named += 1

    for ops, (opcode, arg, _pos) in enumerate(pickletools.genops(raw)):
        if ops & 1023 == 0 and (
            ops > _MAX_PICKLE_OPS or len(stack) + len(memo) + len(storages) + named > _MAX_PICKLE_ITEMS
        ):
            raise _TooBig
        code = opcode.name
        if code in _PUSHES_ARG:
            stack.append(arg)
        elif code == "MARK":
            stack.append(_MARK)
        elif code == "NONE":
            stack.append(None)
        elif code in ("NEWTRUE", "NEWFALSE"):
            stack.append(code == "NEWTRUE")
        elif code == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            stack.append(_Global(module, name))
        elif code == "STACK_GLOBAL":
            name, module = pop(), pop()
            stack.append(_Global(module, name) if isinstance(module, str) and isinstance(name, str) else _ANYTHING)
        elif code == "EMPTY_TUPLE":
            stack.append(())
        elif code in ("TUPLE1", "TUPLE2", "TUPLE3"):
            items = [pop() for _ in range(int(code[-1]))]
            stack.append(tuple(reversed(items)))
        elif code == "TUPLE":
            stack.append(tuple(pop_to_mark()))
        elif code in ("PUT", "BINPUT", "LONG_BINPUT"):
            if not stack:
                raise _Malformed("memo put on an empty stack")
            memo[arg] = stack[-1]
        elif code == "MEMOIZE":
            if not stack:
                raise _Malformed("memo put on an empty stack")
            memo[len(memo)] = stack[-1]
        elif code in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise _Malformed(f"memo {arg} read before it was written")
            stack.append(memo[arg])
        elif code == "BINPERSID":
            stack.append(_storage_ref(pop(), storages))
        elif code == "REDUCE":
            args, func = pop(), pop()
            call = _Call(func, args)
            _note_v3_dtype(call, dtypes)
            stack.append(call)
        elif code == "SETITEM":
            value, key = pop(), pop()
            name_views([key, value])
        elif code == "SETITEMS":
            name_views(pop_to_mark())
        elif code == "STOP":
            break
        else:
            _generic(opcode, pop, pop_to_mark, stack)
    return storages, dtypes, views


def _generic(
    opcode: pickletools.OpcodeInfo,
    pop: Callable[[], object],
    pop_to_mark: Callable[[], list[object]],
    stack: list[object],
) -> None:
    """Apply an opcode's stack effect as pickletools documents it, pushing placeholders."""
    before = opcode.stack_before
    if pickletools.markobject in before:
        below = before.index(pickletools.markobject)
        pop_to_mark()
        for _ in range(below):
            pop()
    else:
        for _ in before:
            pop()
    stack.extend(_ANYTHING for _ in opcode.stack_after)


def _storage_ref(pid: object, storages: dict[str, tuple[_Global, int]]) -> _StorageRef:
    """Record a torch.save persistent id ('storage', type, key, location, numel)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise _Malformed("a persistent id that is not a storage")
    _, kind, key, _location, numel = pid
    if not isinstance(kind, _Global) or not isinstance(key, str) or type(numel) is not int or numel < 0:
        raise _Malformed(f"a storage record {_short(str(pid))}")
    storages.setdefault(key, (kind, numel))
    return _StorageRef(key)


def _note_v3_dtype(call: _Call, dtypes: dict[str, str]) -> None:
    """_rebuild_tensor_v3(storage, offset, size, stride, grad, hooks, dtype, ...) gives an untyped storage's dtype."""
    func, args = call.func, call.args
    if not (isinstance(func, _Global) and func.name == "_rebuild_tensor_v3" and isinstance(args, tuple)):
        return
    if len(args) >= 7 and isinstance(args[0], _StorageRef) and isinstance(args[6], _Global):
        if args[6].module == "torch":
            dtypes.setdefault(args[0].key, args[6].name)


def _tensor_view(value: object, depth: int = 0) -> _View | None:
    """The (storage, offset, shape) a rebuilt tensor or parameter views, else None."""
    if not isinstance(value, _Call) or not isinstance(value.func, _Global) or depth > 3:
        return None
    func, args = value.func, value.args
    if not isinstance(args, tuple) or not args or func.module != "torch._utils":
        return None
    if func.name in _REBUILD_PARAMETER:
        return _tensor_view(args[0], depth + 1)
    if func.name in _REBUILD_TENSOR and len(args) >= 3:
        ref, offset, shape = args[0], args[1], args[2]
        if (
            isinstance(ref, _StorageRef)
            and type(offset) is int
            and isinstance(shape, tuple)
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            return _View(ref.key, offset, shape)
    return None


# --------------------------------------------------------------------------- config only


def _config_only(config: Path, declared: str | None) -> Iterator[_Stored]:
    """Size the model a config.json describes by building it on the meta device (no memory used).

    The build runs in a child process bounded in time and memory (``config_size``), so this
    process imports neither torch nor transformers; each unique parameter and persistent buffer
    counts once (tied weights once), at the declared dtype (float32 when none).
    """
    from .config_size import size_from_config

    for name, dtype_name, shape, elements, nbytes in size_from_config(
            config, declared if declared in _CAST_BYTES else None):
        yield _tensor(dtype_name, name, shape, elements, nbytes)
