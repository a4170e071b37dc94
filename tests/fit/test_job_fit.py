"""A job's fit check from the command (`oom-magic fit --context/--train --target`) and `fit_check(context=)`.

A real tiny Llama (GQA) saved locally; the figures in the output are compared with a real cache
after a real prompt's forward, and with peft's real adapters.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import oom_magic
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.common.errors import OomMagicError
from oom_magic.records.job import JobFit
from tests.fit.command import fit_here, fit_process
from tests.sizing.families import build, cache_storage_bytes

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("job") / "llama"
    model = build("llama-gqa")
    model.save_pretrained(folder)
    return folder, model


_fit = fit_here


def test_inference_json_carries_parts_equal_to_a_real_cache_and_the_weights(llama):
    folder, model = llama
    done = fit_process(str(folder), "--context", "48", "--batch", "3", "--target", "T4", "--json")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["checks"][0]
    with torch.no_grad():
        real = model(input_ids=torch.randint(3, 256, (3, 48)), use_cache=True).past_key_values
    assert check["parts"] == {"weights": estimate_checkpoint(folder, "auto").bytes,
                              "kv_cache": cache_storage_bytes(real), "activations": check["parts"]["activations"],
                              "gradients": 0, "optimizer": 0, "adapters": 0, "optimizer_step": 0}
    assert check["parts"]["activations"] > 0  # held to the profiler in tests/sizing/test_activations.py
    assert check["fits"] is True and check["per_device"] == [] and check["largest_batch"] > 3


def test_a_job_too_large_for_the_gpu_exits_1_and_says_how_many_would_do(llama):
    # how many: the fewest GPUs whose device_map="auto" split fits (tests/sizing/test_device_split.py
    # holds the split to accelerate's map and real caches); a GPU holds whole layers, so a job whose
    # one layer's cache outgrows a GPU fits on none
    folder, _ = llama
    job = ["--context", "64", "--prompt", "8", "--batch", "300000"]
    done = _fit(str(folder), *job, "--target", "T4")
    assert done.returncode == 1, done.stderr
    assert "will not fit" in done.stdout and "KV cache" in done.stdout
    check = json.loads(_fit(str(folder), *job, "--target", "T4", "--json").stdout)["checks"][0]
    assert check["gpus_needed"] == 2 and "needs 2xT4" in done.stdout
    assert check["needed"] > check["usable"]
    two = json.loads(_fit(str(folder), *job, "--target", "2xT4", "--json").stdout)["checks"][0]
    assert two["fits"] and max(two["per_device"]) <= two["usable"] < check["needed"]
    assert "largest batch at context 64: " in done.stdout and "cuBLAS/cuDNN handles" in done.stdout
    none = _fit(str(folder), "--context", "64", "--batch", "1000000", "--target", "T4")
    assert none.returncode == 1 and 'no device_map="auto" split over up to 64xT4 fits' in none.stdout


def test_lora_over_two_gpus_reports_adapters_and_a_share_per_gpu(llama):
    peft = pytest.importorskip("peft")
    folder, model = llama
    fit = oom_magic.fit_check(folder, target="2xA10G", context=32, train="lora", lora_r=4)
    assert isinstance(fit, JobFit) and fit.job.gpus == 2
    wrapped = peft.get_peft_model(build("llama-gqa"), peft.LoraConfig(r=4, task_type="CAUSAL_LM"))
    adapters = sum(p.numel() * p.element_size() for p in wrapped.parameters() if p.requires_grad)
    assert (fit.parts.adapters, fit.parts.gradients, fit.parts.optimizer) == (adapters, adapters, 2 * adapters)
    assert fit.parts.kv_cache == 0 and len(fit.parts.per_device) == 2
    assert fit.parts.per_device[0] > fit.parts.total // 2  # plus the largest layer, gathered whole
    # each GPU runs its own step: its activations are whole on each, not halved
    assert fit.parts.activations is not None and fit.parts.per_device[0] - fit.parts.activations > \
        (fit.parts.total - fit.parts.activations) // 2


@pytest.mark.parametrize("args,message", [
    (["--context", "0", "--target", "T4"], "context must be a whole number of at least 1"),
    (["--context", "64"], "needs --target GPU"),
    (["--context", "64", "--target", "0xT4"], "GPU count must be between 1 and 64"),
    (["--train", "lora", "--lora-r", "0", "--target", "T4"], "lora_r must be a whole number"),
])
def test_bad_job_input_is_one_line_and_exit_2(llama, args, message):
    done = _fit(str(llama[0]), *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_fit_check_without_a_target_names_the_fix(llama):
    with pytest.raises(OomMagicError, match="sizing a job needs target="):
        oom_magic.fit_check(llama[0], context=128)


def test_the_largest_context_is_the_last_that_fits_when_sized_again(tmp_path):
    from oom_magic.fit.job_fit import _verdict
    from oom_magic.records.job import Job
    from oom_magic.sizing.parts import size_job

    build("llama-gqa").save_pretrained(tmp_path)
    sizing = size_job(tmp_path, Job(context=40, prompt=16))  # the prompt's forward stays the same
    usable = sizing.parts.total + 10_000  # room for a few more tokens
    largest = _verdict(str(tmp_path), Job(context=40, prompt=16), sizing, "test budget", usable).largest_context
    assert largest is not None and largest > 40
    assert size_job(tmp_path, Job(context=largest, prompt=16)).parts.total <= usable
    assert size_job(tmp_path, Job(context=largest + 1, prompt=16)).parts.total > usable


def test_a_4bit_inference_job_holds_transformers_nf4_weights_and_a_bfloat16_cache(llama):
    # "Does the 4-bit load generate at this context on a T4?": the weights as transformers quantizes
    # them (hf_rules: its own modules-not-to-convert and bitsandbytes' layout), the cache in the
    # compute dtype (here bfloat16), held to a real cache of the model cast to bfloat16.
    folder, model = llama
    fit = oom_magic.fit_check(folder, target="T4", context=40, batch=2, quantization="nf4", dtype="bfloat16")
    estimate = estimate_checkpoint(folder, follow_transformers=True)
    assert fit.parts.weights == estimate.held_by_rules("nf4", unquantized_dtype="bfloat16").bytes
    # no dtype: the config's (float32 here), as transformers 5 loads the weights it does not quantize
    as_saved = oom_magic.fit_check(folder, target="T4", context=40, batch=2, quantization="nf4")
    assert as_saved.parts.weights == estimate.held_by_rules("nf4", unquantized_dtype="float32").bytes
    half = build("llama-gqa").to(torch.bfloat16)
    with torch.no_grad():
        real = half(input_ids=torch.randint(3, 256, (2, 40)), use_cache=True).past_key_values
    assert fit.parts.kv_cache == cache_storage_bytes(real)
    done = _fit(str(folder), "--context", "40", "--batch", "2", "--target", "T4", "--quantization", "nf4",
                "--dtype", "bfloat16", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["checks"][0]["parts"]["kv_cache"] == fit.parts.kv_cache
    refused = _fit(str(folder), "--train", "adamw", "--target", "T4", "--quantization", "nf4")
    assert refused.returncode == 2 and "--train qlora" in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_a_fine_tunes_largest_batch_is_the_last_that_fits_and_its_step_is_the_real_ones(tmp_path):
    # the step is sized at batch 2 and 3; the largest batch extrapolates that growth, held here to the
    # job sized again at that batch and one more, and to a real cpu step's profiler peak at that batch
    from oom_magic.fit.job_fit import _verdict
    from oom_magic.records.job import Job
    from oom_magic.sizing.parts import size_job
    from tests.sizing.test_train_activations import _enable_checkpointing, _real_step

    model = build("llama-gqa")
    model.save_pretrained(tmp_path)
    job = Job(context=64, batch=2, train="adamw", gradient_checkpointing=True)
    sizing = size_job(tmp_path, job)
    usable = sizing.parts.total + 4 * sizing.activations_per_sequence + 1000  # room for four more sequences
    largest = _verdict(str(tmp_path), job, sizing, "test budget", usable).largest_batch
    assert largest == 6
    at_largest = size_job(tmp_path, Job(context=64, batch=largest, train="adamw", gradient_checkpointing=True))
    one_more = size_job(tmp_path, Job(context=64, batch=largest + 1, train="adamw", gradient_checkpointing=True))
    assert at_largest.parts.total <= usable < one_more.parts.total
    model.train().set_attn_implementation("eager")
    _enable_checkpointing(model)
    real, _ = _real_step(model, batch=largest)
    assert at_largest.parts.activations is not None
    assert abs(at_largest.parts.activations - real) <= 0.15 * real


def test_a_mixed_precision_checkpointed_fine_tune_from_the_command_says_which_activations(llama):
    folder, _ = llama
    args = [str(folder), "--train", "adamw", "--context", "64", "--batch", "2", "--target", "T4",
            "--gradient-checkpointing", "--mixed-precision", "bf16"]
    done = _fit(*args, "--json")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["checks"][0]
    fit = oom_magic.fit_check(folder, target="T4", context=64, batch=2, train="adamw", gradient_checkpointing=True,
                              mixed_precision="bf16")
    assert isinstance(fit, JobFit)
    assert check["job"]["gradient_checkpointing"] is True and check["job"]["mixed_precision"] == "bf16"
    assert check["parts"]["activations"] == fit.parts.activations > 0
    assert check["weight_casts"] == fit.parts.weight_casts > 0
    assert check["parts"]["weights"] == estimate_checkpoint(folder, "float32").bytes  # float32 master weights
    assert check["largest_batch"] == fit.largest_batch > 2
    text = _fit(*args).stdout
    assert "fine-tune (adamw, bf16 mixed precision, gradient checkpointing)" in text
    assert "one training step of 2 x 64 tokens, gradient checkpointing on" in text and "autocast's bf16 copies" in text


@pytest.mark.parametrize("args,message", [
    (["--context", "64", "--gradient-checkpointing", "--target", "T4"], "size a fine-tune's step: add --train"),
    (["--context", "64", "--mixed-precision", "bf16", "--target", "T4"], "size a fine-tune's step: add --train"),
    (["--train", "qlora", "--mixed-precision", "bf16", "--target", "T4"], "leave out mixed_precision"),
    (["--train", "adamw", "--mixed-precision", "bf16", "--dtype", "bfloat16", "--target", "T4"],
     "holds the weights in float32"),
    (["--train", "adamw", "--mixed-precision", "fp8", "--target", "T4"], "invalid choice: 'fp8'"),
])
def test_a_steps_options_out_of_place_are_one_line_and_exit_2(llama, args, message):
    done = _fit(str(llama[0]), *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(context=8, gradient_checkpointing=True), "gradient_checkpointing applies to a fine-tune"),
    (dict(train="adamw", mixed_precision="fp8"), "unknown mixed precision 'fp8': use bf16 or fp16"),
    (dict(train="adamw", gradient_checkpointing="yes"), "gradient_checkpointing must be True or False"),
])
def test_fit_check_names_the_fix_for_a_steps_options(llama, kwargs, message):
    with pytest.raises(OomMagicError, match=message):
        oom_magic.fit_check(llama[0], target="T4", **kwargs)
