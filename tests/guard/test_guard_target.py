"""%%guardload --target and guard_load(target=...): rehearse a load for the GPU it will be deployed on.

On this CPU machine the rehearsal is the fit check against the target's usable memory, through a
real IPython shell and a real tiny Llama saved to disk (9.6M parameters, 36.5 MiB in float32):
against a 1300MiB card (32 MiB usable once its driver and a CUDA context are taken off) the
float32 load does not fit and bf16 does. The cap on a larger CUDA device is checked through a
FAKE torch.cuda (FakeTorchCuda's fraction and allocator model, no GPU here) on a FAKE NVML GPU;
the offload advice with a patched disk-usage (and RAM) reading; the %gpumem process table with
a patched find_jupyter_kernels (the real server is in tests/device/test_jupyter_kernels.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from transformers import LlamaConfig, LlamaForCausalLM

import oom_magic.guard.pipeline as guard_module
import oom_magic.device.jupyter_kernels as jupyter_kernels_module
from oom_magic import guard_load
from oom_magic.common.errors import OomMagicError
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.fit.options import bitsandbytes_installed
from oom_magic.device.jupyter_kernels import KernelInfo
from oom_magic.device.nvml import Nvml
from oom_magic.fit.preflight import preflight_check
from oom_magic.render.guard import option_code, preflight_text
from oom_magic.render.html import snapshot_html
from oom_magic.render.text import snapshot_text
from oom_magic.render.units import format_bytes
from oom_magic.fit.targets import memory_fraction_for, parse_target
from tests.conftest import ready_process
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.fakes.fake_torch_cuda import FakeOutOfMemoryError, FakeTorch, FakeTorchCuda

MiB = 1 << 20
GiB = 1 << 30
SMALL = parse_target("1300MiB")  # 1300 MiB − 768 MiB driver − 500 MiB context = 32 MiB usable
T4 = parse_target("T4")
FP32_CELL = "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\n"
BF16_CELL = "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)\n"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny Llama (untied embeddings), saved as float32 safetensors."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=16384, tie_word_embeddings=False)).save_pretrained(path)
    return path


@pytest.fixture
def model_ip(ip, llama):
    ip.run_cell(f"import torch\nfrom transformers import AutoModelForCausalLM\npath = {str(llama)!r}",
                store_history=True)
    return ip


def test_the_tiny_target_sits_between_bf16_and_fp32(llama):
    est = estimate_checkpoint(llama)
    assert SMALL.usable == 32 * MiB
    assert est.bytes_for("bfloat16") < SMALL.usable < est.bytes_for("float32")


# --------------------------------------------------------------------------- on cpu: the fit check only


def test_cpu_rehearsal_that_does_not_fit_prints_options_for_the_target(model_ip, llama, capsys):
    est = estimate_checkpoint(llama)
    fp32 = est.bytes_for("float32")
    report = model_ip.run_cell_magic("guardload", "--target 1300MiB --headroom 0", FP32_CELL)
    assert report.outcome == "ok" and report.device == "cpu"
    assert isinstance(model_ip.user_ns["model"], LlamaForCausalLM)  # the load itself ran, uncapped
    rehearsal = report.rehearsal
    assert (rehearsal.target, rehearsal.reason, rehearsal.cap, rehearsal.checked) == (SMALL, "not-cuda", None, True)

    (check,) = report.preflight.checks
    assert check.target == SMALL and check.device == "cpu" and check.verdict == "will-not-fit"
    assert (check.free, check.context, check.headroom, check.budget) == (32 * MiB, 0, 0, 32 * MiB)
    assert check.need == fp32 and check.margin == 32 * MiB - fp32
    options = {o.kind: o for o in check.options}
    assert list(options) == ["bfloat16", "int8", "nf4", "device-map-auto"]
    assert options["bfloat16"].device_bytes == est.bytes_for("bfloat16") and options["bfloat16"].fits
    # small enough either way; they count as fitting only where bitsandbytes is installed to run them
    installed = bitsandbytes_installed()
    assert options["int8"].fits is installed and options["nf4"].fits is installed
    assert options["int8"].needs == (None if installed else "bitsandbytes")
    auto = options["device-map-auto"]
    assert auto.max_memory[0] == (0, 32 * MiB) and auto.device_bytes == 32 * MiB
    assert auto.cpu_bytes == fp32 - 32 * MiB
    assert option_code(auto).startswith('device_map="auto", max_memory={0: "32MiB", "cpu": ')

    out = capsys.readouterr().out
    assert (f"  on a 1300MiB GPU this load needs {format_bytes(fp32)} of 32.00 MiB usable (after its driver and "
            f"CUDA context) → WILL NOT FIT: {format_bytes(fp32 - 32 * MiB)} short") in out
    assert "  ways to fit on a 1300MiB GPU (sizes for this model; RAM and disk are this machine's):" in out
    assert f"{format_bytes(est.bytes_for('bfloat16'))} on 1300MiB GPU" in out and "dtype=torch.bfloat16" in out
    assert "preflight: line 1 loads to cpu here; --target 1300MiB checked it as if its weights went to that GPU" in out
    # Said before the cell: it *runs* uncapped (issue 14.5: never "ran" before it ran); the report: it ran.
    assert ("--target 1300MiB: this is cpu, so only the fit check ran against the 1300MiB GPU's 32.00 MiB usable; "
            "the load itself runs uncapped") in out and "ran uncapped" not in out
    assert "--target 1300MiB: this is cpu" in str(report) and "the load itself ran uncapped" in str(report)


def test_cpu_rehearsal_that_fits_gives_the_margin_there(model_ip, llama, capsys):
    bf16 = estimate_checkpoint(llama).bytes_for("bfloat16")
    report = model_ip.run_cell_magic("guardload", "--target 1300MiB --headroom 0", BF16_CELL)
    (check,) = report.preflight.checks
    assert check.verdict == "fits" and check.margin == 32 * MiB - bf16 and check.options == ()
    out = capsys.readouterr().out
    assert (f"on a 1300MiB GPU this load needs {format_bytes(bf16)} of 32.00 MiB usable (after its driver and CUDA "
            f"context); margin {format_bytes(32 * MiB - bf16)} → fits") in out


def test_a_known_gpu_keeps_the_headroom_of_its_own_total(model_ip, llama, capsys):
    fp32 = estimate_checkpoint(llama).bytes_for("float32")
    report = model_ip.run_cell_magic("guardload", "--target t4", FP32_CELL)  # any case
    (check,) = report.preflight.checks
    headroom = int(T4.total * 5 / 100)
    assert check.target == T4 and check.headroom == headroom and check.budget == T4.usable - headroom
    assert check.verdict == "fits" and check.margin == T4.usable - headroom - fp32
    out = capsys.readouterr().out
    # issue 14.9: one usable figure for the target, the same as the rehearsal line's.
    assert (f"on a T4 this load needs {format_bytes(fp32)} of {format_bytes(T4.usable)} usable (after its driver "
            f"and CUDA context) − {format_bytes(headroom)} headroom = {format_bytes(T4.usable - headroom)}; "
            f"margin {format_bytes(check.margin)} → fits") in out
    assert f"the T4's {format_bytes(T4.usable)} usable" in out
    assert report.rehearsal.reason == "not-cuda"


def test_strict_refuses_a_load_the_target_cannot_hold(model_ip, llama):
    fp32 = estimate_checkpoint(llama).bytes_for("float32")
    with pytest.raises(UsageError) as info:
        model_ip.run_cell_magic("guardload", "--strict --target 1300MiB --headroom 0", FP32_CELL)
    assert str(info.value) == (f"--strict: line 1 will not fit on a 1300MiB GPU: needs {format_bytes(fp32)}, "
                               f"{format_bytes(fp32 - 32 * MiB)} short; bf16/fp16 fits: dtype=torch.bfloat16")
    assert "model" not in model_ip.user_ns


def test_quiet_keeps_the_cpu_line_in_the_report_only(model_ip, capsys):
    report = model_ip.run_cell_magic("guardload", "--target T4 --quiet", "a = 1\n")
    assert capsys.readouterr().out == ""
    assert report.rehearsal.reason == "not-cuda" and not report.rehearsal.checked
    assert ("--target T4: this is cpu, so nothing was checked against the T4's 14.07 GiB usable; the load itself "
            "ran uncapped") in str(report)


@pytest.mark.parametrize("line, message", [
    ("--target T5", r"^unknown target 'T5': give a size such as 16GiB or one of T4, L4, A10G, .*MI300X$"),
    ("--target a100", r"^unknown target 'a100' \(did you mean A100-40GB or A100-80GB\?\): .* one of T4, "),
    ("--target 16", r"^target '16' has no unit: write a size such as 16MiB or 16GiB, or a GPU name$"),
    ("--target 100KiB", r"^target '100KiB' is no more than what a GPU keeps for its driver and the CUDA context"),
    ("--target", r"argument --target: expected one argument"),
])
def test_bad_targets_are_one_line_usage_errors(model_ip, line, message):
    with pytest.raises(UsageError, match=message) as info:
        model_ip.run_cell_magic("guardload", line, "ran = True\n")
    assert "\n" not in str(info.value)
    assert "ran" not in model_ip.user_ns


def test_the_target_flag_has_help(model_ip):
    parser = model_ip.magics_manager.registry["OomMagics"].guardload.parser
    (flag,) = [a for a in parser._actions if a.dest == "target"]
    assert flag.option_strings == ["--target"] and "T4" in flag.help and "16GiB" in flag.help


# --------------------------------------------------------------------------- guard_load for scripts


def test_guard_load_target_on_cpu_says_nothing_was_capped(capsys):
    ns: dict[str, Any] = {}
    with guard_load(device="cpu", namespace=ns, target="T4") as guard:
        ns["w"] = torch.ones(1000)
    report = guard.report
    assert report.outcome == "ok" and report.variable("w").bytes == 4000
    assert (report.rehearsal.target, report.rehearsal.reason, report.rehearsal.checked) == (T4, "not-cuda", False)
    line = "--target T4: this is cpu, so nothing was checked against the T4's 14.07 GiB usable; the load itself "
    assert line + "runs uncapped" in capsys.readouterr().out and line + "ran uncapped" in str(report)


def test_guard_load_bad_target_is_an_error_naming_the_known_gpus():
    with pytest.raises(OomMagicError, match=r"^unknown target 'T40': .*one of T4, L4, ") as info:
        guard_load(device="cpu", namespace={}, target="T40")
    assert "\n" not in str(info.value)


def test_preflight_check_takes_a_target(llama):
    fp32 = estimate_checkpoint(llama).bytes_for("float32")
    result = preflight_check(FP32_CELL, {"path": str(llama), "torch": torch}, target="1300MiB", headroom=0)
    (check,) = result.checks
    assert (check.target, check.verdict, check.budget, check.need) == (SMALL, "will-not-fit", 32 * MiB, fp32)
    with pytest.raises(OomMagicError, match="unknown target 'nope'"):
        preflight_check(FP32_CELL, {"path": str(llama)}, target="nope")


# --------------------------------------------------------------------------- offload advice


_DiskUsage = namedtuple("_DiskUsage", "total used free")
_VirtualMemory = namedtuple("_VirtualMemory", "total available")


def _patch_disk(monkeypatch, free: int) -> None:
    """A patched disk-usage reading (shutil.disk_usage): ``free`` bytes wherever it is asked."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _DiskUsage(free * 2, free, free))


