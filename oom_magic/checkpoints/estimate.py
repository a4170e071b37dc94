"""Size a checkpoint before loading it: parameters and bytes per dtype, from file headers only.

``estimate_checkpoint("meta-llama/Llama-2-7b-hf", dtype="bfloat16")`` reads safetensors headers
(or a torch.save zip's directory and pickle opcodes, never executing them) and answers in
milliseconds, without reading tensor data or importing torch; only a hub id not in the local cache
goes online, for its config and headers (hub.py). A folder with only
a config.json is sized by building the model on the meta device through transformers, in a
child process bounded in time and memory (config_size.py).

The tutorial's rule of thumb for a 7B model (28 / 14 / 7 / ~3.5 GiB in fp32 / fp16 / int8 /
int4) is the naive bound ``parameters x bytes per element``. What bitsandbytes really allocates
when transformers loads Llama-2-7B (6,738,415,616 parameters) that way is 25.10 / 12.55 / 6.53 /
3.88 GiB (3.60 GiB with double quantization): 8-bit and 4-bit quantize only the Linear layers'
weights, keep embeddings, ``lm_head`` and norms in 16-bit, and add per-row / per-block scales.
"""
from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .files import (CheckpointFiles, find_checkpoint_files, read_config, resolve_checkpoint, sniff_format,
                    uncached_hub_id)
from ..common.dtypes import DTYPE_BITS, FLOAT_BYTES, QUANTIZED, canonical_dtype, is_floating
from ..common.errors import OomMagicError, one_line
from .safetensors_header import read_safetensors_header, read_safetensors_shards
from .torch_zip import FIX, TensorView, open_torch_zip, optimizer_storage_keys, storages
from ..records.hub import HubRead

if TYPE_CHECKING:
    from .hf_rules import HeldBytes

__all__ = ["CheckpointEstimate", "estimate_checkpoint", "resolve_checkpoint"]

_UNKNOWN = "unknown"  # a torch storage whose dtype the pickle does not say (counted as floating)

