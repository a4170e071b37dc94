"""Ask transformers (and peft) what a job holds, by running it on the meta device in a bounded child.

The KV cache a model keeps is the library's own business: GQA/MQA heads, sliding-window and
chunked layers, state-space layers' fixed state, encoder-decoder cross-attention, and when a
layer trims to its window all differ by family and by version. So the figures are not formulas:
the child builds the model from its config on the meta device (no memory, no weights), runs the
prompt's forward and one decoding step at the context with ``use_cache=True``, and adds up the
bytes of every tensor the returned cache holds. With LoRA it wraps the same meta model with
peft's ``get_peft_model`` (peft's own ``target_modules`` matching) and reports the adapters.
The prompt's forward also runs under a dispatch mode that adds up the storages ops create and
Python frees (weakref finalizers): its live bytes at the peak, beyond the cache, are the prompt's
transient activations. With eager attention this equals the PyTorch profiler's memory timeline of
a real cpu forward (measured within 0.1%); on the meta device sdpa runs its math path, so the
figure is eager's: sdpa/flash kernels on a GPU hold less (no batch x heads x prompt² scores).
The user's kernel never imports torch, transformers or peft for this (``run_child``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.config_size import CONFIG_CHILD_PRELUDE, run_child
from ..common.errors import OomMagicError

__all__ = ["JobProbe", "probe_job"]

# Run by the child: argv = folder, dtype, batch, prompt, context, lora_r (0: none), lora targets (JSON).
_CHILD = CONFIG_CHILD_PRELUDE + r"""
import weakref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
declared, batch, prompt, context, lora_r, targets = sys.argv[2:8]
batch, prompt, context, lora_r, targets = int(batch), int(prompt), int(context), int(lora_r), json.loads(targets)
dtype = getattr(torch, declared) if declared else torch.float32
encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
autos = [transformers.AutoModelForSeq2SeqLM] if encoder_decoder else [transformers.AutoModelForCausalLM]
model, error = None, None
for auto in autos:
    # batched_mm: the MoE path whose meta kernels exist (grouped_mm checks dtypes, eager calls nonzero)
    for extra in ({"experts_implementation": "batched_mm"}, {}):
        try:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, **extra)
            break
        except Exception as exc:
            error = error or exc
    if model is not None:
        break
if model is None:
    print(json.dumps({"unbuildable": first(error), "model_type": str(getattr(config, "model_type", "?"))}))
    sys.exit(0)
model.eval()

def cache_bytes(cache):
    # every storage the cache object holds, each once: layers' keys/values, states, counters
    seen, storages, total, stack = set(), set(), 0, [(cache, 0)]
    while stack:
        item, depth = stack.pop()
        if id(item) in seen or depth > 8:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            # the storage, not the view: a layer trimmed to its window by slicing keeps the whole prompt
            storage = item.untyped_storage()
            if storage._cdata not in storages:
                storages.add(storage._cdata)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        elif hasattr(item, "__dict__") and not isinstance(item, (torch.nn.Module, type)):
            stack.extend((v, depth + 1) for v in vars(item).values())
    return total

def run(tokens, past=None, encoder_tokens=0):
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    with torch.no_grad():
        if encoder_decoder:
            enc = torch.zeros(batch, encoder_tokens, dtype=torch.long, device="meta")
            out = model(input_ids=enc, decoder_input_ids=ids, past_key_values=past, use_cache=True)
        else:
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
    return out.past_key_values

def held(prompt, context):
    # (bytes after the prompt's forward, bytes once the cache holds the whole context)
    if encoder_decoder:
        # the prompt is the encoder's input; the decoder holds the rest of the context
        decoder = max(context - prompt, 1)
        after_prompt = cache_bytes(run(1, encoder_tokens=prompt))
        if decoder == 1:
            return after_prompt, after_prompt
        return after_prompt, cache_bytes(run(1, past=run(decoder - 1, encoder_tokens=prompt), encoder_tokens=prompt))
    after_prompt = cache_bytes(run(prompt))
    return after_prompt, (cache_bytes(run(1, past=run(context - 1))) if context > prompt else after_prompt)

class Live(TorchDispatchMode):
    # live bytes as ops create tensors and Python frees them: the memory timeline of a real run
    def __init__(self):
        super().__init__()
        self.live, self.peak, self.held = 0, 0, {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key in self.held:
                    self.held[key][1] += 1
                else:
                    self.held[key] = [t.untyped_storage().nbytes(), 1]
                    self.live += self.held[key][0]
                    self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.drop, key)
        return out
    def drop(self, key):
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.held[key]

def prompt_transient():
    # the prompt's forward as generate runs it (logits of the last token only), eager attention:
    # what it holds at its peak beyond the cache it leaves; None where the model cannot run so
    if encoder_decoder:
        return None
    try:
        model.set_attn_implementation("eager")
        mode = Live()
        ids = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
        with torch.no_grad(), mode:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = cache_bytes(out.past_key_values)
        return max(mode.peak - cache, 0)
    except Exception:
        return None