AUTO_CELL = "m = AutoModelForCausalLM.from_pretrained(path, device_map='auto')\n"


def test_offload_advice_says_which_of_disk_and_ram_falls_short(llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the advised offload_folder="offload" would be created here
    fp32 = estimate_checkpoint(llama).bytes_for("float32")
    _patch_disk(monkeypatch, 1 * MiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _VirtualMemory(64 * GiB, 512 * 1024))  # patched RAM reading
    result = preflight_check(AUTO_CELL, {"path": str(llama)}, target="1300MiB", headroom=0,
                             ram_bytes=2 * MiB, disk_bytes=10 * GiB)
    (check,) = result.checks
    assert check.device == "auto" and check.verdict == "will-not-fit" and check.target == SMALL
    assert check.split == (("cuda:0", 32 * MiB), ("cpu", 2 * MiB))
    spill = next(o for o in check.options if o.kind == "offload-folder")
    assert (spill.device_bytes, spill.cpu_bytes, spill.disk_bytes) == (32 * MiB, 2 * MiB, fp32 - 34 * MiB)
    assert spill.fits is False  # the budgets said yes; the disk and RAM here say no
    offload = check.offload
    assert offload.folder == tmp_path / "offload" and offload.disk_free == 1 * MiB
    assert offload.shortfalls == (
        f"disk at {tmp_path}: the plan offloads {format_bytes(fp32 - 34 * MiB)} but only 1.00 MiB is free; "
        f"short by {format_bytes(fp32 - 35 * MiB)}",
        "CPU RAM: the plan keeps 2.00 MiB in RAM but only 512.00 KiB is available; short by 1.50 MiB",
    )
    text = preflight_text(result)
    assert "  spill to disk falls short here:\n    disk at " in text
    assert f"short by {format_bytes(fp32 - 35 * MiB)}\n    CPU RAM: " in text
    assert 'offload_folder="offload"' in text


def test_offload_advice_with_room_says_so(llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fp32 = estimate_checkpoint(llama).bytes_for("float32")
    _patch_disk(monkeypatch, 100 * GiB)
    result = preflight_check(AUTO_CELL, {"path": str(llama)}, target="1300MiB", headroom=0,
                             ram_bytes=1 * MiB, disk_bytes=10 * GiB)
    (check,) = result.checks
    spill = next(o for o in check.options if o.kind == "offload-folder")
    assert spill.fits is True and check.offload.ok and check.offload.disk_free == 100 * GiB
    assert (f"  spill to disk checked here: 1.00 MiB in RAM and {format_bytes(fp32 - 33 * MiB)} on disk at "
            f"{tmp_path / 'offload'} have room") in preflight_text(result)
    assert not (tmp_path / "offload").exists()  # checked, never created


def test_offload_advice_on_this_machine_too(llama, tmp_path, monkeypatch):
    """Without --target the same check runs for the advice on this device."""
    monkeypatch.chdir(tmp_path)
    _patch_disk(monkeypatch, 1 * MiB)
    result = preflight_check(AUTO_CELL, {"path": str(llama)}, free_bytes=0, ram_bytes=1 * MiB, disk_bytes=10 * GiB)
    (check,) = result.checks
    assert check.target is None and not check.offload.ok
    assert check.offload.shortfalls[0].startswith(f"disk at {tmp_path}: the plan offloads ")


# --------------------------------------------------------------------------- the cap, on a FAKE torch.cuda


@pytest.fixture
def fake_gpu(use_nvml, monkeypatch) -> Iterator[Any]:
    """FAKE NVML with one 80 GiB GPU (cuda:0), and the guard's torch with a FAKE cuda; returns an installer."""
    use_nvml(Nvml(FakeNvml([FakeGpu(total=80 * GiB)]).module))
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)

    def install(cuda: FakeTorchCuda) -> FakeTorchCuda:
        monkeypatch.setattr(guard_module, "loaded_torch", lambda: FakeTorch(cuda, torch))
        return cuda

    yield install


def _guard(**kwargs: Any):
    return guard_load(device="cuda:0", target="T4", namespace={}, expandable_segments=False, **kwargs)


def test_the_cell_runs_capped_as_the_target_and_the_fraction_comes_back(fake_gpu, capsys):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB))
    cuda.allocate(2 * GiB)  # what this process already holds
    fraction = memory_fraction_for(T4.usable, 80 * GiB, 2 * GiB)
    seen: list[float] = []
    with _guard() as guard:
        seen.append(cuda.get_per_process_memory_fraction(0))
        cuda.allocate(10 * GiB)  # fits a T4's 14.07 GiB
    assert seen == [fraction] and cuda.set_calls() == [fraction, 1.0]
    assert cuda.get_per_process_memory_fraction(0) == 1.0
    rehearsal = guard.report.rehearsal
    assert guard.report.outcome == "ok"
    assert (rehearsal.cap.fraction, rehearsal.cap.previous, rehearsal.restored) == (fraction, 1.0, True)
    assert (rehearsal.device_total, rehearsal.held_before, rehearsal.limit) == (80 * GiB, 2 * GiB, int(fraction * 80 * GiB))
    # The reading before the cell is what the cap allows (read_device sees no allocator figures on this
    # CPU torch, so nothing reserved is subtracted here).
    assert guard.report.before.free == int(fraction * 80 * GiB)
    summary = str(guard.report)
    assert (f"--target T4: cuda:0 (80.00 GiB) ran capped at the T4's 14.07 GiB usable + 2.00 GiB this process "
            f"already held (memory fraction {fraction:.6g}); the previous fraction 1 was restored") in summary
    assert summary.count("--target T4") == 1


