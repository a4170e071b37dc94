"""Reading PyTorch out-of-memory messages into int bytes: every format PyTorch has printed.

Messages marked "real" were printed by PyTorch on users' machines (quoted from public bug
reports and logs). Messages marked "from source" were assembled from the string literals of
PyTorch's allocators (c10/cuda/CUDACachingAllocator.cpp, the XPU allocator, alloc_cpu.cpp) for
cases no public log showed (allowed limit, private pools, several processes).
"""
from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oom_magic.guard import oom
from oom_magic.guard.oom import OOMMessage, is_out_of_memory, parse_oom_message

EIB = 1 << 60


def kib(text: str) -> int:
    return round(Fraction(text) * 2**10)


def mib(text: str) -> int:
    return round(Fraction(text) * 2**20)


def gib(text: str) -> int:
    return round(Fraction(text) * 2**30)


# --- real messages -------------------------------------------------------------------------------

# Recent PyTorch (real): this process's own line, no other process.
CUDA_CURRENT = (
    "CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of 23.68 GiB of "
    "which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory in "
    "use. Of the allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# PyTorch 2.1 (real): "capacty", another process's line, and the old max_split_size_mb advice.
CUDA_21_CAPACTY = (
    "CUDA out of memory. Tried to allocate 5.96 GiB. GPU 0 has a total capacty of 23.69 GiB of "
    "which 5.25 GiB is free. Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch "
    "memory, this process has 18.17 GiB memory in use. Of the allocated memory 17.88 GiB is "
    "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
    "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# PyTorch 1.x-2.0 (real).
CUDA_1X_RESERVED = (
    "CUDA out of memory. Tried to allocate 1.09 GiB (GPU 0; 15.77 GiB total capacity; 14.28 GiB "
    "already allocated; 217.12 MiB free; 14.30 GiB reserved in total by PyTorch) If reserved "
    "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See "
    "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# PyTorch 1.0-1.4 (real): "cached" is the cache, reserved but not allocated (the source prints
# cached_size - allocated_size, and here it is below "already allocated").
CUDA_1X_CACHED = (
    "CUDA out of memory. Tried to allocate 2.56 GiB (GPU 0; 15.90 GiB total capacity; 10.38 GiB "
    "already allocated; 1.83 GiB free; 2.99 GiB cached)"
)
# ROCm (real, recent PyTorch).
HIP_CURRENT = (
    "HIP out of memory. Tried to allocate 978.00 MiB. GPU 0 has a total capacity of 15.98 GiB of "
    "which 630.00 MiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and "
    "0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# Apple (real): units printed KB/MB/GB in older builds, KiB/MiB/GiB in newer; all powers of 1024.
MPS_PRIVATE_GB = (
    "MPS backend out of memory (MPS allocated: 42.33 GB, other allocations: 3.00 GB, max allowed: "
    "45.90 GB). Tried to allocate 3.00 GB on private pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
    "cause system failure)."
)
MPS_SHARED_KIB = (
    "MPS backend out of memory (MPS allocated: 1024.00 MiB, other allocations: 384.00 KiB, max "
    "allowed: 511.18 MiB). Tried to allocate 256.00 MiB on shared pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause "
    "system failure)."
)
# CPU (real: what torch 2.13 prints on this machine for torch.empty(1 << 50, dtype=torch.uint8)).
CPU_CANT_ALLOCATE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
# CPU, older torch (from source: alloc_cpu.cpp's CAFFE_ENFORCE(data, "DefaultCPUAllocator: not
# enough memory: you tried to allocate ", nbytes, " bytes.")).
CPU_NOT_ENOUGH = (
    "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried "
    "to allocate 1099511627776 bytes."
)


# --- each format, exact bytes --------------------------------------------------------------------


def test_current_cuda_message_gives_every_figure() -> None:
    got = parse_oom_message(CUDA_CURRENT)

    assert got == OOMMessage(
        backend="cuda", device_index=0, requested=gib("19.68"), total=gib("23.68"),
        free=gib("11.88"), allocated=gib("11.44"), reserved_unallocated=mib("43.59"),
        reserved_total=gib("11.44") + mib("43.59"), this_process=gib("11.79"), processes=(),
        other_allocations=None, pool=None, text=" ".join(CUDA_CURRENT.split()),
    )
    assert got.requested == 21131239096  # 19.68 GiB, rounded to the byte


def test_pytorch_21_capacty_typo_and_another_process() -> None:
    got = parse_oom_message(CUDA_21_CAPACTY)

    assert got is not None
    assert (got.backend, got.device_index) == ("cuda", 0)
    assert got.requested == gib("5.96")
    assert got.total == gib("23.69")
    assert got.free == gib("5.25")
    assert got.processes == ((2006998, 268435456),)  # 256.00 MiB
    assert got.this_process == gib("18.17")
    assert got.allocated == gib("17.88")
    assert got.reserved_unallocated == 0  # "0 bytes": known to be zero, not unknown
    assert got.reserved_total == gib("17.88")


def test_several_process_lines_in_nvml_order() -> None:
    # from source: reportProcessMemoryInfo prints NVML's list in order, this process among them
    text = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.19 GiB "
        "of which 1.06 GiB is free. Process 1234 has 10.00 GiB memory in use. Including "
        "non-PyTorch memory, this process has 60.00 GiB memory in use. Process 5678 has 8.50 GiB "
        "memory in use. Of the allocated memory 55.00 GiB is allocated by PyTorch, and 3.25 GiB "
        "is reserved by PyTorch but unallocated."
    )
    got = parse_oom_message(text)

    assert got is not None
    assert got.device_index == 3
    assert got.requested == 2147483648
    assert got.total == gib("79.19")
    assert got.free == gib("1.06")
    assert got.processes == ((1234, 10 * 2**30), (5678, gib("8.5")))
    assert got.this_process == 60 * 2**30
    assert (got.allocated, got.reserved_unallocated) == (55 * 2**30, gib("3.25"))
    assert got.reserved_total == gib("58.25")


def test_allowed_limit_and_private_pools_are_read() -> None:
    # from source: set_per_process_memory_fraction adds "X allowed; ", CUDA graphs add a clause
    text = (
        "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 1 has a total capacity of 39.39 GiB "
        "of which 20.00 GiB is free. Including non-PyTorch memory, this process has 19.00 GiB "
        "memory in use. 19.69 GiB allowed; Of the allocated memory 18.00 GiB is allocated by "
        "PyTorch, with 2.00 GiB allocated in private pools (e.g., CUDA Graphs), and 500.00 MiB "
        "is reserved by PyTorch but unallocated."
    )
    got = parse_oom_message(text)

    assert got is not None
    assert (got.device_index, got.requested, got.free) == (1, 512 * 2**20, 20 * 2**30)
    assert got.this_process == 19 * 2**30
    assert got.allocated == 18 * 2**30
    assert got.reserved_unallocated == 500 * 2**20
    assert got.reserved_total == 18 * 2**30 + 500 * 2**20
    assert got.allowed == gib("19.69")  # the cap a --target rehearsal (or the user) set


def test_1x_allowed_limit_is_read() -> None:
    got = parse_oom_message("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total "
                            "capacity; 14.00 GiB already allocated; 10.00 MiB free; 7.00 GiB allowed; 14.50 GiB "
                            "reserved in total by PyTorch)")
    assert got is not None and got.allowed == 7 * 2**30 and got.reserved_total == gib("14.50")
    assert parse_oom_message("torch.cuda.OutOfMemoryError: " + CUDA_1X_RESERVED).allowed is None


def test_1x_reserved_in_total_format() -> None:
    got = parse_oom_message("torch.cuda.OutOfMemoryError: " + CUDA_1X_RESERVED)

    assert got is not None
    assert (got.backend, got.device_index) == ("cuda", 0)
    assert got.requested == gib("1.09")
    assert got.total == gib("15.77")
    assert got.allocated == gib("14.28")
    assert got.free == mib("217.12")
    assert got.reserved_total == gib("14.30")
    assert got.reserved_unallocated == gib("14.30") - gib("14.28")
    assert (got.this_process, got.processes) == (None, ())
    assert got.text == " ".join(CUDA_1X_RESERVED.split())


def test_1x_cached_format_is_the_unallocated_cache() -> None:
    got = parse_oom_message("RuntimeError: " + CUDA_1X_CACHED)

    assert got is not None
    assert got.requested == gib("2.56")
    assert got.total == gib("15.90")
    assert got.allocated == gib("10.38")
    assert got.free == gib("1.83")
    assert got.reserved_unallocated == gib("2.99")
    assert got.reserved_total == gib("10.38") + gib("2.99")


def test_1x_with_allowed_limit() -> None:
    # from source: 1.x put "X allowed; " between free and reserved
    text = (
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
        "130.35 MiB already allocated; 47.06 MiB free; 4.00 GiB allowed; 188.00 MiB reserved in "
        "total by PyTorch)"
    )
    got = parse_oom_message(text)

    assert got is not None
    assert got.requested == 20971520
    assert (got.total, got.allocated, got.free) == (gib("7.93"), mib("130.35"), mib("47.06"))
    assert got.reserved_total == 188 * 2**20
    assert got.reserved_unallocated == 188 * 2**20 - mib("130.35")


def test_hip_message_reads_as_hip() -> None:
    got = parse_oom_message("torch.OutOfMemoryError: " + HIP_CURRENT)

    assert got is not None
    assert (got.backend, got.device_index) == ("hip", 0)
    assert got.requested == 978 * 2**20
    assert (got.total, got.free) == (gib("15.98"), 630 * 2**20)
    assert (got.allocated, got.reserved_unallocated, got.reserved_total) == (0, 0, 0)
    assert got.text.endswith(
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def test_xpu_message_reads_as_xpu() -> None:
    # from source: the XPU allocator's TORCH_CHECK_WITH(OutOfMemoryError, ...) literals
    text = (
        "XPU out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 15.11 GiB of "
        "which 2.50 GiB is free. Of the allocated memory 11.20 GiB is allocated by PyTorch, and "
        "1.25 GiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release all "
        "unoccupied cached memory."
    )
    got = parse_oom_message(text)

    assert got is not None
    assert (got.backend, got.device_index, got.requested) == ("xpu", 0, 4 * 2**30)
    assert (got.total, got.free) == (gib("15.11"), gib("2.5"))
    assert (got.allocated, got.reserved_unallocated) == (gib("11.20"), gib("1.25"))
    assert got.reserved_total == gib("12.45")
    assert got.text == text


def test_mps_private_pool_in_gb_units() -> None:
    got = parse_oom_message("RuntimeError: " + MPS_PRIVATE_GB)

    assert got == OOMMessage(
        backend="mps", device_index=None, requested=3 * 2**30, total=gib("45.90"), free=None,
        allocated=gib("42.33"), reserved_unallocated=None, reserved_total=None, this_process=None,
        processes=(), other_allocations=3 * 2**30, pool="private", text=MPS_PRIVATE_GB,
    )


def test_mps_shared_pool_in_kib_units() -> None:
    got = parse_oom_message(MPS_SHARED_KIB)

    assert got is not None
    assert (got.backend, got.pool) == ("mps", "shared")
    assert got.allocated == 1024 * 2**20
    assert got.other_allocations == 384 * 1024
    assert got.total == mib("511.18")
    assert got.requested == 256 * 2**20


def test_mps_message_cut_before_the_request() -> None:
    got = parse_oom_message(
        "MPS backend out of memory (MPS allocated: 5.51 GiB, other allocations: 3.41 GiB, max "
        "allowed: 9.07 GiB)."
    )

    assert got is not None
    assert (got.backend, got.requested, got.pool) == ("mps", None, None)
    assert got.allocated == gib("5.51")
    assert got.other_allocations == gib("3.41")
    assert got.total == gib("9.07")


@pytest.mark.parametrize(
    "text,requested",
    [(CPU_CANT_ALLOCATE, 1 << 50), (CPU_NOT_ENOUGH, 1 << 40)],
    ids=["cant-allocate", "not-enough"],
)
def test_cpu_allocator_messages(text: str, requested: int) -> None:
    got = parse_oom_message("RuntimeError: " + text)

    assert got is not None
    assert (got.backend, got.device_index, got.requested) == ("cpu", None, requested)
    assert (got.total, got.free, got.allocated) == (None, None, None)
    assert got.text == text


@pytest.mark.parametrize(
    "text,backend,found",
    [
        (
            "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
            "reported at some other API call, so the stacktrace below might be incorrect.\nFor "
            "debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
            "cuda",
            "CUDA error: out of memory",
        ),
        (
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
            "`cublasCreate(handle)`",
            "cuda",
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        ),
        ("RuntimeError: HIP error: out of memory", "hip", "HIP error: out of memory"),
    ],
    ids=["cuda-driver", "cublas", "hip-driver"],
)
def test_driver_level_out_of_memory_has_no_figures(text: str, backend: str, found: str) -> None:
    got = parse_oom_message(text)

    assert got == OOMMessage(
        backend=backend, device_index=None, requested=None, total=None, free=None, allocated=None,
        reserved_unallocated=None, reserved_total=None, this_process=None, processes=(),
        other_allocations=None, pool=None, text=found,
    )


def test_message_cut_after_the_request() -> None:
    got = parse_oom_message("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB.")

    assert got is not None
    assert (got.backend, got.requested, got.total, got.device_index) == ("cuda", 2**31, None, None)


# --- found inside tracebacks, wrapped, coloured --------------------------------------------------


def test_found_inside_a_whole_traceback() -> None:
    pasted = (
        "Traceback (most recent call last):\n"
        '  File "/home/me/load.py", line 12, in <module>\n'
        "    model = AutoModelForCausalLM.from_pretrained(path, device_map='cuda')\n"
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1326, in '
        "convert\n"
        "    return t.to(\n"
        "           ^^^^^\n"
        f"torch.OutOfMemoryError: {CUDA_CURRENT}\n"
        "\n"
        "[I 10:02:11 kernel] restarting kernel (1/5), keep random ports\n"
    )
    assert parse_oom_message(pasted) == parse_oom_message(CUDA_CURRENT)


@pytest.mark.parametrize("width", [40, 79, 80, 120])
@pytest.mark.parametrize(
    "message", [CUDA_CURRENT, CUDA_21_CAPACTY, CUDA_1X_RESERVED, MPS_PRIVATE_GB, CPU_CANT_ALLOCATE]
)
def test_terminal_wrapped_message_reads_the_same(message: str, width: int) -> None:
    lines = textwrap.wrap(
        "torch.OutOfMemoryError: " + message, width, break_long_words=False, break_on_hyphens=False
    )
    wrapped = "\n    ".join(lines)  # wrapped and indented, as a log viewer shows it

    got = parse_oom_message(wrapped)

    assert wrapped != message
    assert got == parse_oom_message(message)
    assert got is not None and got.text == " ".join(message.split())


def test_ansi_coloured_ipython_traceback() -> None:
    coloured = (
        "\x1b[0;31m" + "-" * 75 + "\x1b[0m\n"
        "\x1b[0;31mOutOfMemoryError\x1b[0m: " + CUDA_1X_CACHED + "\n"
    )
    got = parse_oom_message(coloured)

    assert got is not None
    assert got.reserved_unallocated == gib("2.99")


def test_the_last_of_several_errors_counts() -> None:
    log = (
        f"epoch 1\nRuntimeError: {CUDA_1X_RESERVED}\n"
        f"retrying on cpu\nRuntimeError: {CPU_CANT_ALLOCATE}\n"
    )

    got = parse_oom_message(log)

    assert got is not None
    assert (got.backend, got.requested) == ("cpu", 1 << 50)


# --- not an OOM, hostile input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n\t ",
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x5 and 6x7)",
        "Troubleshooting CUDA Out of Memory During Model Loading",
        "RuntimeError: CUDA error: device-side assert triggered",
        "MemoryError",
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which 0 bytes free.",
        "Process 1234 has 10.00 GiB memory in use.",
    ],
)
def test_text_without_an_oom_error_gives_none(text: str) -> None:
    assert parse_oom_message(text) is None


@pytest.mark.parametrize(
    "value", [None, b"CUDA out of memory. Tried to allocate 2.00 GiB", 42, ["x"]]
)
def test_non_text_gives_none(value: object) -> None:
    assert parse_oom_message(value) is None  # type: ignore[arg-type]


def test_figure_over_one_exbibyte_is_unknown_and_the_rest_stays() -> None:
    text = (
        "CUDA out of memory. Tried to allocate 2000000000.00 GiB. GPU 0 has a total capacity of "
        "1073741824.00 GiB of which 1.00 GiB is free. Of the allocated memory 1073741824.00 GiB is "
        "allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but unallocated."
    )
    got = parse_oom_message(text)

    assert got is not None
    assert got.requested is None  # 2e9 GiB > 1 EiB
    assert got.total == EIB  # exactly 1 EiB is still a size
    assert got.free == 2**30
    assert (got.allocated, got.reserved_unallocated) == (EIB, 2**31)
    assert got.reserved_total is None  # the sum passes 1 EiB


def test_hostile_figures_and_repetition_end_with_a_record() -> None:
    digits = "9" * 200_000
    got = parse_oom_message(f"CUDA out of memory. Tried to allocate {digits}.00 GiB. GPU {digits}")
    assert got is not None and (got.requested, got.device_index) == (None, None)

    many = "Process 7 has 1.00 GiB memory in use. " * 10_000  # > the 64 KiB read window
    got = parse_oom_message(
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 8.00 GiB of "
        "which 0 bytes is free. " + many
    )
    assert got is not None and got.free == 0
    assert 1_000 < len(got.processes) < 2_000 and got.processes[0] == (7, 2**30)
    assert got.allocated is None

    got = parse_oom_message("(GPU 0; " * 100_000 + "CUDA out of memory." * 100_000)
    assert got is not None and got.requested is None


def test_an_error_over_a_mebibyte_before_the_end_is_not_read() -> None:
    # The documented bound: a pasted log is read from its last MiB, where its latest error is.
    later_output = "step 10 loss 0.25\n" * 70_000  # 1.2 MiB

    assert parse_oom_message(CUDA_CURRENT + "\n" + later_output) is None
    assert parse_oom_message(CUDA_CURRENT + "\n" + later_output[:500_000]) is not None


# --- is_out_of_memory ----------------------------------------------------------------------------


def test_real_cpu_out_of_memory_is_recognised() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB on a 24 GiB machine without swap

    assert is_out_of_memory(caught.value) is True
    got = parse_oom_message(str(caught.value))
    assert got is not None
    assert (got.backend, got.requested) == ("cpu", 1 << 50)


def test_torch_out_of_memory_error_counts_by_its_type() -> None:
    class WrappedOOM(torch.OutOfMemoryError):
        pass

    assert is_out_of_memory(torch.OutOfMemoryError("no message parsed from this")) is True
    assert is_out_of_memory(WrappedOOM("")) is True
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


@pytest.mark.parametrize(
    "exc,expected",
    [
        (MemoryError(), True),
        (MemoryError("Unable to allocate 8.00 GiB for an array"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError(CUDA_CURRENT), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError(CUDA_CURRENT), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_is_out_of_memory_by_type_and_message(exc: BaseException, expected: bool) -> None:
    assert is_out_of_memory(exc) is expected


def test_is_out_of_memory_never_raises() -> None:
    class Hostile(RuntimeError):
        def __str__(self) -> str:
            raise ValueError("no text for you")

    assert is_out_of_memory(Hostile()) is False
    assert is_out_of_memory("CUDA out of memory.") is False  # type: ignore[arg-type]


# --- fuzz ----------------------------------------------------------------------------------------

REAL = [
    CUDA_CURRENT, CUDA_21_CAPACTY, CUDA_1X_RESERVED, CUDA_1X_CACHED, HIP_CURRENT, MPS_PRIVATE_GB,
    MPS_SHARED_KIB, CPU_CANT_ALLOCATE, CPU_NOT_ENOUGH,
]
INT_FIELDS = (
    "device_index", "requested", "total", "free", "allocated", "reserved_unallocated",
    "reserved_total", "this_process", "other_allocations",
)


@st.composite
def mutated_messages(draw: st.DrawFn) -> str:
    """A real message cut, spliced, with digits and units swapped, inside random text."""
    text = draw(st.sampled_from(REAL))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(text)))
        end = draw(st.integers(at, min(len(text), at + 40)))
        piece = draw(
            st.one_of(
                st.text(max_size=30),
                st.sampled_from(["9" * 30, ".", " ", "\n", "GiB", "EiB", "bytes", "KB", "(", ")",
                                 "; ", "Process 1 has ", "CUDA out of memory. ", "\x1b[0m"]),
            )
        )
        text = text[:at] + piece + text[end:]
    return draw(st.text(max_size=50)) + text + draw(st.text(max_size=50))


def check_record(got: OOMMessage | None) -> None:
    if got is None:
        return
    assert got.backend in {"cuda", "hip", "xpu", "mps", "cpu"}
    for name in INT_FIELDS:
        value = getattr(got, name)
        assert value is None or (type(value) is int and 0 <= value <= EIB), (name, value)
    for pid, used in got.processes:
        assert type(pid) is int and pid >= 0 and type(used) is int and 0 <= used <= EIB
    assert got.pool in {None, "private", "shared"}
    assert isinstance(got.text, str) and 0 < len(got.text) <= 64 * 1024


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.text(), mutated_messages()))
def test_fuzz_gives_none_or_a_sane_record(text: str) -> None:
    # The unguarded parser: an exception here is a bug the never-raise guard would hide.
    check_record(oom._parse(text))
    check_record(parse_oom_message(text))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(REAL),
    st.integers(min_value=20, max_value=200),
    st.text(alphabet="abcdefghij 0123456789\n\t", max_size=200),
    st.text(alphabet="abcdefghij 0123456789\n\t", max_size=200),
)
def test_fuzz_wrapping_and_surrounding_text_change_nothing(
    message: str, width: int, before: str, after: str
) -> None:
    lines = textwrap.wrap(message, width, break_long_words=False, break_on_hyphens=False)
    wrapped = "\n".join(lines)

    assert parse_oom_message(before + "\n" + wrapped + "\n" + after) == parse_oom_message(message)


def test_xpu_message_without_free_reads_every_field_present() -> None:
    # issue 14 point 8, from Intel's XPU allocator (c10/xpu/XPUCachingAllocator.cpp): no "free" field.
    text = ("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 20.00 GiB (GPU 0; 15.56 GiB total "
            "capacity; 176.00 MiB already allocated; 176.00 MiB reserved in total by PyTorch)")
    got = parse_oom_message(text)
    assert got is not None and got.backend == "xpu" and got.device_index == 0
    assert got.requested == 20 * 2**30
    assert got.total == gib("15.56") and got.allocated == 176 * 2**20
    assert got.reserved_total == 176 * 2**20 and got.reserved_unallocated == 0
    assert got.free is None  # absent, not 0
