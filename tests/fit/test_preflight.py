"""The %%guardload preflight: load calls found by ast (never run), fit checks with real sizes, lints."""
from __future__ import annotations

import json
import resource
import sys
import zipfile
from pathlib import Path

import psutil
import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from oom_magic.guard.diagnose import FitOption
from oom_magic.common.errors import OomMagicError
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.fit.preflight import (CUDA_CONTEXT_BYTES, find_load_calls, load_target, parse_headroom,
                                 preflight_check, read_checkpoint_keys, usable_ram)
from oom_magic.device.host import cuda_process_cap, disk_free, ram_total
from oom_magic.render.guard import lint_text, option_code, preflight_html, preflight_text, size_literal
from oom_magic.common.sizes import quoted, shorten
from oom_magic.render.units import format_bytes

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llamas saved for real: fp32, bf16 (config declares bfloat16), a pickle beside safetensors,
    a training checkpoint with optimizer and scheduler state, a plain state dict, a diffusers-style folder."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("preflight")
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(root / "fp32")
    LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(root / "bf16")
    # A pickle with a safetensors sibling of the same stem.
    (root / "pair").mkdir()
    torch.save(model.state_dict(), root / "pair" / "weights.pt")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"} |
              {"lm_head.weight": model.lm_head.weight.detach().clone()}, root / "pair" / "weights.safetensors")
    # A training checkpoint: model, optimizer (AdamW after one step), scheduler, epoch.
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    scheduler.step()
    torch.save({"model_state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": 3}, root / "train.pt")
    torch.save(model.state_dict(), root / "plain.pt")
    # A diffusers-style pipeline folder: model_index.json and one folder per component.
    pipe = root / "pipe"
    model.save_pretrained(pipe / "text_encoder")
    model.save_pretrained(pipe / "unet")
    (pipe / "scheduler").mkdir()
    (pipe / "scheduler" / "scheduler_config.json").write_text("{}")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "DiffusionPipeline"}))
    return {"root": root, "fp32": root / "fp32", "bf16": root / "bf16", "pair": root / "pair" / "weights.pt",
            "train": root / "train.pt", "plain": root / "plain.pt", "pipe": pipe,
            "optimizer_bytes": _tensor_bytes(optimizer.state_dict()), "model_bytes": _tensor_bytes(model.state_dict())}