def test_a_load_the_target_cannot_hold_runs_out_here_and_the_fraction_comes_back(fake_gpu, capsys):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB))
    cuda.set_per_process_memory_fraction(0.75, 0)  # the user's own cap, to be put back
    with pytest.raises(FakeOutOfMemoryError) as info:
        with _guard():
            cuda.allocate(20 * GiB)  # more than a T4 has, less than this device
    message = str(info.value)
    assert message.startswith("out of memory as on a T4 (cuda:0 capped at its 14.07 GiB usable): "
                              "tried to allocate 20.00 GiB with 14.07 GiB free")
    report = info.value.oom_report
    fraction = memory_fraction_for(T4.usable, 80 * GiB, 0)
    assert report.outcome == "oom" and report.rehearsal.restored is True
    assert cuda.set_calls() == [0.75, fraction, 0.75] and cuda.get_per_process_memory_fraction(0) == 0.75
    assert report.diagnosis.top.kind == "too-big" and "process-limit" in report.diagnosis.top.flags
    out = capsys.readouterr().out
    assert "diagnosis (cuda:0, capped as a T4): asked for 20.00 GiB with 14.07 GiB free" in out
    assert ("too big for a T4: one allocation asked for 20.00 GiB, and under --target T4 this process may hold "
            "14.07 GiB on cuda:0 (the T4's 14.07 GiB usable plus what it already held)") in out
    cuda.allocate(20 * GiB)  # without the cap this device holds it: the failure was the rehearsal's


