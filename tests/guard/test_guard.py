"""%%guardload and guard_load() in a real IPython shell with real CPU out-of-memory errors.

A CPU allocation of 1 PiB fails for real ("DefaultCPUAllocator: can't allocate memory"). For a
load that fits after the give-back, the address-space limit (RLIMIT_AS, what ``ulimit -v`` sets)
is lowered for a moment so that a 384 MiB allocation really fails while a stale 512 MiB is held,
and really succeeds once it is freed. CUDA-only pieces are checked against a fake torch.cuda
surface (tests/fakes/fake_torch_cuda.py), since the test machines have no GPU.
"""
from __future__ import annotations

import gc
import os
import pickle
import resource
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from transformers import LlamaConfig, LlamaForCausalLM

from oom_magic import guard_load
from oom_magic.common.errors import OomMagicError
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.device.allocator import (allocator_setting, apply_allocator_setting, cuda_peak_read, cuda_peak_start,
                                 dump_history, largest_free_block, start_history, stop_history)
from oom_magic.fit.preflight import cuda_process_cap
from oom_magic.render.guard import guard_report_html
from oom_magic.render.units import format_bytes
from tests.fakes.fake_torch_cuda import FakeTorch, FakeTorchCuda

MiB = 2**20
PIB = 1 << 50

OOM_CELL = (
    "def load():\n"
    "    partial = torch.ones(64 << 20, dtype=torch.uint8)  # the part that loaded\n"
    "    refs.append(weakref.ref(partial))\n"
    "    return torch.empty(1 << 50, dtype=torch.uint8)  # the part that does not fit\n"
    "model = load()\n"
)


@pytest.fixture
def torch_ip(ip):
    ip.run_cell("import torch, weakref\nrefs = []", store_history=True)
    return ip


