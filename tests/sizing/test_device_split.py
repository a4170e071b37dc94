"""Inference over several GPUs as device_map="auto" splits it, against accelerate and real caches on the cpu.

The truth for each tiny model (real weights, built on the cpu): accelerate's own
``get_balanced_memory`` + ``infer_auto_device_map`` called as transformers calls them for
``device_map="auto"`` (each GPU's usable bytes as ``max_memory``, the model's ``_no_split_modules``),
which must also equal transformers' own map; the real tensors' bytes summed per device under that
map; and a real cpu forward and generate, whose cache layers are summed per device (cache layer i
lives with decoder layer i). oom-magic's share of each GPU must equal weights + cache to the byte;
the prompt's transient (held to the profiler in test_activations.py) is added whole to each GPU
the map puts modules on, since the forward peaks inside a layer on each GPU in turn.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import oom_magic
from oom_magic.common.errors import OomMagicError
from oom_magic.fit.job_fit import job_fit
from oom_magic.fit.targets import parse_target
from oom_magic.records.job import Job
from oom_magic.sizing.parts import size_job
from tests.fit.command import fit_here
from tests.sizing.families import FAMILIES, cache_storage_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.xdist_group("device_split")  # one worker builds the module's models

BATCH, PROMPT, NEW = 2, 12, 7
CONTEXT = PROMPT + NEW - 1  # the last token generated is never fed back
# deeper than families.py's, so that a split has layers on both GPUs; (family, overrides, decoder layers)
DEEP = {"llama-gqa": ({"num_hidden_layers": 8}, "model.layers"),
        "gpt2": ({"n_layer": 6}, "transformer.h"),  # lm_head tied to the embeddings
        "gemma2-alternating": ({"num_hidden_layers": 6}, "model.layers"),  # sliding and full layers
        "jamba-hybrid": ({}, "model.layers"),  # attention layers' cache and mamba layers' fixed state
        "t5-encoder-decoder": ({"num_layers": 4}, "decoder.block")}  # self- and cross-attention per decoder layer


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root, built = tmp_path_factory.mktemp("split"), {}
    for family, (overrides, _) in DEEP.items():
        name, kwargs = FAMILIES[family]
        torch.manual_seed(0)
        config = getattr(transformers, name)(**{**kwargs, **overrides})
        auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.float32).eval()
        model.save_pretrained(root / family)
        built[family] = (root / family, model)
    return built


def _target(gpus: int, usable: int) -> str:
    """A --target of ``gpus`` cards each with ``usable`` bytes for PyTorch (a size is the card's total)."""
    reserve = (1 << 40) - parse_target(f"{1 << 40}B").usable
    assert parse_target(f"{usable + reserve}B").usable == usable
    return f"{gpus}x{usable + reserve}B"


def _placed(name: str, device_map: dict[str, Any]) -> Any:
    while name not in device_map:
        name = name.rpartition(".")[0] if name else ""
        if not name and "" not in device_map:
            return "cpu"
    return device_map[name]


def _truth(model: Any, gpus: int, usable: int) -> dict[str, Any]:
    """accelerate's map for ``gpus`` x ``usable`` and the real tensors' bytes under it, per GPU and spilled."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    memory = {i: usable for i in range(gpus)}
    no_split = sorted(model._no_split_modules)
    balanced = get_balanced_memory(model, max_memory=dict(memory), no_split_module_classes=no_split)
    device_map = dict(infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split))
    from transformers.integrations.accelerate import _get_device_map

    assert dict(_get_device_map(model, "auto", dict(memory), None)) == device_map  # transformers agrees
    weights, spilled, seen = [0] * gpus, 0, set()
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:  # tied: one storage, counted once
            continue
        seen.add(storage.data_ptr())
        where = _placed(name, device_map)
        if isinstance(where, int):
            weights[where] += storage.nbytes()
        else:
            spilled += storage.nbytes()
    return {"map": device_map, "weights": weights, "spilled": spilled}


def _context(model: Any) -> int:
    # encoder-decoder: the encoder's PROMPT tokens + the decoder's NEW held tokens (as in test_kv_cache.py)
    return PROMPT + NEW if model.config.is_encoder_decoder else CONTEXT


def _by_layer(cache: Any) -> list[int]:
    if hasattr(cache, "cross_attention_cache"):  # a decoder layer holds its self- and cross-attention caches
        return [cache_storage_bytes([own, cross]) for own, cross in
                zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers, strict=True)]
    return [cache_storage_bytes(layer) for layer in cache.layers]


def _real_cache_by_layer(model: Any) -> tuple[list[int], list[int]]:
    """Each cache layer's bytes after a real prompt's forward and after a real generate to the context."""
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (BATCH, PROMPT))
    start = {"decoder_input_ids": torch.zeros(BATCH, 1, dtype=torch.long)} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        after_prompt = model(input_ids=ids, use_cache=True, **start).past_key_values
        at_context = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                    return_dict_in_generate=True).past_key_values
    return _by_layer(after_prompt), _by_layer(at_context)


def _real_kv_per_gpu(model: Any, family: str, device_map: dict[str, Any], gpus: int) -> list[int]:
    after_prompt, at_context = _real_cache_by_layer(model)
    homes = [_placed(f"{DEEP[family][1]}.{i}", device_map) for i in range(len(after_prompt))]
    on = lambda per, gpu: sum(b for b, home in zip(per, homes) if home == gpu)  # noqa: E731
    return [max(on(after_prompt, gpu), on(at_context, gpu)) for gpu in range(gpus)]


@pytest.mark.parametrize("family", sorted(DEEP))
def test_each_gpus_weights_and_cache_equal_accelerates_map_and_a_real_generate_to_the_byte(models, family):
    folder, model = models[family]
    usable = 50 << 20  # ample: the balanced map still splits the layers over both GPUs
    truth = _truth(model, 2, usable)
    kv = _real_kv_per_gpu(model, family, truth["map"], 2)

    fit = job_fit(folder, Job(context=_context(model), batch=BATCH, prompt=PROMPT), _target(2, usable))

    split = fit.parts.split
    assert split is not None and fit.fits and fit.job.gpus == 2
    assert [share.weights for share in split.shares] == truth["weights"]
    assert [share.kv_cache for share in split.shares] == kv
    assert all(truth["weights"]) and split.spilled == 0 and truth["spilled"] == 0  # modules on both GPUs
    assert sum(len(share.layers) for share in split.shares) == len(_real_cache_by_layer(model)[0])
    forward = fit.parts.activations
    if model.config.is_encoder_decoder:  # the encoder on GPU 0, the decoder's layers (and cache) on GPU 1 here
        assert forward is None and [bool(share.layers) for share in split.shares] == [False, True]
    else:  # both GPUs hold decoder layers, and the prompt's forward passes through each
        assert forward and all(share.layers and share.activations == forward for share in split.shares)
    assert fit.parts.per_device == tuple(w + k + (forward or 0) for w, k in zip(truth["weights"], kv))
    assert fit.needed == max(fit.parts.per_device) < fit.parts.total  # no GPU holds the whole job
    assert "FSDP" not in str(fit) and 'device_map="auto"' in str(fit)


def test_a_budget_the_weights_outgrow_spills_and_names_what_spills(models):
    folder, model = models["llama-gqa"]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    usable = total // 2 + 100_000  # the balanced map keeps the largest layer free on GPU 0: lm_head spills
    truth = _truth(model, 2, usable)
    assert truth["spilled"] > 0

    fit = job_fit(folder, Job(context=CONTEXT, batch=BATCH, prompt=PROMPT), _target(2, usable))

    split = fit.parts.split
    assert split is not None and not fit.fits
    assert split.spilled == truth["spilled"]
    assert [share.weights for share in split.shares] == truth["weights"]
    assert split.spilled_modules == tuple(f"{k} -> {v}" for k, v in truth["map"].items() if not isinstance(v, int))
    assert "lm_head -> disk" in split.spilled_modules
    assert fit.largest_context == 0 and fit.largest_batch == 0
    assert "off the GPUs (" in str(fit) and "lm_head -> disk" in str(fit)


def test_a_job_that_fits_two_gpus_but_not_one_needs_two(models):
    folder, model = models["llama-gqa"]
    job = Job(context=CONTEXT, batch=BATCH, prompt=PROMPT)
    one = size_job(folder, job)
    usable = one.parts.total - 1  # one GPU is a byte short
    truth = _truth(model, 2, usable)
    kv = _real_kv_per_gpu(model, "llama-gqa", truth["map"], 2)
    activations = one.parts.activations or 0
    assert truth["spilled"] == 0 and max(w + k + activations for w, k in zip(truth["weights"], kv)) <= usable

    single = job_fit(folder, job, _target(1, usable))
    double = oom_magic.fit_check(folder, target=_target(2, usable), context=CONTEXT, prompt=PROMPT, batch=BATCH)

    assert not single.fits and single.gpus_needed == 2 and "needs 2x" in str(single)
    assert double.fits and double.parts.per_device == tuple(w + k + activations for w, k in zip(truth["weights"], kv))


def test_the_largest_context_over_two_gpus_is_the_last_whose_busiest_gpu_fits(models):
    folder, _ = models["llama-gqa"]
    job = Job(context=CONTEXT, batch=BATCH, prompt=PROMPT)
    # the map depends on the budget, not on the context: a budget its weights sit in with room to spare
    usable = 4 << 20
    target = _target(2, usable)
    base = job_fit(folder, job, target)
    assert base.parts.split is not None and base.fits and all(s.layers for s in base.parts.split.shares)
    largest = base.largest_context
    assert largest is not None and largest > CONTEXT

    at = job_fit(folder, Job(context=largest, batch=BATCH, prompt=PROMPT), target)
    beyond = job_fit(folder, Job(context=largest + 1, batch=BATCH, prompt=PROMPT), target)
    assert at.fits and max(at.parts.per_device) <= usable
    assert not beyond.fits and max(beyond.parts.per_device) > usable


_fit = fit_here  # the command's main in this process (its own process: tests/fit/test_cli.py)


def test_the_commands_json_carries_each_gpus_share_and_the_exit_codes_stay(models):
    folder, model = models["llama-gqa"]
    usable = 50 << 20
    truth = _truth(model, 2, usable)
    kv = _real_kv_per_gpu(model, "llama-gqa", truth["map"], 2)
    args = [str(folder), "--context", str(CONTEXT), "--prompt", str(PROMPT), "--batch", str(BATCH)]

    done = _fit(*args, "--target", _target(2, usable), "--json")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["checks"][0]
    shares = check["split"]["shares"]
    assert [s["weights"] for s in shares] == truth["weights"] and [s["kv_cache"] for s in shares] == kv
    assert check["per_device"] == [s["total"] for s in shares] and check["needed"] == max(check["per_device"])
    assert all(type(b) is int for b in check["per_device"]) and check["split"]["spilled"] == 0

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    spills = _fit(*args, "--target", _target(2, total // 2 + 100_000))
    assert spills.returncode == 1 and "lm_head -> disk" in spills.stdout
    refused = _fit(*args, "--target", _target(2, usable), "--quantization", "nf4")
    assert refused.returncode == 2 and "not sized over several GPUs" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_quantized_load_over_several_gpus_is_refused_in_one_line(models):
    with pytest.raises(OomMagicError, match="quantized load is not sized over several GPUs"):
        job_fit(models["llama-gqa"][0], Job(context=CONTEXT), "2xA10G", quantization="nf4")
