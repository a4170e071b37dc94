"""The job a cell loads its model for, read from its AST (never run): generate's lengths, a fine-tune's settings.

The defaults the reader assumes (TrainingArguments' batch and optimizer, LoraConfig's rank) are
compared with the installed transformers' and peft's own objects; the sizes of these jobs are
checked against real models in tests/guard/test_guard_job.py.
"""
from __future__ import annotations

import pytest

from oom_magic.common.errors import OomMagicError
from oom_magic.fit.cell_job import _OPTIMIZERS, job_overrides, with_overrides
from oom_magic.fit.load_calls import find_load_calls
from oom_magic.records.job import Job

LOAD = "model = AutoModelForCausalLM.from_pretrained('org/tiny')\n"


def _job(cell: str, namespace: dict | None = None):
    (request,) = [r for r in find_load_calls(cell, namespace or {}) if r.kind in ("from_pretrained", "pipeline")]
    return request.job, request.notes


def test_generate_with_a_literal_prompt_holds_prompt_plus_new_minus_one_tokens():
    job, notes = _job(LOAD + "out = model.generate(torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), max_new_tokens=6)\n")
    assert job == Job(context=4 + 6 - 1, batch=2, prompt=4) and notes == ()


def test_generate_with_an_unknown_prompt_is_sized_for_max_new_tokens_and_says_so():
    job, notes = _job(LOAD + "out = model.generate(**inputs, max_new_tokens=128)\n", {"inputs": object()})
    assert job == Job(context=128, batch=1, prompt=None)
    assert any("prompt's length is known only when the cell runs" in n and "--context" in n for n in notes)
    assert any("batch is known only when the cell runs" in n and "--batch" in n for n in notes)


def test_max_length_is_the_whole_length_and_beams_widen_the_batch():
    job, _ = _job(LOAD + "n = 64\nout = model.generate(ids, max_length=n, num_beams=4)\n", {"ids": object()})
    assert (job.context, job.batch, job.prompt) == (63, 4, None)  # the last token generated is never cached
    job, _ = _job(LOAD + "out = model.generate(ids, max_new_tokens=8, max_length=999, num_return_sequences=3)\n")
    assert (job.context, job.batch) == (8, 3)  # max_new_tokens wins, as in transformers


def test_names_in_the_namespace_are_read_only_as_exact_ints():
    job, _ = _job(LOAD + "out = model.generate(ids, max_new_tokens=new)\n", {"new": 40, "ids": object()})
    assert job.context == 40

    class Sneaky(int):
        pass

    job, notes = _job(LOAD + "out = model.generate(ids, max_new_tokens=new)\n", {"new": Sneaky(40)})
    assert job.context == 1 and any("without max_new_tokens or max_length" in n for n in notes)


def test_a_pipeline_called_with_max_new_tokens_is_inference_on_that_load():
    cell = "pipe = pipeline('text-generation', model='org/tiny')\nout = pipe('Hello', max_new_tokens=50)\n"
    job, _ = _job(cell)
    assert job == Job(context=50, batch=1)


def test_training_arguments_give_the_batch_the_optimizer_checkpointing_and_precision():
    cell = LOAD + ("args = TrainingArguments('out', per_device_train_batch_size=4, optim='adamw_torch',\n"
                   "                         gradient_checkpointing=True, bf16=True)\n"
                   "Trainer(model=model, args=args).train()\n")
    job, notes = _job(cell)
    assert (job.train, job.batch, job.gradient_checkpointing, job.mixed_precision) == ("adamw", 4, True, "bf16")
    assert job.context == 1 and any("sequence length is the dataset's" in n for n in notes)


@pytest.mark.parametrize("optim, kind", [("sgd", "sgd"), ("adamw_8bit", "adamw8bit"), ("adamw_bnb_8bit", "adamw8bit"),
                                         ("paged_adamw_8bit", "adamw8bit"), ("adamw_torch_fused", "adamw")])
def test_each_optimizer_name_maps_to_what_the_sizing_knows(optim, kind):
    job, _ = _job(LOAD + f"args = TrainingArguments('out', optim={optim!r}, fp16=True)\n")
    assert (job.train, job.mixed_precision) == (kind, "fp16")


def test_an_optimizer_the_sizing_does_not_know_is_not_sized_and_says_so():
    job, notes = _job(LOAD + "Trainer(model=model, args=TrainingArguments('out', optim='adafactor'))\n")
    assert job is None and any("optim='adafactor'" in n and "--train" in n for n in notes)