# bitsandbytes figures (functional.quantize_4bit / Int8Params), see bytes_for.
_NF4_BLOCK = 64  # BitsAndBytesConfig's default blocksize for 4-bit weights
_NESTED_BLOCK = 256  # quantize_4bit(compress_statistics=True) -> quantize_blockwise(absmax, blocksize=256)

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
    optimizer: bool = False  # reached only from a training checkpoint's optimizer/scheduler keys


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
    parameters: int  # the model's elements; tied weights are stored, and counted, once; optimizer state left out
    stored_bytes: int  # tensor data as stored (for 'config-only': at the declared dtype)
    dtype: str | None  # the dtype asked for ('bfloat16', 'nf4', ...); None = as stored
    bytes: int  # bytes_for(dtype), or stored_bytes when dtype is None
    stored_dtypes: tuple[tuple[str, int], ...]  # (dtype name, elements), most elements first
    declared_dtype: str | None  # config.json's "dtype"/"torch_dtype" beside the weights
    _sizes: _Sizes = field(repr=False, compare=False)
    # The folder whose config.json transformers' rules are asked about (quantized / float16
    # loads, see hf_rules); None: header arithmetic only.
    _rules_dir: str | None = field(default=None, repr=False, compare=False)
    # What was read over the network for a hub id not in the cache; None for local checkpoints.
    hub: HubRead | None = field(default=None, repr=False, compare=False)
    # A training checkpoint's optimizer, scheduler and scaler state (torch.save zips): counted in
    # stored_bytes (torch.load reads it all), never in parameters.
    optimizer_elements: int = 0
    optimizer_bytes: int = 0

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
        quantized or float16, torch or transformers is missing, or the model cannot be built on
        the meta device.
        """
        canonical = _canonical_request(dtype)
        if self._rules_dir is None or (canonical not in QUANTIZED and canonical != "float16"):
            return None
        from .hf_rules import MAX_TENSORS, held_bytes

        if self._sizes.stored_tensors > MAX_TENSORS:
            return None  # a model this size is not built on meta before the load: header arithmetic answers

        rest = _canonical_request(unquantized_dtype)
        return held_bytes(self._rules_dir, canonical, unquantized_dtype=rest, double_quant=double_quant,
                          skip_modules=skip_modules)

    def prepare_rules(self, loads: tuple[tuple[str, bool], ...], *, unquantized_dtype: str = "bfloat16") -> None:
        """Size these loads ((dtype, double_quant) each) by transformers' rules in one pass (see hf_rules.prepare).

        bytes_for then answers each of them without starting a child process of its own.
        """
        from .hf_rules import MAX_TENSORS, prepare

        asked = tuple((c, dq) for c, dq in ((_canonical_request(d), dq) for d, dq in loads)
                      if c in QUANTIZED or c == "float16")
        if self._rules_dir is None or not asked or self._sizes.stored_tensors > MAX_TENSORS:
            return
        prepare(self._rules_dir, asked, unquantized_dtype=_canonical_request(unquantized_dtype))

    def __repr__(self) -> str:
        return (
            f"CheckpointEstimate(path={self.path!r}, format={self.format!r}, files={len(self.files)},"
            f" parameters={self.parameters}, stored_bytes={self.stored_bytes},"
            f" dtype={self.dtype!r}, bytes={self.bytes})"
        )


def estimate_checkpoint(
    path_or_id: str | os.PathLike[str], dtype: str | None = None, *, follow_transformers: bool | None = None,
    revision: str | None = None,
) -> CheckpointEstimate:
    """Size a checkpoint (file, folder, or hub id) from its headers; `dtype` picks `bytes`.

    A hub id not in the local cache is read over the network at `revision` (default main):
    config.json and the safetensors headers only, never weights, bounded in time (hub.py, whose
    ``hub_options`` sets the timeout and token); ``hub`` then says what was read.

    `follow_transformers`: size quantized and float16 loads by transformers' own rules (fused MoE
    experts stay 16-bit under bitsandbytes, ``_keep_in_fp32_modules`` stay float32; see hf_rules)
    on a meta model built when such a figure is asked for: in this process when torch and
    transformers are imported already, else in a bounded child process (this process never
    imports them on its own). None (default): only when both are already imported.

    `dtype` is None (as stored), 'auto' (config.json's dtype, else as stored), a float dtype
    ('bfloat16', 'fp16', 'torch.float32', ...) or a bitsandbytes load ('int8', 'nf4'); see
    CheckpointEstimate.bytes_for. Raises OomMagicError, one line naming the file, for anything
    that is missing, malformed or not a checkpoint.
    """
    if follow_transformers is None:
        follow_transformers = "torch" in sys.modules and "transformers" in sys.modules
    try:
        return _estimate(path_or_id, dtype, follow_transformers, revision)
    except OomMagicError as exc:
        message = str(exc)
        if one_line(message, limit=1000) != message:  # a file name with a newline in it, say
            raise OomMagicError(one_line(message, limit=1000)) from None
        raise


def _estimate(path_or_id: str | os.PathLike[str], dtype: str | None, follow_transformers: bool,
              revision: str | None) -> CheckpointEstimate:
    remote_id = uncached_hub_id(path_or_id)
    hub: HubRead | None = None
    rules_dir: str | None = None
    if remote_id is not None:
        from .hub import read_hub_checkpoint

        remote = read_hub_checkpoint(remote_id, revision=revision)
        hub, fmt, path, files = remote.read, remote.format, remote_id, remote.files
        declared = _declared_in(remote.config)
        stored = [_tensor(dtype_name, name, shape, math.prod(shape), nbytes)
                  for name, dtype_name, shape, nbytes in remote.tensors]
    else:
        found = find_checkpoint_files(resolve_checkpoint(path_or_id))
        rules_dir = str(found.config.parent) if follow_transformers and found.config is not None else None
        declared = _declared_dtype(found)
        fmt, path, files = found.format, str(found.path), tuple(str(p) for p in found.files)
        stored = _read_stored(found, declared)
    request = None if dtype is None else str(dtype)
    if request is not None and request.strip().lower() == "auto":
        request = declared if declared in FLOAT_BYTES else None
    canonical = None if request is None else _canonical_request(request)
    sizes = _summarize(stored)
    stored_bytes = sum(item.nbytes for item in stored)
    estimate = CheckpointEstimate(
        path=path,
        format=fmt,
        files=files,
        parameters=sum(item.elements for item in stored if not item.optimizer),
        stored_bytes=stored_bytes,
        dtype=canonical,
        bytes=stored_bytes,
        stored_dtypes=_dtype_census(stored),
        declared_dtype=declared,
        _sizes=sizes,
        _rules_dir=rules_dir,
        hub=hub,
        optimizer_elements=sum(item.elements for item in stored if item.optimizer),
        optimizer_bytes=sum(item.nbytes for item in stored if item.optimizer),
    )
    return estimate if canonical is None else replace(estimate, bytes=estimate.bytes_for(canonical))


# --------------------------------------------------------------------------- dtype arithmetic


def _canonical_request(dtype: object) -> str:
    """Normalise a requested load dtype ('bf16', 'torch.bfloat16', '4bit') to its canonical name."""
    name = canonical_dtype(dtype)
    if name in FLOAT_BYTES or name in QUANTIZED:
        return name
    raise OomMagicError(
        f"unknown dtype {str(dtype)!r}: use float32, float16, bfloat16, int8 or nf4 (or fp32, fp16, bf16, 8bit, 4bit)"
    )


def _bytes_for(sizes: _Sizes, dtype: str, double_quant: bool, unquantized_dtype: str) -> int:
    """Bytes of the weights loaded as canonical `dtype`; see CheckpointEstimate.bytes_for."""
    if dtype in FLOAT_BYTES:
        return sizes.fixed_bytes + sizes.float_elements * FLOAT_BYTES[dtype]
    rest = _canonical_request(unquantized_dtype)
    if rest not in FLOAT_BYTES:
        raise OomMagicError(f"unquantized_dtype must be a float dtype, not {unquantized_dtype!r}")
    other = (sizes.float_elements - sizes.linear_elements) * FLOAT_BYTES[rest]
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
    known = _FLOATING.get(dtype)
    if known is None:  # a checkpoint's hundreds of tensors share a dtype or two: decided once each
        known = _FLOATING[dtype] = dtype == _UNKNOWN or is_floating(dtype)
    return known


_FLOATING: dict[str, bool] = {}


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Guess from a tensor's name and shape whether bitsandbytes would quantize it (see bytes_for):
    a 2-d ``.weight`` of no head, embedding or norm module, in one search of the lower-cased name."""
    return len(shape) == 2 and name.endswith(".weight") and _NOT_QUANTIZED.search(name.lower()) is None


# Where the name (lower-cased, ending ".weight") says a module stays as it is: "embed" or "norm" in a
# module's name, a module named "ln..." or an embedding's name, or a head as the last module.
_NOT_QUANTIZED = re.compile(
    r"embed|norm|(?:^|\.)(?:ln|(?:" + "|".join(sorted(_EMBEDDING_MODULES)) + r")\.|(?:"
    + "|".join(sorted(_HEAD_MODULES)) + r")\.weight$)"
)


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
    floating = _is_floating(dtype)
    linear = ((elements, shape[0]),) if floating and is_linear_weight(name, shape) else ()
    expert = floating and "experts." in name and _EXPERT.search(name) is not None
    layer = _LAYER.search(name) if expert else None
    # tuple.__new__: a 70B checkpoint's 723 tensors skip the namedtuple's Python-level __new__
    return tuple.__new__(_Stored, (dtype, elements, nbytes, linear, expert, int(layer.group(1)) if layer else None, False))


# --------------------------------------------------------------------------- dispatch


def _read_stored(found: CheckpointFiles, declared: str | None) -> list[_Stored]:
    """Return the stored tensors of the checkpoint `found` describes."""
    if found.format == "config-only":
        return list(_config_only(found.files[0], declared))
    if found.format.startswith("safetensors"):
        return [_tensor(dtype, name, shape, math.prod(shape), nbytes)
                for name, dtype, shape, nbytes in read_safetensors_shards(found.files, found.weight_map, found.index)]
    assumed_bits = DTYPE_BITS[declared] if declared in FLOAT_BYTES else 32
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
    return _declared_in(config)


def _declared_in(config: dict[str, object] | None) -> str | None:
    """A config's "dtype" / "torch_dtype" as a torch dtype name, when it names one."""
    if config is None:
        return None
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            name = value.strip().removeprefix("torch.")
            if name in DTYPE_BITS:
                return name
    return None


def _read_safetensors(path: Path) -> list[_Stored]:
    """The tensors of one safetensors file."""
    return [_tensor(dtype, name, shape, math.prod(shape), nbytes)
            for name, dtype, shape, nbytes in read_safetensors_header(path)]


def _read_torch_zip(path: Path, assumed_bits: int) -> list[_Stored]:
    """The storages of a torch.save zip (torch_zip), with what bitsandbytes would quantize in each.

    A storage whose dtype data.pkl does not say (or a data.pkl past torch_zip's limits) keeps its
    exact bytes; its elements assume the declared dtype (`assumed_bits`).
    """
    found = open_torch_zip(path)
    if found is None:
        raise OomMagicError(f"{one_line(path.name)}: a zip without a top-level data.pkl; not a torch.save checkpoint: "
                            f"{FIX}")
    stored = []
    optimizer = optimizer_storage_keys(found)
    for item in storages(found):
        if item.dtype is None or item.elements is None:
            stored.append(_Stored(_UNKNOWN, item.nbytes * 8 // assumed_bits, item.nbytes,
                                  optimizer=item.key in optimizer))
        else:
            stored.append(_Stored(item.dtype, item.elements, item.nbytes,
                                  _linear_views(item.dtype, item.elements, item.views), optimizer=item.key in optimizer))
    return stored


def _linear_views(dtype: str, elements: int, views: tuple[TensorView, ...]) -> tuple[tuple[int, int], ...]:
    """Quantizable parts of one storage: only when every tensor viewing it is a Linear weight."""
    if not views or not _is_floating(dtype):
        return ()
    parts = []
    for view in views:
        if not all(is_linear_weight(name, view.shape) for name in view.names):
            return ()
        parts.append((math.prod(view.shape), view.shape[0]))
    if sum(n for n, _ in parts) != elements:
        return ()
    return tuple(parts)


# --------------------------------------------------------------------------- config only


def _config_only(config: Path, declared: str | None) -> Iterator[_Stored]:
    """Size the model a config.json describes by building it on the meta device (no memory used).

    The build runs in a child process bounded in time and memory (``config_size``), so this
    process imports neither torch nor transformers; each unique parameter and persistent buffer
    counts once (tied weights once), at the declared dtype (float32 when none).
    """
    from .config_size import size_from_config

    for name, dtype_name, shape, elements, nbytes in size_from_config(
            config, declared if declared in FLOAT_BYTES else None):
        yield _tensor(dtype_name, name, shape, elements, nbytes)
