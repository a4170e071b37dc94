"""Read PyTorch's out-of-memory error messages (CUDA, HIP, XPU, MPS, CPU) into a record of bytes.

Pure text in, record out: no torch, no IPython. The wording parsed here is PyTorch's own, from
c10/cuda/CUDACachingAllocator.cpp (1.x "(GPU 0; ... reserved in total by PyTorch)" and 2.1+
"GPU 0 has a total capacity of ..."), the XPU and MPS allocators and c10/core/impl/alloc_cpu.cpp.
"""
from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from ..records.oom import Backend, OOMMessage

__all__ = ["OOMMessage", "is_out_of_memory", "parse_oom_message"]

_MAX_BYTES = 1 << 60  # 1 EiB: a larger figure is a misread, not a device
_SCAN_CHARS = 1 << 20  # a pasted log is read from its last MiB: the OOM sits near the end
_WINDOW_CHARS = 64 << 10  # one message, with hundreds of "Process P has ..." lines, fits
_UNITS = {
    "bytes": 1, "B": 1,
    "KiB": 1 << 10, "KB": 1 << 10, "MiB": 1 << 20, "MB": 1 << 20,
    "GiB": 1 << 30, "GB": 1 << 30, "TiB": 1 << 40, "TB": 1 << 40,
}
# PyTorch prints sizes with format_size: "0 bytes", "432.00 MiB", "2.00 GiB" (MPS: "KB/MB/GB",
# still powers of 1024). Two groups per size: number, unit.
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B|B)\b"


def _rx(pattern: str) -> re.Pattern[str]:
    # ASCII: \d must not accept other scripts' digits. Every pattern is used with .match at
    # a known position, or starts with a literal, so none can backtrack over the whole text.
    return re.compile(pattern, re.ASCII)


_ANSI = _rx(r"\x1b\[[0-9;]*[A-Za-z]")
_MARKER = _rx(
    r"(?P<gpu>(?:CUDA|HIP|XPU) out of memory\.)"
    r"|(?P<mps>MPS backend out of memory)"
    r"|(?P<cpu>(?:\[enforce fail at alloc_cpu\.cpp:\d+\] [^\[\]]{0,40}?\. )?"
    r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory))"
    r"|(?P<driver>(?P<driver_backend>CUDA|HIP) error: out of memory)"
    r"|(?P<blas>(?:(?:CUDA|HIP) error: )?(?P<blas_backend>CU|HIP)BLAS_STATUS_ALLOC_FAILED"
    r"(?: when calling `[^`]{0,100}`)?)"
)
_MARKER_WORDS = ("out of memory", "DefaultCPUAllocator", "BLAS_STATUS_ALLOC_FAILED")
_GPU_BACKENDS: dict[str, Backend] = {"CUDA": "cuda", "HIP": "hip", "XPU": "xpu"}
_GPU_HEAD = _rx(rf"(CUDA|HIP|XPU) out of memory\.(?: Tried to allocate {_SIZE})?")
# PyTorch 1.x-2.0 and today's XPU allocator: "(GPU 0; <size> <label>; ...)". Fields are read one
# by one, so a message that leaves one out (XPU has no "free") still gives every field it has.
_GPU_V1 = _rx(r" ?\(GPU (\d+); ([^()]{1,400})\)")
_V1_FIELD = _rx(rf"{_SIZE} (total capacity|already allocated|free|allowed|reserved in total by PyTorch|cached)$")
_GPU_V2 = _rx(rf"\.? ?GPU (\d+) has a total capac(?:i)?ty of {_SIZE} of which {_SIZE} is free\.")
_PROCESS = _rx(rf" ?Process (\d+) has {_SIZE} memory in use\.")
_THIS_PROCESS = _rx(rf" ?Including non-PyTorch memory, this process has {_SIZE} memory in use\.")
_ALLOWED = _rx(rf" ?{_SIZE} allowed;")
_SPLIT = _rx(
    rf" ?Of the allocated memory {_SIZE} is allocated by PyTorch, "
    rf"(?:with {_SIZE} allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    rf"and {_SIZE} is reserved by PyTorch but unallocated\."
)
_MPS_FIGURES = _rx(
    rf"MPS backend out of memory \(MPS allocated: {_SIZE}, other allocations: {_SIZE}, "
    rf"max allowed: {_SIZE}\)\."
)
_MPS_REQUEST = _rx(rf" ?Tried to allocate {_SIZE} on (private|shared) pool\.")
_CPU_REQUEST = _rx(r": you tried to allocate (\d+) bytes\.")
_ADVICE = _rx(
    r" ?(?:If reserved (?:but unallocated )?memory is [^.]{0,200}fragmentation\."
    r"(?: See documentation for Memory Management "
    r"(?:and PYTORCH_[A-Z]{1,8}_ALLOC_CONF|\(https?://[^\s()]{1,200}\)))?"
    r"|Please use `empty_cache` to release all unoccupied cached memory\."
    r"|Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0\.0 to disable upper limit for memory "
    r"allocations \(may cause system failure\)\."
    r"|Error code \d{1,6} \([^()]{0,80}\))"
)



