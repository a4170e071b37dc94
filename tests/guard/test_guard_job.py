"""%%guardload sizes the job its cell is for, and says after the load how much context fits now.

A real IPython shell and a real tiny Llama (GQA) saved locally. Every figure is held to the real
thing on the cpu: the KV cache to a real generate's cache, the adapters to peft's, gradients and
optimizer state to a real AdamW step, the growth per token to real caches of two lengths.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from IPython.core.error import UsageError

from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.fit.context_room import RoomProbe, context_room
from oom_magic.fit.job_fit import job_fit
from oom_magic.fit.preflight import preflight_check
from oom_magic.records.job import Job
from tests.sizing.families import build, cache_storage_bytes

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("guard_job")  # one worker builds the module's model

LOAD = ("from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(path)\n")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("guard_job") / "llama"
    build("llama-gqa").save_pretrained(folder)
    return folder


@pytest.fixture
def shell(ip, llama):
    ip.run_cell("import torch")
    ip.user_ns["path"] = str(llama)
    return ip


def _real_cache(model, tokens: int, batch: int = 1) -> int:
    with torch.no_grad():
        return cache_storage_bytes(model(input_ids=torch.randint(3, 256, (batch, tokens)), use_cache=True).past_key_values)


def _storages(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_generate_in_the_cell_is_sized_as_the_real_generate_holds_it(shell, llama):
    shell.user_ns["ids"] = torch.tensor([[5]])  # a tensor: its length is not read from the cell
    cell = LOAD + "out = model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, " \
                  "return_dict_in_generate=True)\n"
    report = shell.run_cell_magic("guardload", "", cell)
    (check,) = report.preflight.checks
    assert check.call.job == Job(context=9) and check.verdict == "fits"
    real = cache_storage_bytes(shell.user_ns["out"].past_key_values)  # a one-token prompt and 9 new tokens
    assert check.job.parts.kv_cache == job_fit(llama, Job(context=9), "T4").parts.kv_cache == real > 0
    assert check.job.parts.weights == estimate_checkpoint(llama, "auto").bytes == check.need
    assert check.job.target == "cpu" and check.job.usable == check.budget
    assert check.peak_need == max(check.need, check.ram_peak or 0, check.job.parts.total)
    text = str(report.preflight)
    assert "job: inference at context 9, batch 1: weights " in text and "→ fits with its job (" in text
    assert "the prompt's length is known only when the cell runs" in text


def test_a_literal_prompt_is_read_and_its_batch_too(shell):
    cell = LOAD + "out = model.generate(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), max_new_tokens=6, " \
                  "min_new_tokens=6, do_sample=False, return_dict_in_generate=True)\n"
    report = shell.run_cell_magic("guardload", "--quiet", cell)
    (check,) = report.preflight.checks
    assert check.call.job == Job(context=4 + 6 - 1, batch=2, prompt=4) and check.call.notes == ()
    assert check.job.parts.kv_cache == cache_storage_bytes(shell.user_ns["out"].past_key_values)


def test_context_flag_overrides_the_cell_and_sizes_that_cache(shell):
    shell.user_ns["ids"] = torch.tensor([[5]])
    report = shell.run_cell_magic("guardload", "--context 32 --quiet", LOAD + "out = model.generate(ids, max_new_tokens=9)\n")
    (check,) = report.preflight.checks
    assert check.call.job == Job(context=32)
    assert not any("--context" in n for n in check.call.notes)
    assert check.job.parts.kv_cache == _real_cache(shell.user_ns["model"], 32)


def test_training_arguments_size_an_adamw_fine_tune_at_their_batch(shell, tmp_path):
    pytest.importorskip("accelerate")
    shell.user_ns["out"] = str(tmp_path)
    cell = LOAD + ("from transformers import TrainingArguments\n"
                   "args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, optim='adamw_torch', "
                   "report_to=[])\n")
    report = shell.run_cell_magic("guardload", "--quiet", cell)
    (check,) = report.preflight.checks
    job = check.call.job
    assert (job.train, job.batch, job.context) == ("adamw", 4, 1) and shell.user_ns["args"].per_device_train_batch_size == 4
    model = shell.user_ns["model"].train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 256, (4, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]  # steps stay on the host
    assert check.job.parts.gradients == _storages(p.grad for p in model.parameters()) > 0
    assert check.job.parts.optimizer == _storages(state) > 0 and check.job.parts.kv_cache == 0
    assert "job: fine-tune (adamw) at context 1, batch 4: weights " in str(report.preflight)


def test_lora_config_sizes_the_adapters_peft_adds(shell):
    pytest.importorskip("peft")
    cell = LOAD + ("from peft import LoraConfig, get_peft_model\n"
                   "model = get_peft_model(model, LoraConfig(r=8, target_modules=['q_proj', 'v_proj'], "
                   "task_type='CAUSAL_LM'))\n")
    report = shell.run_cell_magic("guardload", "--quiet", cell)
    (check,) = report.preflight.checks
    assert (check.call.job.train, check.call.job.lora_r, check.call.job.lora_targets) == ("lora", 8, ("q_proj", "v_proj"))
    adapters = _storages(p for p in shell.user_ns["model"].parameters() if p.requires_grad)
    assert (check.job.parts.adapters, check.job.parts.gradients, check.job.parts.optimizer) == (
        adapters, adapters, 2 * adapters)


@pytest.mark.parametrize("line, message", [
    ("--context 0", "context must be a whole number of at least 1, not 0"),
    ("--batch -3", "batch must be a whole number of at least 1, not -3"),
    ("--train adam", "unknown training kind 'adam': use one of adamw, sgd, adamw8bit, lora, qlora"),
    ("--lora-r 0", "lora_r must be a whole number of at least 1, not 0"),
    ("--context many", "argument --context: invalid int value: 'many'"),
])
def test_a_bad_job_flag_is_a_one_line_usage_error(shell, line, message):
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("guardload", line, LOAD)
    assert message in str(info.value) and "\n" not in str(info.value).strip()
    assert "model" not in shell.user_ns


def test_strict_refuses_a_job_that_does_not_fit_the_target_though_its_weights_do(shell):
    target = "--target 1269MiB --headroom 0"  # 1 MiB usable: the table's driver share and CUDA context are 1268 MiB
    weights = shell.run_cell_magic("guardload", f"{target} --quiet", LOAD)
    (check,) = weights.preflight.checks
    assert check.verdict == "fits" and check.job is None and check.need < 2**20
    del shell.user_ns["model"]
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("guardload", f"--strict {target} --context 4096", LOAD)
    message = str(info.value)
    assert message.startswith("--strict: line 2 will not fit on a 1269MiB GPU: needs ") and "\n" not in message
    assert "for its job (inference at context 4,096, batch 1)" in message
    assert "model" not in shell.user_ns


def test_a_job_is_checked_against_this_machines_ram(shell, llama):
    batch = 10_000_000  # a cache of terabytes: more than any test machine's RAM
    report = shell.run_cell_magic("guardload", f"--quiet --context 512 --prompt 1 --batch {batch}", LOAD)
    (check,) = report.preflight.checks
    assert check.device == "cpu" and check.verdict == "will-not-fit" and check.job.target == "cpu"
    assert check.need <= check.budget < check.job.needed == check.peak_need  # the weights alone fit
    assert check.job.parts.kv_cache == batch * _real_cache(shell.user_ns["model"], 512)
    with pytest.raises(UsageError, match=r"^--strict: line 2 will not fit on cpu: needs .* for its job "
                                         r"\(inference at context 512, prompt 1, batch 10000000\)"):
        shell.run_cell_magic("guardload", f"--strict --context 512 --prompt 1 --batch {batch}", LOAD)


def test_after_the_load_the_report_says_how_much_context_fits_now(shell):
    report = shell.run_cell_magic("guardload", "", LOAD)
    room = report.context_room
    model = shell.user_ns["model"]
    # the growth per token, as two real caches of different lengths show it (batch 1, float32)
    assert room.per_token == (_real_cache(model, 65) - _real_cache(model, 1)) / 64 > 0
    assert (room.batch, room.dtype, room.free) == (1, "float32", report.after.free)
    assert room.tokens == report.after.free // room.per_token
    assert f"room for {room.tokens:,} tokens of KV cache at batch 1 (float32) now: " in str(report)


def test_the_room_is_at_the_jobs_batch(shell):
    shell.user_ns["ids"] = torch.tensor([[5]])
    report = shell.run_cell_magic("guardload", "--batch 3", LOAD + "out = model.generate(ids.repeat(3, 1), max_new_tokens=4)\n")
    room = report.context_room
    model = shell.user_ns["model"]
    assert room.batch == 3 and room.per_token == (_real_cache(model, 68, 3) - _real_cache(model, 4, 3)) / 64
    assert room.tokens == report.after.free // room.per_token


def test_the_room_sized_in_a_thread_while_the_cell_runs_is_the_same(shell, llama):
    # the guard starts it before a load to a GPU; here the same probe, started and then waited for
    preflight = preflight_check(LOAD, {"path": str(llama)})
    probe = RoomProbe(preflight)
    probe.start()
    room = probe.room(10**9, "cuda:0")
    assert not probe._thread.is_alive() and room == context_room(preflight, 10**9, "cuda:0")
    model = build("llama-gqa")
    assert room.per_token == (_real_cache(model, 65) - _real_cache(model, 1)) / 64
    assert room.tokens == 10**9 // room.per_token and room.device == "cuda:0"


def test_without_a_transformers_load_there_is_no_room_line(shell):
    report = shell.run_cell_magic("guardload", "--device cpu", "x = torch.ones(1000)\n")
    assert report.context_room is None and "KV cache" not in str(report)