@contextmanager
def address_space_headroom(nbytes: int) -> Iterator[None]:
    """Let this process map only ``nbytes`` more (RLIMIT_AS, as ``ulimit -v`` does), then restore."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _magics(ip) -> Any:
    return ip.magics_manager.registry["OomMagics"]


# --------------------------------------------------------------------------- a real CPU out-of-memory


def test_cpu_oom_prints_gives_back_diagnoses_and_raises_short(torch_ip, capsys):
    with pytest.raises(RuntimeError) as info:
        torch_ip.run_cell_magic("guardload", "--device cpu", OOM_CELL)
    short = info.value
    assert type(short) is RuntimeError
    assert "\n" not in str(short)
    assert str(short).startswith("cpu out of memory: tried to allocate 1024.00 TiB with ")
    report = short.oom_report
    # 64 MiB of the failed load, plus whatever stale tensors of earlier cells died meanwhile
    back = format_bytes(report.give_back.total)
    assert f"%%guardload gave back {back}; most likely: the load is too big" in str(short)

    assert report.outcome == "oom" and report.device == "cpu" and len(report.attempts) == 1
    oom = report.oom
    assert (oom.backend, oom.requested, oom.total, oom.free) == ("cpu", PIB, None, None)
    # The partial weights allocated in the function before the failure are gone.
    assert torch_ip.user_ns["refs"][0]() is None
    give_back = report.give_back
    assert give_back.failed_load_bytes == 64 * MiB and give_back.still_held_bytes == 0
    assert give_back.frames_cleared >= 2
    assert give_back.process_freed >= 48 * MiB  # resident memory really fell (less what the give-back itself allocates)
    diagnosis = report.diagnosis
    assert diagnosis.requested == PIB and diagnosis.top.kind == "too-big"
    assert diagnosis.top.figure("total") == psutil.virtual_memory().total
    assert diagnosis.cause("partial-load").figure("given_back") == 64 * MiB
    assert (diagnosis.retry.can_fit, diagnosis.retry.reason) == (False, "still-short")
    assert "model" not in torch_ip.user_ns  # the cell failed: nothing was bound

    out = capsys.readouterr().out
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes" in out
    assert out.index("torch.empty(1 << 50") < out.index("give-back: ") < out.index("diagnosis (cpu): asked for 1024.00 TiB")
    assert "freed 64.00 MiB of the failed load's tensors on cpu" in out


def test_run_cell_shows_one_line_and_keeps_no_frames(torch_ip, capsys):
    result = torch_ip.run_cell("%%guardload --device cpu\n" + OOM_CELL, store_history=True)
    short = result.error_in_exec
    assert isinstance(short, RuntimeError) and short.oom_report.outcome == "oom"
    assert torch_ip.user_ns["refs"][0]() is None
    out = capsys.readouterr().out
    assert f"Cell In[{result.execution_count}], line 5" in out  # the traceback names the cell as its prompt did
    shown = out[out.index("diagnosis (cpu)"):]
    assert f"RuntimeError: {short}" in shown  # IPython prints the short error as one line
    assert "Traceback" not in shown and "skipping hidden" not in shown
    # What IPython stored (sys.last_*) is the short error: its frames hold no tensors.
    assert sys.last_value is short


def test_retry_runs_again_when_the_give_back_made_room(torch_ip, capsys):
    # An earlier unguarded load failed; its traceback (sys.last_*) still holds 512 MiB of partial weights.
    torch_ip.run_cell("def failed_load():\n"
                      "    part = torch.ones(512 << 20, dtype=torch.uint8)\n"
                      "    return torch.empty(1 << 50, dtype=torch.uint8)\n"
                      "failed_load()", store_history=True)
    assert sys.last_value is not None
    with address_space_headroom(256 * MiB):
        report = torch_ip.run_cell_magic("guardload", "--device cpu --no-cleanup --retry 1 --headroom 0",
                                         "x = torch.ones(384 << 20, dtype=torch.uint8)\n")
    assert report.outcome == "ok" and [a.outcome for a in report.attempts] == ["oom", "ok"] and report.retries == 1
    first = report.attempts[0]
    assert first.oom.requested == 384 * MiB
    assert first.give_back.stale_bytes == 512 * MiB and first.give_back.dropped_last_exception
    diagnosis = first.diagnosis
    assert diagnosis.top.kind == "stale" and diagnosis.top.figure("stale_given_back") == 512 * MiB
    assert diagnosis.cause("other-processes") is None  # the address-space limit, not RAM, ran out
    assert diagnosis.retry.can_fit and diagnosis.retry.need == 384 * MiB
    # free at the failure: the 256 MiB of headroom (and what trimming the C heap unmapped), short of the 384 MiB
    assert diagnosis.retry.free_now >= 700 * MiB and diagnosis.free < 384 * MiB
    assert report.variable("x").bytes == 384 * MiB and torch_ip.user_ns["x"].numel() == 384 * MiB
    out = capsys.readouterr().out
    assert "→ retry 2 of 2: running the cell again" in out
    assert out.count("running the cell again needs at least") == 1  # the figures are said once, in the diagnosis
    assert not hasattr(sys, "last_value")


def test_no_retry_when_the_same_load_cannot_fit(torch_ip, capsys):
    with pytest.raises(RuntimeError) as info:
        torch_ip.run_cell_magic("guardload", "--device cpu --retry 3", OOM_CELL)
    assert len(info.value.oom_report.attempts) == 1
    out = capsys.readouterr().out
    assert "retry: running the cell again needs at least 1024.00 TiB" in out and "\n→ no retry\n" in out
    assert out.count("running the cell again needs at least") == 1  # said once, not again as "no retry: ..."


def test_guard_raise_false_only_prints(torch_ip, capsys):
    _magics(torch_ip).guard_raise = False
    report = torch_ip.run_cell_magic("guardload", "--device cpu", OOM_CELL)
    assert report.outcome == "oom" and report.give_back.failed_load_bytes == 64 * MiB
    assert "diagnosis (cpu)" in capsys.readouterr().out


# --------------------------------------------------------------------------- a load that fits


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("guard") / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256)).save_pretrained(path)
    return path


def test_a_real_model_load_reports_its_cost_and_variables(torch_ip, tiny_llama, capsys):
    torch_ip.user_ns["path"] = str(tiny_llama)
    cell = ("from transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)\n")
    report = torch_ip.run_cell_magic("guardload", "", cell)
    estimate = estimate_checkpoint(tiny_llama)
    assert report.outcome == "ok" and report.device == "cpu"
    (check,) = report.preflight.checks
    assert check.verdict == "fits" and check.need == estimate.bytes_for("bfloat16")
    model = torch_ip.user_ns["model"]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}
    use = report.variable("model")
    assert (use.change, use.dtype, use.bytes) == ("new", "bfloat16", sum(held.values()))
    assert use.by_device == (("cpu", sum(held.values())),)
    assert report.peak.measure == "resident" and report.peak.bytes >= report.before.process_used
    assert report.seconds > 0 and report.delta is not None
    out = capsys.readouterr().out
    assert "→ fits," in out


def test_cell_runs_in_the_user_namespace_and_reports_new_tensors(torch_ip):
    report = torch_ip.run_cell_magic("guardload", "--device cpu --quiet", "x = torch.ones(1000, 1000)\ny = 3\n")
    assert torch_ip.user_ns["y"] == 3
    assert report.variable("x").bytes == 4_000_000 and report.variable("x").dtype == "float32"
    assert report.variable("y") is None  # no device memory
    assert report.tensor_delta == 4_000_000
    assert report.peak.above_start is not None and report.peak.above_start >= 0
    from oom_magic.render.guard import run_summary_text

    assert "x: 3.81 MiB float32 on cpu (new)" in run_summary_text(report)
    assert "\n" not in repr_pretty(report)  # --quiet: the report shows as its one summary line


def repr_pretty(obj: object) -> str:
    from IPython.lib.pretty import pretty

    return pretty(obj)


def test_quiet_prints_nothing_before_a_load_that_fits(torch_ip, capsys):
    torch_ip.run_cell_magic("guardload", "--device cpu --quiet", "a = 1\n")
    assert capsys.readouterr().out == ""


def test_a_non_oom_error_behaves_as_usual(torch_ip):
    with pytest.raises(ValueError, match="^no such checkpoint$"):
        torch_ip.run_cell_magic("guardload", "--device cpu", "before = 1\nraise ValueError('no such checkpoint')\n")
    assert torch_ip.user_ns["before"] == 1
    report = _magics(torch_ip)  # the magic keeps no report of its own; the error went through untouched
    assert report is not None


def test_cleanup_before_the_load_frees_the_output_cache(torch_ip):
    torch_ip.run_cell("torch.ones(256, 1024)", store_history=True)  # Out[n] holds 1 MiB
    kept = torch_ip.run_cell_magic("guardload", "--device cpu --no-cleanup", "a = 1\n")
    assert kept.cleanup is None
    report = torch_ip.run_cell_magic("guardload", "--device cpu", "b = 1\n")
    assert report.cleanup.freed_bytes == MiB and report.cleanup.kind_bytes("output-cache") == MiB


def test_snapshot_needs_cuda(torch_ip):
    report = torch_ip.run_cell_magic("guardload", "--device cpu --snapshot /tmp/x.pickle --quiet", "a = 1\n")
    assert report.snapshot == ("--snapshot records the CUDA allocator's history; cpu has none, so nothing was recorded")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("line, message", [
    ("--headroom 10XB", "cannot read headroom '10XB'"),
    ("--retry -1", "--retry must be 0 or more, not -1"),
    ("--device tpu", "unknown device 'tpu': this machine has cpu"),
    ("--bogus", "unrecognized arguments: --bogus"),
])
def test_bad_flags_are_one_line_usage_errors(torch_ip, line, message):
    with pytest.raises(UsageError) as info:
        torch_ip.run_cell_magic("guardload", line, "a = 1\n")
    assert message in str(info.value) and "\n" not in str(info.value).strip()
    assert "a" not in torch_ip.user_ns


def test_an_empty_cell_is_a_usage_error(torch_ip):
    with pytest.raises(UsageError, match="needs a cell body"):
        torch_ip.run_cell_magic("guardload", "", "  \n")


def test_strict_refuses_a_load_that_will_not_fit(torch_ip, tiny_llama):
    torch_ip.user_ns["path"] = str(tiny_llama)
    cell = "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)\n"
    with pytest.raises(UsageError) as info:
        torch_ip.run_cell_magic("guardload", "--strict --headroom 1TiB", cell)
    message = str(info.value)
    need = format_bytes(estimate_checkpoint(tiny_llama).bytes_for("bfloat16"))
    # the float32 file cast to bfloat16: the RAM peak (new copy beside the file pages read) is the need
    assert message.startswith("--strict: line 1 will not fit on cpu: needs ") and "\n" not in message
    assert f"at the load's RAM peak (copies beside the file pages read; {need} once loaded), " in message
    assert "model" not in torch_ip.user_ns


def test_every_argument_has_help(torch_ip):
    parser = _magics(torch_ip).guardload.parser
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} == {"device", "retry", "strict", "headroom", "snapshot", "target", "no_cleanup",
                                       "no_expandable", "quiet", "context", "prompt", "batch", "train", "lora_r"}
    assert all(a.help for a in flags)


# --------------------------------------------------------------------------- guard_load for scripts


def test_with_guard_load_measures_a_load(capsys, fresh_heap):  # fresh_heap: no earlier test's garbage is stale
    ns: dict[str, Any] = {}
    with guard_load(device="cpu", namespace=ns) as guard:
        ns["w"] = torch.ones(1000)
    report = guard.report
    assert report.outcome == "ok" and report.variable("w").bytes == 4000 and report.label == "guard_load"
    assert "cleanup: nothing stale to free on cpu" in capsys.readouterr().out


def test_with_guard_load_on_oom_gives_back_and_raises_short():
    refs: list[weakref.ref] = []

    def load() -> None:
        partial = torch.ones(32 << 20, dtype=torch.uint8)
        refs.append(weakref.ref(partial))
        torch.empty(PIB, dtype=torch.uint8)

    with pytest.raises(RuntimeError) as info:
        with guard_load(device="cpu", namespace={}, quiet=True):
            load()
    assert refs[0]() is None
    report = info.value.oom_report
    assert report.give_back.failed_load_bytes == 32 * MiB and report.oom.requested == PIB
    assert str(info.value).startswith("cpu out of memory: tried to allocate 1024.00 TiB") and "guard_load gave back" in str(info.value)


def test_with_cannot_retry_but_run_can(capsys, fresh_heap):  # the stale bytes are exactly this test's
    with pytest.raises(OomMagicError, match="a with-block runs once"):
        with guard_load(device="cpu", retry=1, namespace={}):
            pass

    def failed_load() -> None:
        part = torch.ones(512 << 20, dtype=torch.uint8)  # noqa: F841 - held by the stored traceback
        torch.empty(PIB, dtype=torch.uint8)

    try:
        failed_load()
    except RuntimeError as exc:  # as an interactive session would keep it
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    guard = guard_load(device="cpu", retry=1, cleanup=False, headroom=0, namespace={})
    with address_space_headroom(256 * MiB):
        value = guard.run(torch.ones, 384 << 20, dtype=torch.uint8)
    assert value.numel() == 384 * MiB
    assert [a.outcome for a in guard.report.attempts] == ["oom", "ok"]
    assert guard.report.attempts[0].give_back.stale_bytes == 512 * MiB


def test_the_loop_form_stops_when_a_retry_cannot_help():
    attempts = 0
    with pytest.raises(RuntimeError) as info:
        for attempt in guard_load(device="cpu", retry=2, namespace={}, quiet=True):
            with attempt:
                attempts += 1
                torch.empty(PIB, dtype=torch.uint8)
    assert attempts == 1 and len(info.value.oom_report.attempts) == 1
    ok = guard_load(device="cpu", retry=2, namespace={}, quiet=True)
    for attempt in ok:
        with attempt:
            pass
    assert ok.report.outcome == "ok" and len(ok.report.attempts) == 1


def test_the_report_html_escapes_names_and_errors():
    ns: dict[str, Any] = {}
    with guard_load(device="cpu", namespace=ns, quiet=True) as guard:
        ns["<script>x</script>"] = torch.ones(10)
    html = guard_report_html(guard.report)
    assert "<script>" not in html and "&lt;script&gt;" in html


# --------------------------------------------------------------------------- allocator setting


def test_allocator_setting_turns_on_expandable_segments_only_when_it_can_apply():
    env: dict[str, str] = {}
    setting = allocator_setting(env, "cuda:0", initialized=False)
    assert (setting.action, setting.enabled) == ("set", True)
    # the name every torch reads (2.9 ignores expandable_segments in PYTORCH_ALLOC_CONF for CUDA)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert allocator_setting(env, "cuda:0", initialized=False).value == "max_split_size_mb:128,expandable_segments:True"
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}  # read first by torch: extended, not shadowed
    assert allocator_setting(env, "cuda:0", initialized=False).variable == "PYTORCH_ALLOC_CONF"
    assert env == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert allocator_setting(env, "cuda:0", initialized=False).action == "user-off"
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "cuda:0", False).action == "already-on"
    env = {}
    assert allocator_setting(env, "cuda:0", initialized=True).action == "needs-restart" and env == {}
    assert allocator_setting(env, "cuda:0", initialized=False, enabled=False).action == "off" and env == {}
    assert allocator_setting(env, "cpu", initialized=False).action == "not-cuda" and env == {}


def test_a_just_set_allocator_variable_reaches_an_already_imported_torch():
    class FakeC:
        """FAKE torch._C: records what _accelerator_setAllocatorSettings receives."""

        def __init__(self) -> None:
            self.settings: list[str] = []

        def _accelerator_setAllocatorSettings(self, value: str) -> None:
            self.settings.append(value)

    class FakeTorchModule:
        """FAKE torch module with only ``_C``."""

        _C = FakeC()

    fake = FakeTorchModule()
    setting = allocator_setting({}, "cuda:0", initialized=False)
    assert apply_allocator_setting(fake, setting) is None and fake._C.settings == ["expandable_segments:True"]
    assert apply_allocator_setting(fake, allocator_setting({}, "cuda:0", initialized=True)) is None
    assert fake._C.settings == ["expandable_segments:True"]  # nothing passed when it could not be set


# --------------------------------------------------------------------------- CUDA pieces, on a fake


def _block(size: int, state: str) -> dict[str, Any]:
    return {"address": 0, "size": size, "requested_size": size, "state": state, "frames": []}


# torch.cuda.memory_snapshot()'s shape (torch 2.x), for the FAKE torch.cuda below.
SEGMENTS = [
    {"device": 0, "address": 1 << 30, "total_size": 20 * MiB, "allocated_size": 6 * MiB, "active_size": 6 * MiB,
     "segment_type": "large", "blocks": [_block(6 * MiB, "active_allocated"), _block(14 * MiB, "inactive")]},
    {"device": 0, "address": 2 << 30, "total_size": 20 * MiB, "allocated_size": 0, "active_size": 0,
     "segment_type": "large", "blocks": [_block(20 * MiB, "active_pending_free")]},
    {"device": 1, "address": 3 << 30, "total_size": 64 * MiB, "allocated_size": 0, "active_size": 0,
     "segment_type": "large", "blocks": [_block(64 * MiB, "inactive")]},
]


def fake_cuda(initialized: bool = True, peak: int = 0, fraction: float = 1.0) -> FakeTorchCuda:
    """The FAKE torch.cuda (tests/fakes) as these tests use it: one 80 GiB device, SEGMENTS in its snapshot."""
    return FakeTorchCuda(80 * 2**30, initialized=initialized, peak=peak, fraction=fraction, segments=SEGMENTS)


def test_largest_free_block_reads_inactive_blocks_of_one_device():
    segments = fake_cuda().memory_snapshot()
    assert largest_free_block(segments, 0) == 14 * MiB  # pending-free and active blocks are not free
    assert largest_free_block(segments, 1) == 64 * MiB
    assert largest_free_block([], 0) is None


def test_cuda_peak_is_read_without_resetting_the_users_counter():
    # issue 14 point 6: reset_peak_memory_stats() would clobber the user's max_memory_allocated().
    ready = fake_cuda(initialized=True, peak=30 * MiB)
    mark = cuda_peak_start(FakeTorch(ready), 0)
    assert mark == 30 * MiB and ready.calls == []  # read, never reset
    ready.hold(45 * MiB)  # the cell pushed the mark up
    peak = cuda_peak_read(FakeTorch(ready), 0, True, 10 * MiB, mark, 20 * MiB)
    assert (peak.bytes, peak.above_start, peak.measure) == (45 * MiB, 35 * MiB, "allocated")
    assert "never reset" in peak.note and ready.calls == []
    under = cuda_peak_read(FakeTorch(ready), 0, True, 10 * MiB, 45 * MiB, 20 * MiB)
    assert under.bytes is None and "earlier allocator peak" in under.note  # unknown, said so
    cold = fake_cuda(initialized=False)
    assert cuda_peak_start(FakeTorch(cold), 0) is None and cold.calls == []  # no context is created
    assert cuda_peak_read(FakeTorch(cold), 0, False, 0).bytes is None
    cold.init()  # CUDA initialized inside the cell
    cold.hold(12 * MiB)
    during = cuda_peak_read(FakeTorch(cold), 0, was_initialized=False, allocated_before=0)
    assert (during.bytes, during.above_start) == (12 * MiB, 12 * MiB) and "since CUDA initialized" in during.note


def test_allocator_history_start_dump_stop(tmp_path):
    cuda = fake_cuda()
    fake = FakeTorch(cuda)
    assert start_history(fake) is None
    written = dump_history(fake, tmp_path)  # a folder: a timestamped file inside it
    assert Path(written).parent == tmp_path and Path(written).name.startswith("oom-snapshot-")
    with open(written, "rb") as handle:
        assert len(pickle.load(handle)["segments"]) == 3
    stop_history(fake)
    assert [c[0] for c in cuda.calls] == ["record", "dump", "record"]
    assert cuda.calls[0][1] == ("all", 100_000) and cuda.calls[2][1][0] is None
    cold = fake_cuda(initialized=False)
    assert start_history(FakeTorch(cold)) is None
    assert [c[0] for c in cold.calls] == ["init", "record"]  # recording needs the allocator set up


def test_the_per_process_memory_fraction_caps_what_this_process_may_use():
    assert cuda_process_cap("cuda:0", FakeTorch(fake_cuda(fraction=0.025))) == int(80 * 2**30 * 0.025)
    assert cuda_process_cap("cuda:0", FakeTorch(fake_cuda(fraction=1.0))) is None  # no cap
    assert cuda_process_cap("cuda:0", FakeTorch(fake_cuda(initialized=False, fraction=0.5))) is None  # no context made
    assert cuda_process_cap("cpu", FakeTorch(fake_cuda(fraction=0.5))) is None



def test_a_guarded_cell_keeps_its_peak_on_the_timeline(torch_ip):
    """The guard resets VmHWM to measure its own peak; the after-cell record takes the guard's figure."""
    result = torch_ip.run_cell("%%guardload --quiet\nw = torch.ones(16 << 20)\nw.add_(1);\n", store_history=True)
    report = result.result
    record = _magics(torch_ip).cell_watch.watcher.history[-1]
    assert record.label == "%%guardload" and report.peak.measure == "resident"
    assert record.peak is not None and record.peak >= report.peak.bytes