def parse_oom_message(text: str) -> OOMMessage | None:
    """Find the out-of-memory error in `text` (a message or a whole traceback) and read its figures.

    Returns None when `text` holds no PyTorch out-of-memory error, or is not a str. Never raises.
    """
    if not isinstance(text, str):
        return None
    try:
        return _parse(text)
    except Exception:  # a parser of pasted text must never be the thing that fails
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    """Say whether `exc` is an out-of-memory error, without importing torch."""
    try:
        # type(exc), never isinstance(): isinstance reads a hostile __class__ when the type test fails.
        cls = type(exc)
        if not issubclass(cls, BaseException):
            return False
        if any(klass.__name__ == "OutOfMemoryError" for klass in cls.__mro__):
            return True  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class)
        if issubclass(cls, MemoryError):
            return True  # Python raises MemoryError only when an allocation failed
        return issubclass(cls, RuntimeError) and parse_oom_message(str(exc)) is not None
    except Exception:  # a hostile __str__ or __mro__
        return False


def _parse(text: str) -> OOMMessage | None:
    scanned = " ".join(_ANSI.sub("", text[-_SCAN_CHARS:]).split())
    if not any(word in scanned for word in _MARKER_WORDS):
        return None  # the common case, at str.find speed rather than the marker regex's
    marker = None
    for marker in _MARKER.finditer(scanned):
        pass  # keep the last: in a log or a chained traceback, the latest error counts
    if marker is None:
        return None
    window = scanned[marker.start() : marker.start() + _WINDOW_CHARS]
    if marker.group("gpu"):
        return _parse_gpu(window)
    if marker.group("mps"):
        return _parse_mps(window)
    if marker.group("cpu"):
        return _parse_cpu(window, marker.end() - marker.start())
    backend = marker.group("driver_backend") or marker.group("blas_backend")
    return _record("hip" if backend == "HIP" else "cuda", window[: marker.end() - marker.start()])


