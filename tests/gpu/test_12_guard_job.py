"""Check 12 — %%guardload sizes the job its cell runs, and the report says how much context fits now.

A tiny Llama (tests/sizing/families.py), saved locally, is loaded in bf16 on cuda:0 by a
%%guardload cell that then generates 6 tokens after a literal 4-token prompt. The preflight reads
the job from the cell (a 4 + 6 − 1 = 9-token cache at batch 1) and sizes it before the load; the
report after the load says how many tokens of KV cache the device's free memory holds now (issue 22).

Ground truth: the real cache ``generate`` returned (its storages' bytes), the real cache's growth
per token measured with two real forwards, ``oom-magic fit``'s own figure for the same job, and
the device's free memory the report read after the load.
"""
from __future__ import annotations

import pytest

from tests.gpu.support import guard_cell, settle

ITEM = 12
pytestmark = pytest.mark.gpu


def test_the_cells_job_is_sized_and_the_room_after_the_load_is_the_real_caches(gpu_ip, cuda, checks, tmp_path):
    torch = cuda
    from oom_magic.fit.job_fit import job_fit
    from oom_magic.records.job import Job
    from tests.sizing.families import build, cache_storage_bytes

    settle(torch)
    path = tmp_path / "llama"
    build("llama-gqa").save_pretrained(path)
    gpu_ip.user_ns["path"] = str(path)
    _, report, error = guard_cell(
        gpu_ip, "--device cuda:0",
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map='cuda:0')\n"
        "out = model.generate(torch.tensor([[5, 6, 7, 8]], device='cuda'), max_new_tokens=6, min_new_tokens=6, "
        "do_sample=False, return_dict_in_generate=True)")
    checks.true("the guarded cell ran", None if error is None else f"{type(error).__name__}: {error}", expected=None)
    if report is None or report.preflight is None or not report.preflight.checks:
        checks.true("the report has a preflight check", False)
        checks.verify()
        return
    check = report.preflight.checks[0]
    job = check.call.job
    checks.true("the job read from the cell: context 9, prompt 4, batch 1, inference",
                None if job is None else (job.context, job.prompt, job.batch, job.train), expected=(9, 4, 1, None))
    out = gpu_ip.user_ns.get("out")
    model = gpu_ip.user_ns.get("model")
    if check.job is not None and out is not None and model is not None:
        real = cache_storage_bytes(getattr(out, "past_key_values", None) or getattr(out, "cache", None))
        checks.equal("the preflight's KV cache == the real generate's cache", real, check.job.parts.kv_cache)
        command = job_fit(str(path), Job(context=9, batch=1, prompt=4), "H200", dtype="bfloat16").parts.kv_cache
        checks.equal("== oom-magic fit's figure for the same job", command, check.job.parts.kv_cache)

        def cache(tokens: int) -> int:
            with torch.no_grad():
                ids = torch.randint(3, 256, (1, tokens), device="cuda")
                return cache_storage_bytes(model(input_ids=ids, use_cache=True).past_key_values)

        growth = (cache(9 + 64) - cache(9)) / 64
        room = report.context_room
        if room is None:
            checks.true("the report says how much context fits now", False)
        else:
            checks.equal("room: the cache's growth per token == the real cache's", growth, room.per_token, unit=None)
            checks.equal("room: free after the load == the report's after-reading", report.after.free, room.free)
            checks.equal("room: tokens == free // growth per token", room.free // room.per_token, room.tokens, unit=None)
            checks.true("room: in the model's dtype", room.dtype, expected="bfloat16")
    gpu_ip.run_cell("del model, out", store_history=True)
    checks.verify()