def test_keyboard_interrupt_in_the_cell_puts_the_fraction_back(fake_gpu):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB))
    cuda.set_per_process_memory_fraction(0.5, 0)
    guard = _guard(quiet=True)
    with pytest.raises(KeyboardInterrupt):
        with guard:
            cuda.allocate(1 * GiB)
            raise KeyboardInterrupt
    assert cuda.get_per_process_memory_fraction(0) == 0.5
    assert guard.report.outcome == "error" and guard.report.rehearsal.restored is True

    def interrupted() -> None:
        raise KeyboardInterrupt

    again = _guard(quiet=True)
    with pytest.raises(KeyboardInterrupt):
        again.run(interrupted)
    assert cuda.get_per_process_memory_fraction(0) == 0.5 and again.report.rehearsal.restored is True
    fraction = again.report.rehearsal.cap.fraction
    assert cuda.set_calls()[-4:] == [guard.report.rehearsal.cap.fraction, 0.5, fraction, 0.5]


def test_leaving_the_retry_loop_early_puts_the_fraction_back(fake_gpu):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB))
    guard = _guard(retry=1, quiet=True)
    during: list[float] = []
    for attempt in guard:
        with attempt:
            during.append(cuda.get_per_process_memory_fraction(0))
        break  # the loop's generator is closed here, before the guard could end
    assert during == [memory_fraction_for(T4.usable, 80 * GiB, 0)]
    assert cuda.get_per_process_memory_fraction(0) == 1.0 and guard.rehearsal.restored is True