def _parse_gpu(window: str) -> OOMMessage:
    head = _GPU_HEAD.match(window)
    assert head is not None  # the marker matched here
    found: dict[str, object] = {"requested": _size(head, 2)}
    pos = head.end()
    if (v1 := _GPU_V1.match(window, pos)) and (fields := _v1_fields(v1.group(2))):
        # 1.x and XPU: every field present is read; "cached" (early 1.x) is the unallocated cache.
        allocated = fields.get("already allocated")
        found.update(device_index=_count(v1.group(1)), total=fields.get("total capacity"),
                     allocated=allocated, free=fields.get("free"), allowed=fields.get("allowed"))
        if "cached" in fields:
            cache = fields["cached"]
            found.update(reserved_unallocated=cache, reserved_total=_sum(allocated, cache))
        elif "reserved in total by PyTorch" in fields:
            reserved = fields["reserved in total by PyTorch"]
            found.update(reserved_total=reserved, reserved_unallocated=_diff(reserved, allocated))
        pos = v1.end()
    elif v2 := _GPU_V2.match(window, pos):
        found.update(device_index=_count(v2.group(1)), total=_size(v2, 2), free=_size(v2, 4))
        pos = v2.end()
        processes = []
        while True:  # NVML's process list, then the fraction limit, in PyTorch's order
            if m := _PROCESS.match(window, pos):
                pid, used = _count(m.group(1)), _size(m, 2)
                if pid is not None and used is not None:
                    processes.append((pid, used))
            elif m := _THIS_PROCESS.match(window, pos):
                found["this_process"] = _size(m, 1)
            elif m := _ALLOWED.match(window, pos):  # the per-process fraction's limit
                found["allowed"] = _size(m, 1)
            else:
                break
            pos = m.end()
        found["processes"] = tuple(processes)
        if split := _SPLIT.match(window, pos):
            allocated, cache = _size(split, 1), _size(split, 5)
            found.update(allocated=allocated, reserved_unallocated=cache,
                         reserved_total=_sum(allocated, cache))
            pos = split.end()
    return _record(_GPU_BACKENDS[head.group(1)], window[: _advice_end(window, pos)], **found)


def _v1_fields(body: str) -> dict[str, int | None] | None:
    """The "<size> <label>" fields of a 1.x/XPU parenthesis by label; None when one is not a field."""
    fields: dict[str, int | None] = {}
    for part in body.split("; "):
        m = _V1_FIELD.match(part.strip())
        if m is None:
            return None
        fields[m.group(3)] = _size(m, 1)
    return fields


def _parse_mps(window: str) -> OOMMessage:
    found: dict[str, object] = {}
    pos = len("MPS backend out of memory")
    if m := _MPS_FIGURES.match(window):
        found.update(allocated=_size(m, 1), other_allocations=_size(m, 3), total=_size(m, 5))
        pos = m.end()
        if r := _MPS_REQUEST.match(window, pos):
            found.update(requested=_size(r, 1), pool=r.group(3))
            pos = r.end()
    return _record("mps", window[: _advice_end(window, pos)], **found)


def _parse_cpu(window: str, marker_len: int) -> OOMMessage:
    found: dict[str, object] = {}
    pos = marker_len
    if m := _CPU_REQUEST.match(window, pos):
        found["requested"] = _bytes(m.group(1), "bytes")
        pos = m.end()
    return _record("cpu", window[: _advice_end(window, pos)], **found)


def _record(backend: Backend, text: str, **found: object) -> OOMMessage:
    fields: dict[str, Any] = dict.fromkeys(
        ("device_index", "requested", "total", "free", "allocated", "reserved_unallocated",
         "reserved_total", "this_process", "other_allocations", "pool")
    )
    fields["processes"] = ()
    fields.update(found)
    return OOMMessage(backend=backend, text=text, **fields)


def _advice_end(window: str, pos: int) -> int:
    advice = _ADVICE.match(window, pos)
    return advice.end() if advice else pos


def _size(match: re.Match[str], group: int) -> int | None:
    """Bytes of the size whose number is `group` and unit `group + 1`, or None if unreadable."""
    number = match.group(group)
    return None if number is None else _bytes(number, match.group(group + 1))


def _bytes(number: str, unit: str) -> int | None:
    if len(number) > 40:  # far past 1 EiB; spare Decimal a hostile million-digit figure
        return None
    value = int((Decimal(number) * _UNITS[unit]).to_integral_value(ROUND_HALF_EVEN))
    return value if value <= _MAX_BYTES else None


def _count(digits: str) -> int | None:
    """A device index or pid; None when too long to be one."""
    return int(digits) if len(digits) <= 10 else None


def _sum(a: int | None, b: int | None) -> int | None:
    if a is None or b is None or a + b > _MAX_BYTES:
        return None
    return a + b


def _diff(total: int | None, part: int | None) -> int | None:
    # Rounded prints can put allocated a hair above reserved; unknown beats a negative size.
    if total is None or part is None or part > total:
        return None
    return total - part
