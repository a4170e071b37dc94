"""A job's fit check from the command (`oom-magic fit --context/--train --target`) and `fit_check(context=)`.

A real tiny Llama (GQA) saved locally; the figures in the output are compared with a real cache
after a real prompt's forward, and with peft's real adapters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import oom_magic
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.common.errors import OomMagicError
from oom_magic.records.job import JobFit
from tests.sizing.families import build, cache_storage_bytes

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("job") / "llama"
    model = build("llama-gqa")
    model.save_pretrained(folder)
    return folder, model


def _fit(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "oom_magic", "fit", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_inference_json_carries_parts_equal_to_a_real_cache_and_the_weights(llama):
    folder, model = llama
    done = _fit(str(folder), "--context", "48", "--batch", "3", "--target", "T4", "--json")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["checks"][0]
    with torch.no_grad():
        real = model(input_ids=torch.randint(3, 256, (3, 48)), use_cache=True).past_key_values
    assert check["parts"] == {"weights": estimate_checkpoint(folder, "auto").bytes,
                              "kv_cache": cache_storage_bytes(real), "activations": check["parts"]["activations"],
                              "gradients": 0, "optimizer": 0, "adapters": 0}
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