def test_the_magic_runs_the_cell_capped(fake_gpu, ip, capsys):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB))
    ip.user_ns["cuda"] = cuda
    with pytest.raises(FakeOutOfMemoryError) as info:
        ip.run_cell_magic("guardload", "--device cuda:0 --target T4 --no-expandable", "cuda.allocate(15 * 2**30)\n")
    report = info.value.oom_report
    assert report.label == "%%guardload" and report.rehearsal.target == T4 and report.rehearsal.restored
    assert cuda.get_per_process_memory_fraction(0) == 1.0
    ok = ip.run_cell_magic("guardload", "--device cuda:0 --target T4 --no-expandable", "cuda.allocate(13 * 2**30)\n")
    assert ok.outcome == "ok" and cuda.memory_allocated(0) == 13 * GiB


def test_no_cap_when_this_device_is_not_larger_than_the_target(fake_gpu, capsys):
    cuda = fake_gpu(FakeTorchCuda(16 * GiB))
    cuda.allocate(2 * GiB)
    with _guard() as guard:
        pass
    assert cuda.set_calls() == [] and guard.report.rehearsal.reason == "not-larger"
    assert ("--target T4: cuda:0 (16.00 GiB) is not larger than the T4's 14.07 GiB usable plus what this process "
            "holds, so nothing was checked against the T4's 14.07 GiB usable; the load itself ran uncapped"
            ) in capsys.readouterr().out