STEP = 64  # tokens added to see how the peak grows with the context
try:
    after_prompt, at_context = held(prompt, context)
    # the same job STEP tokens longer (a prompt that was the whole context stays the whole context)
    longer = held(prompt if prompt < context else context + STEP, context + STEP)
except Exception as exc:
    print(json.dumps({"unrunnable": first(exc), "model_type": str(getattr(config, "model_type", "?"))}))
    sys.exit(0)

def rows(module, only_trainable=False):
    return [(name, str(p.dtype).removeprefix("torch."), p.numel(), p.numel() * p.element_size())
            for name, p in module.named_parameters() if p.requires_grad or not only_trainable]

answer = {"activations": prompt_transient(), "kv_after_prompt": after_prompt, "kv_at_context": at_context,
          "kv_growth_per_token": (max(longer) - max(after_prompt, at_context)) / STEP, "parameters": rows(model),
          "encoder_decoder": encoder_decoder, "adapters": []}
# the largest block FSDP gathers at once: the biggest repeated layer
blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
largest = 0
for block_list in blocks:
    for block in block_list:
        largest = max(largest, sum(p.numel() * p.element_size() for p in block.parameters()))
answer["largest_layer"] = largest
if lora_r:
    try:
        import peft
    except ImportError:
        print(json.dumps({"unadaptable": "peft is not installed: pip install peft"})); sys.exit(0)
    try:
        # "all-linear" is peft's own keyword, given as a string, not as a module name in a list
        wanted = targets[0] if targets == ["all-linear"] else (targets or None)
        lora = peft.LoraConfig(r=lora_r, target_modules=wanted,
                               task_type="SEQ_2_SEQ_LM" if encoder_decoder else "CAUSAL_LM")
        with torch.device("meta"):
            wrapped = peft.get_peft_model(model, lora)
    except Exception as exc:
        print(json.dumps({"unadaptable": first(exc)})); sys.exit(0)
    answer["adapters"] = rows(wrapped, only_trainable=True)
    answer["lora_targets"] = sorted(str(t) for t in (wrapped.peft_config["default"].target_modules or []))
print(json.dumps(answer))
"""


@dataclass(frozen=True)
class JobProbe:
    """What the meta-device run of a job found (int bytes; parameters as (name, dtype, elements, bytes))."""

    activations: int | None  # the prompt's forward at its peak beyond the cache (eager attention); None: not run
    kv_after_prompt: int   # the cache right after the prompt's forward
    kv_at_context: int     # the cache once it holds the whole context
    kv_growth_per_token: float  # how the peak grows per token of context beyond this one (0: a fixed state)
    parameters: tuple[tuple[str, str, int, int], ...]
    adapters: tuple[tuple[str, str, int, int], ...]  # LoRA parameters peft adds (the trainable ones)
    lora_targets: tuple[str, ...]
    largest_layer: int     # bytes of the largest repeated block (what FSDP gathers at once)
    encoder_decoder: bool


_cache: dict[tuple, JobProbe] = {}


def probe_job(config: Path, dtype: str | None, *, batch: int, prompt: int, context: int,
              lora_r: int = 0, lora_targets: tuple[str, ...] = ()) -> JobProbe:
    """Run the job's forwards on the meta device from ``config`` (a config.json) and return what it held.

    Raises OomMagicError with one line when transformers or peft cannot build or run the model,
    or the child runs past its time or memory bound.
    """
    stat = config.stat()
    key = (str(config.resolve()), stat.st_mtime_ns, dtype, batch, prompt, context, lora_r, lora_targets)
    if key not in _cache:
        args = [str(config.parent), dtype or "", str(batch), str(prompt), str(context), str(lora_r),
                json.dumps(list(lora_targets))]
        answer = run_child(_CHILD, args, str(config))
        for problem, what in (("unreadable", "transformers cannot read it"),
                              ("unbuildable", "transformers cannot build it"),
                              ("unrunnable", "transformers cannot run its forward on the meta device"),
                              ("unadaptable", "peft cannot add LoRA adapters to it")):
            if problem in answer:
                raise OomMagicError(f"{config.name}: {what} ({answer[problem]}); the job is not sized")
        activations = answer.get("activations")
        _cache[key] = JobProbe(
            None if activations is None else int(activations), int(answer["kv_after_prompt"]), int(answer["kv_at_context"]), float(answer["kv_growth_per_token"]),
            tuple((str(n), str(d), int(e), int(b)) for n, d, e, b in answer["parameters"]),
            tuple((str(n), str(d), int(e), int(b)) for n, d, e, b in answer["adapters"]),
            tuple(str(t) for t in answer.get("lora_targets", ())), int(answer["largest_layer"]),
            bool(answer["encoder_decoder"]))
    return _cache[key]