def _tensor_bytes(obj: object) -> int:
    """Unique storage bytes of every tensor inside a nested dict/list (what torch.save writes)."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            seen[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


# --------------------------------------------------------------------------- finding the calls


def test_from_pretrained_arguments_resolve_from_the_user_namespace(models):
    ns = {"path": str(models["fp32"]), "torch": torch}
    cell = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "tok = AutoTokenizer.from_pretrained(path)\n"
            'model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")\n')
    (call,) = find_load_calls(cell, ns)  # the tokenizer is not a weight load
    assert call.kind == "from_pretrained"
    assert call.line == 3
    assert call.variable == "model"
    assert call.checkpoint == str(models["fp32"])
    assert call.dtype == "bfloat16"
    assert call.device == "cuda"
    assert call.quantization is None and call.unresolved is None


def test_cell_local_bindings_fstrings_paths_and_moves_resolve(models):
    root = models["root"]
    ns = {"root": str(root), "torch": torch, "cfg": {"name": "fp32"}}
    cell = ("import torch\n"
            "from pathlib import Path\n"
            "from transformers import AutoModelForCausalLM as AM\n"
            "p = Path(root) / cfg['name']\n"
            "m1 = AM.from_pretrained(p, torch_dtype=torch.float16).to('cuda:1')\n"
            "m2 = AM.from_pretrained(f'{root}/fp32', device_map={'': 0})\n"
            "m3 = AM.from_pretrained(str(p))\n"
            "m3 = m3.cuda()\n"
            "m4 = AM.from_pretrained(p).half()\n")
    m1, m2, m3, m4 = find_load_calls(cell, ns)
    assert m1.checkpoint == str(root / "fp32") and m1.dtype == "float16" and m1.moved_to == "cuda:1"
    assert m2.checkpoint == f"{root}/fp32" and m2.device == "cuda:0"
    assert m3.checkpoint == str(root / "fp32") and m3.moved_to == "cuda"
    assert m4.cast_to == "float16" and m4.moved_to is None


def test_quantization_from_inline_config_objects_and_flags(models):
    ns = {"path": str(models["fp32"]), "torch": torch,
          "bnb": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)}
    cell = ("from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
            "a = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb)\n"
            "b = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))\n"
            "c = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True))\n"
            "d = AutoModelForCausalLM.from_pretrained(path, load_in_8bit=True, max_memory={0: '10GiB', 'cpu': '30GB'})\n")
    a, b, c, d = find_load_calls(cell, ns)
    assert (a.quantization, a.double_quant) == ("nf4", True)
    assert (b.quantization, b.double_quant) == ("int8", False)
    assert c.quantization == "fp4"  # transformers' default 4-bit type
    assert d.quantization == "int8"
    assert d.max_memory == ((0, 10 * 2**30), ("cpu", 30 * 10**9))  # accelerate: GiB binary, GB decimal


def test_torch_load_and_load_file_calls(models):
    ns = {"ck": str(models["train"]), "torch": torch}
    cell = ("import torch\n"
            "from safetensors.torch import load_file\n"
            "a = torch.load(ck)\n"
            "b = torch.load(ck, map_location='cpu', weights_only=True, mmap=True)\n"
            "c = torch.load(ck, lambda storage, loc: storage)\n"
            "d = load_file('x.safetensors', device='cuda:0')\n")
    a, b, c, d = find_load_calls(cell, ns)
    assert (a.kind, a.map_location_given, a.weights_only, a.device) == ("torch.load", False, None, None)
    assert (b.map_location_given, b.weights_only, b.mmap, b.device) == (True, True, True, "cpu")
    assert c.device == "cpu"  # the classic map-to-CPU lambda
    assert (d.kind, d.device, d.checkpoint) == ("load_file", "cuda:0", "x.safetensors")


def test_unresolvable_arguments_say_why_and_never_run_user_code():
    class Settings:
        calls = 0

        def __init__(self) -> None:
            self.model_dir = "/models/a"

        @property
        def computed(self) -> str:
            Settings.calls += 1
            return "/models/b"

    ns = {"settings": Settings(), "get_path": lambda: Settings.calls}
    cell = ("from transformers import AutoModel\n"
            "a = AutoModel.from_pretrained(settings.model_dir)\n"
            "b = AutoModel.from_pretrained(settings.computed)\n"
            "c = AutoModel.from_pretrained(get_path())\n"
            "d = AutoModel.from_pretrained(undefined_name)\n")
    a, b, c, d = find_load_calls(cell, ns)
    assert a.checkpoint == "/models/a"
    assert b.checkpoint is None and "not a plain attribute" in b.unresolved
    assert c.checkpoint is None and "computed when the cell runs" in c.unresolved
    assert d.checkpoint is None and "`undefined_name` is not defined yet" in d.unresolved
    assert Settings.calls == 0  # the property was never read


def test_a_cell_that_does_not_parse_is_a_note_not_a_crash():
    with pytest.raises(OomMagicError, match="not valid Python"):
        find_load_calls("model = (", {})
    result = preflight_check("model = (", {})
    assert result.calls == () and "not valid Python" in result.notes[0]


def test_load_target_names_where_the_weights_go(models):
    ns = {"p": str(models["fp32"])}
    assert load_target('m = A.from_pretrained(p, device_map="cuda")', ns) == "cuda"
    assert load_target("m = A.from_pretrained(p)", ns) == "cpu"
    assert load_target("m = A.from_pretrained(p).to('cuda:1')", ns) == "cuda:1"
    assert load_target('m = A.from_pretrained(p, device_map="auto")', ns) == "cpu"  # no GPU on this machine
    assert load_target(f"import torch\nsd = torch.load({str(models['plain'])!r})", {}) == "cpu"  # saved from cpu
    assert load_target("x = 1", {}) is None


# --------------------------------------------------------------------------- fit check


def test_fits_on_cpu_with_the_real_estimate(models):
    est = estimate_checkpoint(models["fp32"])
    cell = "m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)"
    result = preflight_check(cell, {"path": str(models["fp32"]), "torch": torch}, free_bytes=10 * 2**20,
                             headroom="1MiB")
    (check,) = result.checks
    assert check.verdict == "fits" and result.fits is True
    assert check.device == "cpu" and check.need == est.bytes_for("bfloat16") and check.dtype == "bfloat16"
    # issue 14.4: the cast reads the float32 file beside the new bfloat16 copy: RAM peaks at both.
    assert check.ram_peak == est.bytes_for("bfloat16") + est.stored_bytes
    assert check.budget == 9 * 2**20 and check.margin == 9 * 2**20 - check.ram_peak
    assert check.parameters == est.parameters == 106_816
    assert check.options == ()
    assert "fits, " in preflight_text(result) and format_bytes(check.margin) in preflight_text(result)


def test_will_not_fit_lists_options_with_this_models_sizes(models):
    est = estimate_checkpoint(models["fp32"])
    fp32 = est.bytes_for("float32")
    cell = "m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map='cuda:0')"
    free = CUDA_CONTEXT_BYTES + 300_000  # CUDA is not initialized: its context comes off the free memory
    result = preflight_check(cell, {"path": str(models["fp32"]), "torch": torch}, free_bytes=free,
                             ram_bytes=100_000, disk_bytes=10**9, headroom=0)
    (check,) = result.will_not_fit
    assert result.fits is False
    assert (check.device, check.need, check.context, check.budget) == ("cuda:0", fp32, CUDA_CONTEXT_BYTES, 300_000)
    options = {o.kind: o for o in check.options}
    assert list(options) == ["bfloat16", "int8", "nf4", "device-map-auto", "offload-folder"]
    assert options["bfloat16"] == FitOption("bfloat16", est.bytes_for("bfloat16"), True, dtype="bfloat16")
    assert options["int8"].device_bytes == est.bytes_for("int8", unquantized_dtype="bfloat16")
    assert options["nf4"].device_bytes == est.bytes_for("nf4", double_quant=True, unquantized_dtype="bfloat16")
    auto = options["device-map-auto"]
    assert (auto.device_bytes, auto.cpu_bytes, auto.fits) == (300_000, 100_000, False)
    assert auto.max_memory == ((0, 300_000), ("cpu", 100_000))
    assert option_code(auto) == 'device_map="auto", max_memory={0: "292KiB", "cpu": "97KiB"}'
    spill = options["offload-folder"]
    assert (spill.disk_bytes, spill.fits) == (fp32 - 400_000, True)
    assert 'offload_folder="offload"' in option_code(spill)
    text = preflight_text(result)
    assert "WILL NOT FIT" in text and f"{format_bytes(fp32 - 300_000)} short" in text
    assert f"{format_bytes(est.bytes_for('bfloat16'))} on cuda:0" in text and "dtype=torch.bfloat16" in text


def test_device_map_auto_spreads_over_ram_and_disk(models):
    est = estimate_checkpoint(models["fp32"])
    cell = "m = AutoModelForCausalLM.from_pretrained(path, device_map='auto', offload_folder='off')"
    ns = {"path": str(models["fp32"])}
    fits = preflight_check(cell, ns, free_bytes=0, ram_bytes=200_000, disk_bytes=10**9)
    (check,) = fits.checks
    assert check.device == "auto" and check.verdict == "fits"
    assert check.split == (("cpu", 200_000), ("disk", 10**9))
    short = preflight_check(cell.replace(", offload_folder='off'", ""), ns, free_bytes=0, ram_bytes=200_000,
                            disk_bytes=10**9)
    (check,) = short.checks
    assert check.verdict == "will-not-fit" and check.need == est.bytes_for("float32")
    spill = next(o for o in check.options if o.kind == "offload-folder")
    assert spill.max_memory == (("cpu", 200_000),) and spill.disk_bytes == est.bytes_for("float32") - 200_000


def test_diffusers_pipeline_folder_is_the_sum_of_its_components(models):
    one = estimate_checkpoint(models["fp32"])
    result = preflight_check("pipe = DiffusionPipeline.from_pretrained(p)", {"p": str(models["pipe"])},
                             free_bytes=10**9)
    (check,) = result.checks
    assert check.format == "diffusers-pipeline"
    assert check.parameters == 2 * one.parameters and check.need == 2 * one.bytes_for("float32")


def test_unsized_loads_say_plainly_why(models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    # As HF_HUB_OFFLINE=1 set before huggingface_hub is imported (it reads it once); online: tests/checkpoints/test_hub.py
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = preflight_check("m = AutoModel.from_pretrained('meta-llama/Llama-2-7b-hf')", {})
    (check,) = result.checks
    assert check.verdict == "unknown" and "HF_HUB_OFFLINE=1 is set, so nothing was checked" in check.reason
    result = preflight_check("m = AutoModel.from_pretrained(p, device_map='cuda')", {"p": str(models["fp32"])})
    (check,) = result.checks
    assert check.verdict == "unknown" and check.reason == "this machine has no cuda:0 (it has cpu)"
    assert check.need == estimate_checkpoint(models["fp32"]).bytes_for("float32")  # still sized


def test_a_cached_hub_id_resolves_offline(models, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in models["fp32"].iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = preflight_check("m = AutoModel.from_pretrained('org/tiny', dtype='bfloat16')", {}, free_bytes=10**9)
    (check,) = result.checks
    assert check.verdict == "fits" and check.need == estimate_checkpoint(models["fp32"]).bytes_for("bfloat16")


# --------------------------------------------------------------------------- lints


def _codes(result) -> list[str]:
    return [lint.code for lint in result.lints]


def test_torch_load_lints_fire(models):
    result = preflight_check("import torch\nck = torch.load(p)", {"p": str(models["train"])}, free_bytes=10**9)
    # issue 14.9: every storage was saved from cpu, so without map_location it comes back to the cpu:
    # no map-location lint (it fired here before).
    assert _codes(result) == ["weights-only", "training-checkpoint"]
    assert result.lint("weights-only").severity == "info"  # torch >= 2.6 defaults to weights_only=True
    training = result.lint("training-checkpoint")
    sizes = dict(training.sizes)
    assert sizes["optimizer"] == models["optimizer_bytes"] + 0  # the scheduler holds no tensors
    assert sizes["total"] == models["optimizer_bytes"] + models["model_bytes"]
    text = str(training)  # the registered renderer: render.guard.lint_text
    assert "'optimizer', 'scheduler' hold" in text and format_bytes(sizes["optimizer"]) in text
    assert "mmap=True)['model_state_dict']" in text


def test_torch_load_lints_stay_quiet_when_the_call_is_right(models):
    cell = "import torch\nsd = torch.load(p, map_location='cpu', weights_only=True, mmap=True)"
    assert _codes(preflight_check(cell, {"p": str(models["train"])}, free_bytes=10**9)) == []
    assert _codes(preflight_check(cell, {"p": str(models["plain"])}, free_bytes=10**9)) == []


def test_weights_only_false_is_a_warning(models):
    cell = "import torch\nsd = torch.load(p, map_location='cpu', weights_only=False)"
    lint = preflight_check(cell, {"p": str(models["plain"])}, free_bytes=10**9).lint("weights-only")
    assert lint.severity == "warning" and "runs any code" in lint.message


def test_safetensors_sibling_lint(models):
    cell = "import torch\nsd = torch.load(p, map_location='cpu', weights_only=True)"
    lint = preflight_check(cell, {"p": str(models["pair"])}, free_bytes=10**9).lint("safetensors-sibling")
    assert lint is not None and "weights.safetensors" in lint.message and "load_file" in lint.fix
    assert preflight_check(cell, {"p": str(models["plain"])}, free_bytes=10**9).lint("safetensors-sibling") is None


def test_fp32_load_of_a_bf16_model_lint(models):
    est = estimate_checkpoint(models["bf16"])
    assert est.declared_dtype == "bfloat16"
    ns = {"p": str(models["bf16"]), "torch": torch}
    lint = preflight_check("m = A.from_pretrained(p, dtype=torch.float32)", ns, free_bytes=10**9).lint("fp32-of-half")
    assert dict(lint.sizes) == {"fp32": est.bytes_for("float32"), "half": est.bytes_for("bfloat16")}
    assert "dtype=torch.bfloat16" in lint.fix
    for quiet in ("m = A.from_pretrained(p)", "m = A.from_pretrained(p, dtype='auto')",
                  "m = A.from_pretrained(p, dtype=torch.bfloat16)"):
        assert preflight_check(quiet, ns, free_bytes=10**9).lint("fp32-of-half") is None  # transformers 5: "auto"
    fp32_model = {"p": str(models["fp32"]), "torch": torch}
    assert preflight_check("m = A.from_pretrained(p, dtype=torch.float32)", fp32_model,
                           free_bytes=10**9).lint("fp32-of-half") is None


def test_options_for_an_oversized_training_checkpoint(models):
    result = preflight_check("import torch\nck = torch.load(p)", {"p": str(models["train"])},
                             free_bytes=models["model_bytes"] + 10, headroom=0)
    (check,) = result.will_not_fit
    kinds = {o.kind: o for o in check.options}
    assert set(kinds) == {"mmap", "skip-optimizer"}
    assert kinds["skip-optimizer"].device_bytes == models["model_bytes"] and kinds["skip-optimizer"].fits
    assert kinds["skip-optimizer"].key == "model_state_dict"


# --------------------------------------------------------------------------- checkpoint keys, sizes


def test_checkpoint_keys_are_read_without_unpickling(models, tmp_path):
    module = tmp_path / "evil_mod_for_oom_magic.py"
    module.write_text("class Evil:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import evil_mod_for_oom_magic

        torch.save({"model": {"w": torch.ones(10)}, "evil": evil_mod_for_oom_magic.Evil()}, tmp_path / "evil.pt")
    finally:
        sys.path.remove(str(tmp_path))
        del sys.modules["evil_mod_for_oom_magic"]
    module.unlink()
    keys = read_checkpoint_keys(tmp_path / "evil.pt")
    assert keys.keys == (("model", 40), ("evil", 0)) and keys.locations == ("cpu",) and keys.total == 40
    assert "evil_mod_for_oom_magic" not in sys.modules
    train = read_checkpoint_keys(models["train"])
    assert dict(train.keys)["optimizer"] == models["optimizer_bytes"]
    assert train.model_key() == ("model_state_dict", models["model_bytes"])
    assert [k for k, _ in train.optimizer_keys()] == ["optimizer", "scheduler"]


def test_checkpoint_keys_of_bad_files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert read_checkpoint_keys(text) is None
    broken = tmp_path / "broken.pt"
    with zipfile.ZipFile(broken, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00(X\x01\x00")  # cut mid-pickle
    with pytest.raises(OomMagicError, match="broken.pt: data.pkl is not a valid pickle"):
        read_checkpoint_keys(broken)


def test_headroom_spellings():
    assert parse_headroom("5%", 1000) == 50
    assert parse_headroom("2GiB", None) == 2 * 2**30
    assert parse_headroom(None, 2000) == 100  # default 5%
    assert parse_headroom(0, None) == 0
    for bad in ("10XB", "150%", "-1%", "lots"):
        with pytest.raises(OomMagicError) as info:
            parse_headroom(bad, 1000)
        assert "\n" not in str(info.value) and "headroom" in str(info.value)


def test_usable_ram_follows_the_address_space_limit():
    free, limit = usable_ram()
    assert limit is None and free <= psutil.virtual_memory().total
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + (200 << 20), hard))
    try:
        free, limit = usable_ram()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert limit == "the address-space limit (ulimit -v)"
    assert (190 << 20) <= free <= (200 << 20)


def test_size_literals_round_down_for_accelerate():
    assert size_literal(int(10.96 * 2**30)) == '"10.9GiB"'
    assert size_literal(8 * 2**30) == '"8GiB"'
    assert size_literal(512 * 2**20 + 5) == '"512MiB"'
    assert size_literal(3000) == '"2KiB"'
    assert size_literal(500) == "500" and size_literal(-5) == "0"


def test_preflight_html_escapes_outside_text(tmp_path):
    evil = tmp_path / "<script>alert(1)</script>"
    result = preflight_check("m = A.from_pretrained(p)", {"p": str(evil)})
    html = preflight_html(result)
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_hostile_user_objects_are_never_called():
    calls: list[str] = []

    class Hostile:
        """Records, then raises, on every protocol the resolver could touch."""

        def __getattribute__(self, name):
            if name == "__dict__":
                return object.__getattribute__(self, name)
            calls.append(name)
            raise RuntimeError(name)

        @property
        def __class__(self):
            calls.append("__class__")
            raise RuntimeError("__class__")

        def __eq__(self, other):
            calls.append("__eq__")
            raise RuntimeError("__eq__")

        __hash__ = object.__hash__

    ns = {"h": Hostile(), "cfg": Hostile(), "torch": torch}
    cell = ("sd = torch.load(h)\n"
            "m = AutoModel.from_pretrained(cfg.path, dtype=cfg.dtype, device_map=h)\n")
    result = preflight_check(cell, ns)
    assert calls == []
    assert [c.verdict for c in result.checks] == ["unknown", "unknown"]
    assert "a Hostile object, not a path" in result.checks[0].reason
    assert load_target(cell, ns) is None and calls == []


def test_preflight_and_lint_show_through_their_registered_renderers():
    result = preflight_check("import torch\nsd = torch.load('missing.pt')", {})
    assert str(result) == preflight_text(result) and result._repr_html_() == preflight_html(result)
    lint = result.lint("map-location")
    assert str(lint) == lint_text(lint) and str(lint).startswith("lint (line 2): torch.load without map_location")
    assert repr(result) == "<Preflight 1 load(s): unknown; 2 lint(s)>"


def test_outside_text_is_shortened_one_way():
    assert shorten("torch.load(\n    p,\n    map_location='cpu')") == "torch.load( p, map_location='cpu')"
    assert shorten("x" * 200, 10) == "x" * 9 + "…"
    assert quoted("x" * 50) == repr("x" * 40 + "...") and quoted("16XB") == "'16XB'"


def test_host_budgets_read_this_machine(tmp_path):
    assert ram_total() == psutil.virtual_memory().total
    assert 0 < disk_free(str(tmp_path)) <= psutil.disk_usage(str(tmp_path)).total
    assert cuda_process_cap("cpu") is None  # only a CUDA device can carry a per-process cap


def test_long_option_rows_wrap_between_arguments_not_mid_word(ip, tmp_path):
    """issue 25 (small things): JupyterLab breaks a long output line mid-word; the options' code goes on
    its own lines, wrapped between arguments, within TEXT_WIDTH (a sparse 14 GiB checkpoint: headers only)."""
    from IPython.utils.capture import capture_output

    from oom_magic.render.advice import TEXT_WIDTH
    from tests.device.test_mapped import _sparse_checkpoint

    _sparse_checkpoint(tmp_path / "model.safetensors", 14 << 30)
    with capture_output() as shown:
        ip.run_cell(f"import oom_magic\noom_magic.fit_check({str(tmp_path)!r}, target='T4')")
    text = shown.stdout  # the terminal shell's displayhook prints the check's text/plain
    rows = text.split("ways to fit on a T4", 1)[1].splitlines()[1:]
    assert rows and all(len(line) <= TEXT_WIDTH for line in rows)
    joined = " ".join(line.strip() for line in rows)
    assert ('quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
            'bnb_4bit_use_double_quant=True') in joined  # the code reads whole again, each break at a space
    assert any(line.startswith("    4-bit nf4") and line.rstrip().endswith(("fits", "too big", "unknown", "needs bitsandbytes"))
               for line in rows)


def test_the_preflight_never_calls_a_user_objects_fspath(ip):
    """A check that promises to run no user code reads a path only from an exact str or pathlib path."""
    from pathlib import PurePosixPath

    calls: list[str] = []

    class TrackedPath:  # os.PathLike by protocol: __fspath__ is the user's code
        def __fspath__(self) -> str:
            calls.append("TrackedPath.__fspath__")
            return "/models/tracked"

    class MyPath(PurePosixPath):  # a pathlib subclass is user code too
        def __fspath__(self) -> str:
            calls.append("MyPath.__fspath__")
            return "/models/mine"

        def __str__(self) -> str:
            calls.append("MyPath.__str__")
            return "/models/mine"

    ip.user_ns.update(p=TrackedPath(), q=MyPath("/models/q"))
    report = ip.run_cell_magic("guardload", "--device cpu", "y = p\nz = q")
    assert calls == []  # neither the preflight nor the guard read them
    assert ip.user_ns["y"] is ip.user_ns["p"] and report.preflight.calls == ()
    cell = ("from transformers import AutoModelForCausalLM\n"
            "a = AutoModelForCausalLM.from_pretrained(p)\n"
            "b = AutoModelForCausalLM.from_pretrained(q)\n")
    a, b = find_load_calls(cell, ip.user_ns)
    assert calls == []
    assert a.checkpoint is None and "is a TrackedPath object, not a path or hub id" in a.unresolved
    assert b.checkpoint is None and "is a MyPath object, not a path or hub id" in b.unresolved
    from pathlib import Path

    exact = find_load_calls(cell.replace("(q)", "(r)"), {"p": "/models/s", "r": Path("/models/r")})
    assert [c.checkpoint for c in exact] == ["/models/s", "/models/r"]  # exact str and Path still read
