"""diagnose(): causes ranked with their numbers; fit options with a real checkpoint's sizes.

CUDA figures here are PyTorch's own message formats with made-up numbers (no GPU on the test
machines); DeviceReadings and ProcessInfos are the real records, filled by hand.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oom_magic.fit.options import bitsandbytes_installed
from oom_magic.device.reading import DeviceReading
from oom_magic.fit.options import fit_options
from oom_magic.guard.diagnose import FitOption, diagnose
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.guard.oom import parse_oom_message
from oom_magic.device.processes import ProcessInfo
from oom_magic.render.guard import diagnosis_html, diagnosis_text, option_code
from oom_magic.render.units import format_bytes

GiB, MiB = 2**30, 2**20
# PyTorch 2.1+ wording (c10/cuda/CUDACachingAllocator.cpp), figures invented for the test.
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "15.78 GiB of which 1.00 GiB is free. Process 4242 has 9.00 GiB memory in use. Process 777 has 5.50 GiB "
    "memory in use. Of the allocated memory 4.80 GiB is allocated by PyTorch, and 200.00 MiB is reserved by "
    "PyTorch but unallocated."
)
FRAGMENTED = (
    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.78 GiB of which "
    "512.00 MiB is free. Including non-PyTorch memory, this process has 15.20 GiB memory in use. Of the "
    "allocated memory 11.00 GiB is allocated by PyTorch, and 3.50 GiB is reserved by PyTorch but unallocated."
)


def reading(device: str = "cuda:0", *, total: int | None = None, free: int | None = None, used: int | None = None,
            process_used: int | None = None, processes: tuple[ProcessInfo, ...] = ()) -> DeviceReading:
    return DeviceReading(device, None, total, free, used, process_used, None, None, None, processes)


@pytest.fixture(scope="module")
def estimate(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("diag") / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256)).save_pretrained(path)
    return estimate_checkpoint(path)


def test_other_processes_rank_first_with_who_and_how_much():
    kernel = ProcessInfo(4242, 9 * GiB, "python", "me", True, False, None)
    stranger = ProcessInfo(777, int(5.5 * GiB), None, "bob", None, False, "another user's process")
    d = diagnose(CUDA_OOM, device="cuda:0", at_failure=reading(processes=(kernel, stranger)), self_pid=1)
    assert d.requested == 2 * GiB and d.free == 1 * GiB and d.shortfall == 1 * GiB
    top = d.top
    assert top.kind == "other-processes" and top.score == 1.0
    assert top.figure("others") == int(14.5 * GiB) and top.figure("kernels") == 9 * GiB
    assert [p.pid for p in top.processes] == [4242, 777]
    text = diagnosis_text(d)
    assert "other processes hold 14.50 GiB on cuda:0" in text
    assert "pid 4242 python, user me, Jupyter kernel: 9.00 GiB → another kernel of yours" in text
    assert "kill 4242" in text and "another user's: ask them" in text


def test_this_process_is_not_another_process():
    d = diagnose(CUDA_OOM, device="cuda:0", self_pid=4242)
    assert d.top.kind == "other-processes" and d.top.figure("others") == int(5.5 * GiB)


def test_fragmentation_when_the_cache_is_bigger_than_the_request():
    d = diagnose(FRAGMENTED, device="cuda:0", expandable_segments=False, cuda_initialized_before=True)
    frag = d.cause("fragmentation")
    assert frag.score == 1.0 and frag.figure("cache") == int(3.5 * GiB) and frag.figure("requested") == GiB
    assert d.top.kind == "fragmentation"
    text = diagnosis_text(d)
    assert "3.50 GiB is reserved by PyTorch but unallocated" in text
    assert "restart the kernel and run %%guardload first" in text
    on = diagnose(FRAGMENTED, device="cuda:0", expandable_segments=True)
    assert "expandable_segments is already on" in diagnosis_text(on)


def test_fragmentation_from_the_allocator_snapshots_largest_block():
    message = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.78 GiB of which "
               "800.00 MiB is free. Of the allocated memory 13.00 GiB is allocated by PyTorch, and 600.00 MiB is "
               "reserved by PyTorch but unallocated.")
    d = diagnose(message, device="cuda:0", largest_free_block=300 * MiB)
    frag = d.cause("fragmentation")
    assert frag.score == 0.8 and frag.figure("largest_free_block") == 300 * MiB
    assert "the largest free block is 300.00 MiB" in diagnosis_text(d)
    assert diagnose(message, device="cuda:0", largest_free_block=2 * GiB).cause("fragmentation").score == 0.6


def test_too_big_lists_options_with_the_checkpoints_sizes(estimate):
    fp32 = estimate.bytes_for("float32")
    message = (f"CUDA out of memory. Tried to allocate 64.00 KiB. GPU 0 has a total capacity of 300.00 KiB of which "
               f"10.00 KiB is free. Of the allocated memory 280.00 KiB is allocated by PyTorch, and 0 bytes is "
               f"reserved by PyTorch but unallocated.")
    d = diagnose(message, device="cuda:0", estimate=estimate, need=fp32, dtype="float32",
                 ram_budget=100 * 1024, disk_budget=10**9)
    big = d.cause("too-big")
    assert big.score == 1.0 and "over-capacity" in big.flags and big.figure("need") == fp32
    options = {o.kind: o for o in big.options}
    assert options["bfloat16"].device_bytes == estimate.bytes_for("bfloat16") and options["bfloat16"].fits is True
    assert options["nf4"].device_bytes == estimate.bytes_for("nf4", double_quant=True, unquantized_dtype="bfloat16")
    assert options["device-map-auto"].max_memory == ((0, 300 * 1024), ("cpu", 100 * 1024))
    assert options["offload-folder"].disk_bytes == fp32 - 400 * 1024
    text = diagnosis_text(d)
    assert f"the load needs {format_bytes(fp32)}, and cuda:0 has 300.00 KiB in all" in text
    assert 'max_memory={0: "300KiB", "cpu": "100KiB"}' in text


def test_stale_memory_and_variables_with_their_figures():
    d = diagnose(CUDA_OOM, device="cuda:0", self_pid=4242, stale_given_back=3 * GiB,
                 holders=(("old_model", 2 * GiB), ("acts", GiB // 2)))
    assert d.kinds[:3] == ("other-processes", "stale", "variables")
    assert d.cause("stale").figure("stale_given_back") == 3 * GiB
    variables = d.cause("variables")
    assert variables.holders == (("old_model", 2 * GiB), ("acts", GiB // 2)) and variables.figure("held") == int(2.5 * GiB)
    assert "%freeall old_model acts" in diagnosis_text(d)


def test_partial_load_given_back_and_a_lower_precision_retry_that_fits_now(estimate):
    now = reading("cpu", total=10 * MiB, free=300_000)
    d = diagnose("DefaultCPUAllocator: can't allocate memory: you tried to allocate 200000 bytes.", device="cpu",
                 now=now, given_back=250_000, estimate=estimate, dtype="float32", ram_budget=300_000)
    partial = d.cause("partial-load")
    assert partial.figure("given_back") == 250_000 and partial.figure("free_now") == 300_000
    # disk unknown: no offload; 8-bit and nf4 only where bitsandbytes is installed (they cannot run without it)
    quantized = ["int8", "nf4"] if bitsandbytes_installed() else []
    assert [o.kind for o in partial.options] == ["bfloat16", *quantized]
    assert "a retry with bf16/fp16" in diagnosis_text(d)
    # the same load needs what it held plus what it asked: 450,000 > 300,000
    assert (d.retry.can_fit, d.retry.reason, d.retry.need) == (False, "still-short", 450_000)


def test_retry_verdicts():
    message = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000 bytes."
    fits = diagnose(message, device="cpu", now=reading("cpu", free=5000), given_back=2000, headroom=1000)
    assert (fits.retry.can_fit, fits.retry.need, fits.retry.free_now) == (True, 3000, 5000)
    short = diagnose(message, device="cpu", now=reading("cpu", free=3500), given_back=2000, headroom=1000)
    assert (short.retry.can_fit, short.retry.reason) == (False, "still-short")
    unknown = diagnose(message, device="cpu")
    assert (unknown.retry.can_fit, unknown.retry.reason) == (False, "unknown")
    with_estimate = diagnose(message, device="cpu", now=reading("cpu", free=5000), need=4500)
    assert with_estimate.retry.need == 4500 and with_estimate.retry.can_fit


def test_cpu_other_processes_do_not_count_under_an_address_space_limit():
    message = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 400 bytes."
    at = reading("cpu", total=10_000, free=100, used=9_000, process_used=1_000)
    assert diagnose(message, device="cpu", at_failure=at).top.kind == "other-processes"
    limited = diagnose(message, device="cpu", at_failure=at, free_limit="the address-space limit (ulimit -v)")
    assert limited.cause("other-processes") is None
    assert "limited by the address-space limit" in limited.notes[-1]


def test_text_that_is_not_an_oom_still_gets_a_diagnosis_from_readings():
    d = diagnose("ValueError: nope", device="cpu", now=reading("cpu", free=10))
    assert d.oom is None and d.requested is None and "not one of PyTorch's out-of-memory messages" in d.notes[0]


def test_fit_options_for_torch_load_and_load_file(estimate):
    options = fit_options(estimate, device="cuda:0", loader="torch.load", device_budget=10, ram_budget=10**9,
                          model_part=("model", 1234))
    assert [o.kind for o in options] == ["map-location-cpu", "mmap", "skip-optimizer"]
    assert options[0] == FitOption("map-location-cpu", 0, True, cpu_bytes=estimate.bytes)
    assert options[2].device_bytes == 1234 and options[2].fits is False
    assert option_code(options[2]) == 'torch.load(path, map_location="cpu", weights_only=True, mmap=True)[\'model\']'
    (cpu_first,) = fit_options(estimate, device="cuda:0", loader="load_file", ram_budget=10)
    assert cpu_first.kind == "device-cpu" and cpu_first.fits is False and option_code(cpu_first).startswith('device="cpu"')


def test_fit_options_skip_what_the_load_already_does(estimate):
    kinds = [o.kind for o in fit_options(estimate, device="cuda:0", dtype="bfloat16", device_budget=1, ram_budget=1)]
    assert kinds == ["int8", "nf4", "device-map-auto", "offload-folder"]
    kinds = [o.kind for o in fit_options(estimate, device="cuda:0", dtype="nf4", need=10, device_budget=1,
                                         ram_budget=100)]
    assert kinds == ["device-map-auto"]


def test_diagnosis_html_escapes_process_names():
    evil = ProcessInfo(4242, 9 * GiB, "<img src=x onerror=alert(1)>", "me", False, False, None)
    html = diagnosis_html(diagnose(CUDA_OOM, device="cuda:0", at_failure=reading(processes=(evil,)), self_pid=1))
    assert "<img" not in html and "&lt;img src=x" in html


def test_too_big_for_a_per_process_cap(estimate):
    # 2.1+ wording with the fraction limit ("... allowed;") as PyTorch prints it under a cap.
    message = ("CUDA out of memory. Tried to allocate 300.00 KiB. GPU 0 has a total capacity of 79.00 GiB of which "
               "70.00 GiB is free. 200.00 KiB allowed; Of the allocated memory 20.00 KiB is allocated by PyTorch, "
               "and 0 bytes is reserved by PyTorch but unallocated.")
    fp32 = estimate.bytes_for("float32")
    d = diagnose(message, device="cuda:0", estimate=estimate, need=fp32, dtype="float32", process_limit=200 * 1024)
    big = d.top
    assert big.kind == "too-big" and {"over-capacity", "process-limit"} <= set(big.flags)
    assert big.figure("total") == 200 * 1024
    assert "set_per_process_memory_fraction lets it use 200.00 KiB of cuda:0" in diagnosis_text(d)
    # Without process_limit the message's own "200.00 KiB allowed" figure says the same.
    from_message = diagnose(message, device="cuda:0", estimate=estimate, need=fp32)
    assert from_message.top.kind == "too-big" and "process-limit" in from_message.top.flags
    assert from_message.top.figure("total") == 200 * 1024 and from_message.cause("fragmentation") is None
    uncapped = message.replace(" 200.00 KiB allowed;", "")
    assert diagnose(uncapped, device="cuda:0", estimate=estimate, need=fp32).cause("too-big") is None  # 79 GiB device



def test_other_kernels_are_named_with_their_notebook_and_how_to_stop_them():
    from oom_magic.device.jupyter_kernels import KernelInfo

    kernel = KernelInfo("experiments/llama.ipynb", "abc", "http://127.0.0.1:8888/",
                        "Kernel → Shut Down Kernel in experiments/llama.ipynb (Jupyter at http://127.0.0.1:8888/), "
                        "or `kill 4242`")
    proc = ProcessInfo(4242, 9 * GiB, "python", "me", True, False, None)
    d = diagnose(CUDA_OOM, device="cuda:0", at_failure=reading(processes=(proc,)), kernels={4242: kernel}, self_pid=1)
    assert d.top.kernels == ((4242, "experiments/llama.ipynb", kernel.stop_hint),)
    text = diagnosis_text(d)
    assert "pid 4242 python, user me, Jupyter kernel of experiments/llama.ipynb: 9.00 GiB" in text
    assert "Shut Down Kernel in experiments/llama.ipynb" in text


# PyTorch 2.1+ wording as printed inside a container: NVML lists this kernel under its host pid, so
# PyTorch, not finding os.getpid() in the list, prints no "this process has" line. Figures invented.
CONTAINER_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.06 GiB is free. Process 3141592 has 78.12 GiB memory in use. Of the allocated memory "
    "77.05 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_a_container_message_lists_this_kernel_under_its_host_pid():
    from oom_magic.device.processes import NOTE_SELF_HOST_PID

    assert not Path("/proc/3141592").exists()  # not a pid of this namespace, as a host pid in a container
    message = parse_oom_message(CONTAINER_OOM)
    assert message.this_process is None and message.processes == ((3141592, round(78.12 * GiB)),)
    d = diagnose(CONTAINER_OOM)
    # 78.12 GiB = PyTorch's 77.55 GiB reserved + a 0.57 GiB context: this kernel, not another process
    assert all(c.kind != "other-processes" for c in d.causes)
    note = next(n for n in d.notes if NOTE_SELF_HOST_PID in n)
    assert note.startswith("process 3141592 in the message is this kernel")
    assert f"its {format_bytes(round(78.12 * GiB))} are PyTorch's {format_bytes(message.reserved_total)} reserved" in note
    assert "other processes hold" not in diagnosis_text(d)


@pytest.mark.parametrize("edit, why", [
    (("78.12 GiB memory in use", "79.00 GiB memory in use"), "2.45 GiB above PyTorch's reserved: more than a context"),
    (("78.12 GiB memory in use", "60.00 GiB memory in use"), "less than PyTorch's own reserved: not this process"),
    (("Process 3141592", "Process 1"), "pid 1 exists in this namespace: a process here, not a host pid"),
])
def test_a_listed_process_that_is_not_this_kernel_still_ranks(edit, why):
    text = CONTAINER_OOM.replace(*edit)
    if "79.00" in text:
        text = text.replace("77.05 GiB is allocated", "76.05 GiB is allocated")  # reserved 76.55: 2.45 GiB below
    d = diagnose(text)
    assert d.top is not None and d.top.kind == "other-processes", why
    assert not any("this kernel" in n for n in d.notes), why