def test_cuda_is_initialized_for_the_cap_only_for_a_load_known_to_go_there(fake_gpu, monkeypatch, capsys):
    named = fake_gpu(FakeTorchCuda(80 * GiB, initialized=False))
    with _guard(quiet=True) as guard:  # device="cuda:0" named: the load goes there
        pass
    assert named.inits == 1 and guard.report.rehearsal.restored is True and len(named.set_calls()) == 2

    cold = fake_gpu(FakeTorchCuda(80 * GiB, initialized=False))
    # The machine's default device is cuda:0 (as where CUDA is visible); nothing says the block uses it.
    monkeypatch.setattr(guard_module, "default_device", lambda nvml=None: "cuda:0")
    with guard_load(target="T4", namespace={}, expandable_segments=False, quiet=True) as guard:
        pass
    assert cold.inits == 0 and cold.set_calls() == []  # no context was created for the cap
    assert guard.report.device == "cuda:0" and guard.report.rehearsal.reason == "cuda-not-initialized"
    assert ("--target T4: CUDA is not initialized and the cell's load was not seen going to cuda:0, so no cap was set "
            "(setting one would create a CUDA context)") in capsys.readouterr().out


def test_a_failed_restore_is_a_note_not_an_error(fake_gpu):
    cuda = fake_gpu(FakeTorchCuda(80 * GiB, fail_restore=True))
    with _guard(quiet=True) as guard:
        cuda.allocate(1 * GiB)
    rehearsal = guard.report.rehearsal
    assert guard.report.outcome == "ok" and rehearsal.restored is False
    assert rehearsal.error.startswith("could not put the previous fraction back (CUDA error: an illegal memory access")
    assert "run torch.cuda.set_per_process_memory_fraction(1.0, 0)" in str(guard.report)


# --------------------------------------------------------------------------- %gpumem: who else is on the GPU