def test_a_trainer_without_arguments_has_transformers_defaults(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    real = transformers.TrainingArguments(str(tmp_path), report_to=[])
    job, _ = _job(LOAD + "Trainer(model=model, train_dataset=data).train()\n")
    assert job.batch == real.per_device_train_batch_size
    assert job.train == _OPTIMIZERS[str(real.optim.value)] == "adamw"
    names = {o.value for o in transformers.training_args.OptimizerNames}
    assert set(_OPTIMIZERS) - {"adamw_hf", "adamw_apex_fused"} <= names  # every name we map is a real one


def test_sft_config_max_length_is_the_context():
    job, notes = _job(LOAD + "cfg = SFTConfig(max_length=512, per_device_train_batch_size=2)\n"
                              "SFTTrainer(model=model, args=cfg, peft_config=LoraConfig(r=32)).train()\n")
    assert (job.train, job.context, job.batch, job.lora_r) == ("lora", 512, 2, 32) and notes == ()


def test_get_peft_model_is_lora_and_on_a_4bit_load_qlora():
    peft = pytest.importorskip("peft")
    lora = ("cfg = LoraConfig(r=8, target_modules=['q_proj', 'v_proj'])\n"
            "model = get_peft_model(model, cfg)\n")
    job, _ = _job(LOAD + lora)
    assert (job.train, job.lora_r, job.lora_targets) == ("lora", 8, ("q_proj", "v_proj"))
    four = "model = AutoModelForCausalLM.from_pretrained('org/tiny', quantization_config=BitsAndBytesConfig(load_in_4bit=True))\n"
    job, _ = _job(four + lora)
    assert job.train == "qlora"
    job, _ = _job(LOAD + "model = get_peft_model(model, LoraConfig(task_type='CAUSAL_LM'))\n")
    assert job.lora_r == peft.LoraConfig().r and job.lora_targets == ()  # peft's defaults


def test_lora_on_an_8bit_load_is_not_sized():
    cell = ("model = AutoModelForCausalLM.from_pretrained('org/tiny', load_in_8bit=True)\n"
            "model = get_peft_model(model, LoraConfig(r=8))\n")
    job, notes = _job(cell)
    assert job is None and any("LoRA on a int8 load is not sized" in n for n in notes)


def test_the_job_goes_on_the_load_generate_is_called_on():
    cell = ("tok = AutoTokenizer.from_pretrained('org/tiny')\n"
            "draft = AutoModelForCausalLM.from_pretrained('org/draft')\n"
            "model = AutoModelForCausalLM.from_pretrained('org/tiny')\n"
            "out = model.generate(ids, max_new_tokens=16)\n")
    requests = find_load_calls(cell, {})
    assert [(r.variable, r.job) for r in requests] == [("draft", None), ("model", Job(context=16))]


def test_a_cell_without_a_job_has_none():
    assert _job(LOAD + "model.eval()\n") == (None, ())


def test_flags_override_the_cell_and_drop_the_notes_they_answer():
    requests = find_load_calls(LOAD + "out = model.generate(ids, max_new_tokens=9)\n", {})
    (request,), note = with_overrides(requests, job_overrides(context=4096))
    assert note is None and request.job == Job(context=4096)
    assert not any("--context" in n for n in request.notes) and any("--batch" in n for n in request.notes)
    (request,), _ = with_overrides(find_load_calls(LOAD, {}), job_overrides(train="lora", lora_r=4, batch=2))
    assert request.job == Job(context=1, batch=2, train="lora", lora_r=4)


def test_flags_on_a_cell_without_a_transformers_load_say_so():
    requests = find_load_calls("sd = torch.load('w.pt')\n", {})
    kept, note = with_overrides(requests, job_overrides(context=64))
    assert kept == requests and note == "--context: no from_pretrained or pipeline load in the cell to size a job for"


@pytest.mark.parametrize("flags, message", [
    ({"context": 0}, "context must be a whole number of at least 1, not 0"),
    ({"batch": -2}, "batch must be a whole number of at least 1, not -2"),
    ({"train": "adam"}, "unknown training kind 'adam': use one of adamw, sgd, adamw8bit, lora, qlora"),
    ({"prompt": 0}, "prompt must be a whole number of at least 1"),
])
def test_bad_flags_get_the_commands_one_line_messages(flags, message):
    with pytest.raises(OomMagicError) as info:
        job_overrides(**flags)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- the job on a quantized load, sized


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("torch")
    from tests.sizing.families import build

    folder = tmp_path_factory.mktemp("cell_job") / "llama"
    build("llama-gqa").save_pretrained(folder)
    return folder


FOUR_BIT = ("model = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig("
            "load_in_4bit=True, bnb_4bit_quant_type='nf4'))\n")


def test_lora_flags_on_a_4bit_load_are_sized_as_qlora_like_the_command(llama):
    pytest.importorskip("peft")
    from oom_magic.fit.job_fit import job_fit
    from oom_magic.fit.preflight import preflight_check
    from oom_magic.render.fit import fit_dict

    preflight = preflight_check(FOUR_BIT, {"path": str(llama)}, job=job_overrides(train="lora", lora_r=4))
    (check,) = preflight.checks
    assert check.call.job.train == "lora" and check.job.job.train == "qlora"
    assert check.job.parts == job_fit(llama, Job(context=1, train="qlora", lora_r=4), "T4").parts
    assert fit_dict(preflight)["checks"][0]["job"]["parts"]["adapters"] == check.job.parts.adapters > 0


def test_a_full_fine_tune_of_a_quantized_load_is_not_sized_and_says_why(llama):
    from oom_magic.fit.preflight import preflight_check

    (check,) = preflight_check(FOUR_BIT, {"path": str(llama)}, job=job_overrides(train="adamw")).checks
    assert check.job is None and check.verdict == "fits"  # the weights' verdict stands
    assert check.job_unsized == "a fine-tune (adamw) of a nf4 load is not sized (--train qlora sizes LoRA on a 4-bit base)"
    assert "job not sized: a fine-tune (adamw)" in str(preflight_check(FOUR_BIT, {"path": str(llama)},
                                                                     job=job_overrides(train="adamw")))
