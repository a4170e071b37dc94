"""Dtype names: how many bits an element takes, and the spellings users write for a dtype.

One table for the whole package (checkpoint readers, estimator, fit check, diagnosis, load-call
parsing). Names are torch's (``torch.bfloat16`` → ``"bfloat16"``); quantized load modes are the
bitsandbytes names ``"int8"``, ``"nf4"`` and ``"fp4"``.
"""
from __future__ import annotations

__all__ = [
    "DTYPE_BITS", "SAFETENSORS_DTYPES", "STORAGE_DTYPES", "FLOAT_BYTES", "LOAD_DTYPES", "QUANTIZED",
    "canonical_dtype", "is_floating",
]

# Bits per element of every dtype a checkpoint may hold (torch names).
DTYPE_BITS: dict[str, int] = {
    "float64": 64, "float32": 32, "float16": 16, "bfloat16": 16,
    "float8_e4m3fn": 8, "float8_e5m2": 8, "float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8,
    "float8_e8m0fnu": 8, "float4_e2m1fn_x2": 8,
    "float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4,
    "int64": 64, "int32": 32, "int16": 16, "int8": 8,
    "uint64": 64, "uint32": 32, "uint16": 16, "uint8": 8, "bool": 8,
    "complex128": 128, "complex64": 64, "complex32": 32,
    "qint8": 8, "quint8": 8, "qint32": 32, "quint4x2": 8, "quint2x4": 8,
}
# The safetensors header's dtype names.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn", "F4": "float4_e2m1fn",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
}
# Legacy typed-storage classes torch.save names in data.pkl (torch.storage._dtype_to_storage_type_map).
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QInt32Storage": "qint32", "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}
# The floating dtypes a load can cast weights to, with their bytes per element.
FLOAT_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
LOAD_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZED = ("int8", "nf4", "fp4")

# Every spelling users write (torch attribute names, short forms, transformers' load flags).
_ALIASES: dict[str, str] = {
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "8bit": "int8", "llm.int8": "int8", "llm_int8": "int8", "load_in_8bit": "int8",
    "4bit": "nf4", "int4": "nf4", "load_in_4bit": "nf4",
}


def canonical_dtype(text: object) -> str:
    """``torch.bfloat16``, ``"bf16"``, ``"BF16 "`` → ``"bfloat16"``; an unknown name comes back lower-cased."""
    name = str(text).strip().lower().removeprefix("torch.")
    return _ALIASES.get(name, name)


def is_floating(name: str) -> bool:
    """Whether a dtype holds floating-point weights (what a load's ``torch_dtype`` casts)."""
    return name.startswith(("float", "bfloat"))