@pytest.fixture
def kernel_like_process(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A real process of this user whose command line names a kernel connection file."""
    with ready_process([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)",
                        "-f", str(tmp_path / "kernel-abc123.json")]) as proc:
        yield proc


@pytest.fixture
def other_users_process() -> Iterator[subprocess.Popen | None]:
    """A real process of uid 65534 (needs root; None elsewhere)."""
    if os.geteuid() != 0:
        yield None
        return
    proc = subprocess.Popen(["/bin/sh", "-c", "sleep 60"], user=65534, group=65534, cwd="/")
    deadline = time.monotonic() + 5
    while proc.pid not in psutil.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_process_table_names_a_kernels_notebook_and_how_to_stop_it(use_nvml, ip, monkeypatch, kernel_like_process,
                                                                        other_users_process):
    kernel = kernel_like_process.pid
    procs = [(kernel, 3 * GiB), (os.getpid(), 1 * GiB)]
    if other_users_process is not None:
        procs.append((other_users_process.pid, 2 * GiB))
    use_nvml(Nvml(FakeNvml([FakeGpu(used=6 * GiB, processes=procs)]).module))
    asked: list[list[int]] = []
    path = "<img src=x onerror=alert(1)>.ipynb"
    hint = f"Kernel → Shut Down Kernel in {path} (Jupyter at http://localhost:8888/), or `kill {kernel}`"

    def patched_find(pids, *, runtime_dir=None, timeout=1.0):  # what a real server answers, patched in
        asked.append(sorted(pids))
        assert timeout <= 1.0
        return {kernel: KernelInfo(path, "abc123", "http://localhost:8888/", hint)}

    monkeypatch.setattr(jupyter_kernels_module, "find_jupyter_kernels", patched_find)
    ip.run_cell("import torch", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
    text, html = snapshot_text(snap), snapshot_html(snap)
    assert asked == [[kernel]]  # only this user's kernel-like process was asked about, once for both forms
    assert f"Jupyter kernel of {path}" in text and f"  to stop pid {kernel}: {hint}" in text
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;.ipynb" in html
    assert "<th style='text-align:left'>how to stop it</th>" in html and "`kill " in html
    if other_users_process is not None:
        (other,) = [p for p in snap.reading.processes if p.pid == other_users_process.pid]
        assert (other.name, other.user, other.used_bytes) == (None, "nobody", 2 * GiB)
        row = next(line for line in text.splitlines() if f"pid {other.pid}" in line)
        assert row.split() == ["pid", str(other.pid), "?,", "user", "nobody,", "another", "user's", "process",
                               "2.00", "GiB"]


def test_an_unreachable_server_leaves_the_pid_only(use_nvml, ip, monkeypatch, kernel_like_process):
    kernel = kernel_like_process.pid
    use_nvml(Nvml(FakeNvml([FakeGpu(used=3 * GiB, processes=[(kernel, 3 * GiB)])]).module))
    monkeypatch.setattr(jupyter_kernels_module, "find_jupyter_kernels", lambda pids, **kw: {})  # nothing answered
    ip.run_cell("import torch", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
    text, html = snapshot_text(snap), snapshot_html(snap)
    row = next(line for line in text.splitlines() if f"pid {kernel}" in line)
    assert row.endswith("Jupyter kernel  3.00 GiB") and "to stop" not in text
    assert "how to stop it" not in html and "<td style='text-align:left'>yes</td>" in html


def test_no_other_process_asks_no_server(use_nvml, ip, monkeypatch):
    use_nvml(Nvml(FakeNvml([FakeGpu(used=1 * GiB, processes=[(os.getpid(), 1 * GiB)])]).module))
    asked: list[Any] = []
    monkeypatch.setattr(jupyter_kernels_module, "find_jupyter_kernels", lambda pids, **kw: asked.append(pids) or {})
    ip.run_cell("import torch", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
    text, html = snapshot_text(snap), snapshot_html(snap)
    assert snap.reading.processes == () and asked == []
    assert "\nother processes\n" not in text and "<th style='text-align:right'>pid</th>" not in html


# --------------------------------------------------------------------------- issue 14.5: the local check applies too

_SMALL_MACHINE = r'''
import resource, sys
import psutil, torch
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from transformers import AutoModelForCausalLM

ip = start_ipython()
ip.run_line_magic("load_ext", "oom_magic")
ip.user_ns.update(torch=torch, AutoModelForCausalLM=AutoModelForCausalLM, path=sys.argv[1])
# A real limit on this process (ulimit -v): 150 MiB more address space than it uses now, so the
# float32 load (~360 MiB) fits an 80 GiB target but not this "machine".
vms = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vms + 150 * 2**20, resource.RLIM_INFINITY))
try:
    ip.run_cell_magic("guardload", "--strict --target H100-80GB --headroom 0",
                      "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)")
    print("RAN", "model" in ip.user_ns)
except UsageError as exc:
    print("REFUSED", exc)
'''


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Llama of ~360 MiB in float32, saved as bfloat16 safetensors."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "mid"
    LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
                     ).to(torch.bfloat16).save_pretrained(path)
    return path


def test_strict_target_refuses_a_load_this_machine_cannot_hold_and_says_which(mid_llama, tmp_path):
    script = tmp_path / "small_machine.py"
    script.write_text(_SMALL_MACHINE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    # ~10 s here (40 s with the machine busy); a child that hangs fails the test within 2 minutes, not 5
    done = subprocess.run([sys.executable, str(script), str(mid_llama)], capture_output=True, text=True,
                          timeout=120, env=env)
    out = done.stdout
    assert "REFUSED" in out, out + done.stderr[-2000:]
    assert "fits on an H100-80GB" in out or "fits on H100-80GB" in out
    assert "will not fit on this machine (RAM), where the cell runs" in out
    assert "and here (RAM, where the cell runs)" in out and "WILL NOT FIT" in out  # the preflight said both
    assert "ran uncapped" not in out
