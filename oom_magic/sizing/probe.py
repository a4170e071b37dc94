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
transient activations, with the attention transformers picks for the model: sdpa runs as a fused
kernel holds it (its output and logsumexp, no batch x heads x prompt² scores, which the meta
device's math path would make), eager as eager does (Gemma 2). Against the PyTorch profiler's
memory timeline of a real cpu forward it is within 10% (tests/sizing/test_activations.py).
For a fine-tune (``TrainStep``) the child also runs one training step, forward with labels and
backward, of the batch at the context, on the same model (LoRA-wrapped when asked) with eager
attention, turned from meta into fake cpu tensors: shapes only, like meta, but torch.autocast's cpu
rules apply (meta has none), so mixed precision casts what autocast really casts. It runs at the
batch and at one more sequence, for how the step grows with the batch. Against the profiler of a
real cpu step the figure is within 1% in float32 (tests/sizing/test_train_activations.py); under
bf16 autocast the cpu's matmul adds a weight-sized scratch buffer inside the kernel that this
count, made of tensors, leaves out (as a GPU's kernel workspaces are).
The user's kernel never imports torch, transformers or peft for this (``run_child``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.config_size import CONFIG_CHILD_PRELUDE, run_child
from ..common.errors import OomMagicError

__all__ = ["JobProbe", "SplitFigures", "TrainStep", "probe_job"]

# device_split, run by the child for inference when a split=[gpus, usable bytes per GPU, the weights'
# bytes, the most GPUs to try] argument is given: where from_pretrained(device_map="auto", max_memory={0: usable,
# ...}) puts each module, each GPU's parameters and buffers, and the cache of the decoder layers it holds
# (cache layer i lives with decoder layer i). For the job's count of GPUs (when more than one), then, when
# that does not fit, for each larger count until one fits (sizing.device_split.split_fits judges the same).
_DEVICE_SPLIT = r"""
SPLIT = next((json.loads(a[len("split="):]) for a in sys.argv[8:] if a.startswith("split=")), None)
split_gpus, split_usable, split_weights, MOST_GPUS = (int(a) for a in (SPLIT or [1, 0, 0, 1]))
if split_usable and not lora_r:
    import itertools

    def layer_bytes(cache):
        # each cache layer's bytes in order (cross-attention's with its decoder layer); what no layer holds, on layer 0
        parts = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(cache, "cross_attention_cache") \
            else [cache]
        lists = [getattr(part, "layers", None) for part in parts]
        if not all(isinstance(each, (list, tuple)) and each for each in lists):
            raise TypeError(f"{type(cache).__name__} keeps no list of layers")
        per = [sum(cache_bytes(each[i]) for each in lists if i < len(each)) for i in range(max(map(len, lists)))]
        per[0] += cache_bytes(cache) - sum(per)
        return per

    def decoder_layer_names(count):
        # the ModuleList of the count no-split blocks the cache's layers belong to (the decoder's, encoder-decoder)
        no_split = set(getattr(model, "_no_split_modules", None) or ())
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
        lists = [(n, m) for n, m in lists if all(type(b).__name__ in no_split for b in m)] or lists
        if encoder_decoder:
            lists = [(n, m) for n, m in lists if "decoder" in n] or lists
        if not lists:
            raise ValueError(f"no list of {count} layers matches the cache's {count} layers")
        return [f"{lists[0][0]}.{i}" for i in range(count)]

    def placed(name, device_map):
        # the device of a parameter or module: its longest prefix in the map (accelerate's own rule)
        while name not in device_map:
            if not name:
                return device_map.get("", "cpu")
            name = name.rpartition(".")[0]
        return device_map[name]

    def device_map_for(count):
        memory = {i: split_usable for i in range(count)}
        try:  # transformers 5: what from_pretrained itself calls for device_map="auto"
            from transformers.integrations.accelerate import _get_device_map
        except ImportError:
            _get_device_map = None
        if _get_device_map is not None:
            return dict(_get_device_map(model, "auto", memory, None))
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        balanced = get_balanced_memory(model, max_memory=memory, no_split_module_classes=no_split)
        return dict(infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split))

    def split(count):
        device_map = device_map_for(count)
        weights, spilled = [0] * count, 0
        for name, tensor in tensors:
            where, size = placed(name, device_map), tensor.numel() * tensor.element_size()
            if isinstance(where, int) and 0 <= where < count:
                weights[where] += size
            else:
                spilled += size
        homes = [placed(name, device_map) for name in names]
        on = lambda per, device: sum(b for b, home in zip(per, homes) if home == device)
        kv = [max(on(layer_prompt, d), on(layer_context, d)) for d in range(count)]
        return {"gpus": count, "weights": weights, "kv_cache": kv,
                "kv_growth_per_token": [(max(on(longer_prompt, d), on(longer_context, d)) - kv[d]) / STEP
                                        for d in range(count)],
                "layers": [[i for i, home in enumerate(homes) if home == d] for d in range(count)],
                "spilled": spilled,
                "spilled_modules": [f"{k or '(all)'} -> {v}" for k, v in device_map.items() if not isinstance(v, int)]}

    def fits(figures):
        return not figures["spilled"] and all(w + k + (transient if w else 0) <= split_usable
                                              for w, k in zip(figures["weights"], figures["kv_cache"]))

    transient, peak = answer["activations"] or 0, max(after_prompt, at_context)
    splits = []
    # on one GPU the splits only say how many it would take; a model transformers cannot split leaves that unsaid
    if split_gpus > 1 or split_weights + peak + transient > split_usable:
        try:
            import accelerate  # noqa: F401  transformers splits a model only with accelerate installed
            layer_prompt, layer_context = held(prompt, context, layer_bytes)
            longer_prompt, longer_context = held(prompt if prompt < context else context + STEP, context + STEP,
                                                 layer_bytes)
            names = decoder_layer_names(len(layer_prompt))
            # parameters and buffers (non-persistent ones too): dispatch puts both on the module's device
            tensors = list(itertools.chain(model.named_parameters(), model.named_buffers()))
            splits = [split(split_gpus)] if split_gpus > 1 else []
            if not (splits and fits(splits[0])):
                # no split fits on fewer GPUs than the weights and the cache need added up
                counts = range(max(split_gpus + 1, 2, -(-(split_weights + peak) // split_usable)), MOST_GPUS + 1)
                # a decoder layer is never split, so one whose weights and cache alone pass a GPU fits on
                # no count: only the most GPUs is tried (the answer, with one map instead of one per count)
                prefixes = [n + "." for n in names]
                alone = [sum(t.numel() * t.element_size() for n, t in tensors if n.startswith(prefix))
                         + max(layer_prompt[i], layer_context[i]) for i, prefix in enumerate(prefixes)]
                if counts and max(alone, default=0) + transient > split_usable:
                    counts = range(MOST_GPUS, MOST_GPUS + 1)
                for count in counts:
                    splits.append(split(count))
                    if fits(splits[-1]):
                        break
        except Exception as exc:
            if split_gpus > 1:
                missing = isinstance(exc, ImportError) and "accelerate" in str(exc)
                print(json.dumps({"unsplittable": "accelerate is not installed: pip install accelerate" if missing
                                  else first(exc)})); sys.exit(0)
            splits = []
    answer["splits"] = splits
"""

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

def held(prompt, context, measure=cache_bytes):
    # (bytes after the prompt's forward, bytes once the cache holds the whole context); measure: per layer too
    if encoder_decoder:
        # the prompt is the encoder's input; the decoder holds the rest of the context
        decoder = max(context - prompt, 1)
        after_prompt = measure(run(1, encoder_tokens=prompt))
        if decoder == 1:
            return after_prompt, after_prompt
        return after_prompt, measure(run(1, past=run(decoder - 1, encoder_tokens=prompt), encoder_tokens=prompt))
    after_prompt = measure(run(prompt))
    return after_prompt, (measure(run(1, past=run(context - 1))) if context > prompt else after_prompt)

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

def grouped_experts():
    # a MoE's experts as transformers runs them by default (grouped_mm over the tokens sorted by
    # expert); its fallback kernel, not torch's, which wants bfloat16: same shapes, runs on meta and fake
    try:
        import transformers.integrations.moe as moe
        moe._can_use_grouped_mm = lambda *args: False
        model.set_experts_implementation("grouped_mm")
    except Exception:
        pass

def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # what a fused sdpa kernel (flash, memory-efficient, the cpu's flash) holds in a forward without
    # grad: its output and, for the moment, its float32 logsumexp per query, never the batch x heads x
    # prompt x prompt scores the meta device's math path makes
    logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    del logsumexp
    return out

def prompt_transient():
    # the prompt's forward as generate runs it (logits of the last token only), with the attention
    # transformers picks by default for the model (sdpa: a fused kernel; eager for Gemma 2's softcap):
    # what it holds at its peak beyond the cache it leaves; None where the model cannot run so
    if encoder_decoder:
        return None
    try:
        functional, sdpa = torch.nn.functional, torch.nn.functional.scaled_dot_product_attention
        if getattr(model.config, "_attn_implementation", None) == "sdpa":  # as from_pretrained picks it
            functional.scaled_dot_product_attention = fused_attention
        grouped_experts()  # batched_mm (the cache's meta path) copies every expert's weights per token
        mode = Live()
        # the weights are there before the forward: their t() views are no new memory
        mode.held.update({t.untyped_storage()._cdata: [0, 1 << 62] for t in [*model.parameters(), *model.buffers()]})
        ids = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
        try:
            with torch.no_grad(), mode:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache = cache_bytes(out.past_key_values)
        finally:
            functional.scaled_dot_product_attention = sdpa
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
""" + _DEVICE_SPLIT + r"""
# --- training: one step's forward and backward (run only when the job trains) ---
TRAIN_STEP = next((json.loads(a[len("train_step="):]) for a in sys.argv[8:] if a.startswith("train_step=")), None)

class StepLive(Live):
    # the weights' storages were there before the step (t() views of them are saved for the backward, not new)
    def __init__(self, before):
        super().__init__()
        self.held.update({key: [0, 1 << 62] for key in before})
        self.before, self.casts = before, {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            source = args[0].untyped_storage()._cdata
            if source in self.before:  # autocast's low-precision copy of a weight
                self.casts[source] = out.untyped_storage().nbytes()
        return out

def as_fake_cpu(module, mode):
    # the meta model's tensors as fake cpu tensors: shapes only, but autocast's cpu rules apply (meta has none)
    from torch._subclasses.fake_tensor import FakeTensor
    made, cpu = {}, torch.device("cpu")
    def fake(t):
        if id(t) not in made:  # tied weights stay one tensor
            made[id(t)] = FakeTensor(mode, t.detach(), cpu)
        return made[id(t)]
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                sub._parameters[name] = made[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = fake(b)

def train_step_transient(step):
    # (peak beyond what the step leaves, at batch and batch + 1; autocast's weight copies) of one step with
    # labels on the probe's model (LoRA-wrapped when asked), eager attention
    from torch._subclasses.fake_tensor import FakeTensorMode
    grouped_experts()
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(step["mixed_precision"])
    trained = wrapped if lora_r else model
    trained.train()
    model.set_attn_implementation("eager")
    if step["gradient_checkpointing"]:  # transformers' own (use_reentrant=False in 5.x)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    as_fake_cpu(trained, fake_mode)
    before = {t.untyped_storage()._cdata for t in [*trained.parameters(), *trained.buffers()]}
    peaks, casts = [], 0
    with fake_mode:
        for rows in (batch, batch + 1):
            ids = torch.zeros(rows, context, dtype=torch.long)
            live = StepLive(before)
            with live:
                with torch.autocast("cpu", dtype=mixed or torch.bfloat16, enabled=mixed is not None):
                    loss = trained(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
                loss.backward()
                del loss
            peaks.append(live.peak - live.live)  # what is left: the gradients
            casts = sum(live.casts.values())
            for p in trained.parameters():
                p.grad = None
    return peaks, casts

if TRAIN_STEP is not None:
    try:
        (at_batch, one_more), casts = train_step_transient(TRAIN_STEP)
        answer.update(train_activations=at_batch, train_per_sequence=one_more - at_batch, weight_casts=casts)
    except Exception as exc:
        answer["train_unsized"] = first(exc)
print(json.dumps(answer))
"""


@dataclass(frozen=True)
class JobProbe:
    """What the meta-device run of a job found (int bytes; parameters as (name, dtype, elements, bytes))."""

    activations: int | None  # the prompt's forward at its peak beyond the cache (the model's attention); None: not run
    kv_after_prompt: int   # the cache right after the prompt's forward
    kv_at_context: int     # the cache once it holds the whole context
    kv_growth_per_token: float  # how the peak grows per token of context beyond this one (0: a fixed state)
    parameters: tuple[tuple[str, str, int, int], ...]
    adapters: tuple[tuple[str, str, int, int], ...]  # LoRA parameters peft adds (the trainable ones)
    lora_targets: tuple[str, ...]
    largest_layer: int     # bytes of the largest repeated block (what FSDP gathers at once)
    encoder_decoder: bool
    splits: tuple[SplitFigures, ...] = ()  # inference over GPUs: device_map="auto" for the job's count, then more
    train_activations: int | None = None  # one training step's peak beyond what it leaves (see train_step); None: not run
    train_per_sequence: int = 0  # how much that peak grows with one more sequence in the batch
    weight_casts: int = 0  # autocast's low-precision weight copies (mixed precision); in train_activations while live


@dataclass(frozen=True)
class SplitFigures:
    """Where ``device_map="auto"`` puts a model over ``gpus`` GPUs, and what each GPU then holds (int bytes)."""

    gpus: int
    weights: tuple[int, ...]     # parameters and buffers placed on each GPU
    kv_cache: tuple[int, ...]    # the cache of the decoder layers each holds, at that GPU's peak
    kv_growth_per_token: tuple[float, ...]  # how each GPU's peak cache grows per token of context
    layers: tuple[tuple[int, ...], ...]     # the decoder layers (cache layers) each GPU holds
    spilled: int                 # bytes of parameters and buffers the map puts on the cpu or disk
    spilled_modules: tuple[str, ...]        # "module -> cpu|disk", in the map's order


_cache: dict[tuple, JobProbe] = {}


def probe_job(config: Path, dtype: str | None, *, batch: int, prompt: int, context: int,
              lora_r: int = 0, lora_targets: tuple[str, ...] = (), split: tuple[int, int, int] | None = None,
              most_gpus: int = 64, train_step: TrainStep | None = None) -> JobProbe:
    """Run the job's forwards on the meta device from ``config`` (a config.json) and return what it held.

    ``split`` (inference: GPUs, usable bytes on each, the weights' bytes) also asks where
    ``device_map="auto"`` puts the model over that many GPUs (when more than one) and, when that
    does not fit, over each larger count up to ``most_gpus`` until one fits (``JobProbe.splits``).
    ``train_step``: also run one training step of ``batch`` sequences of ``context`` tokens (see
    ``TrainStep``) and report its activations. Raises OomMagicError with one line when transformers
    or peft cannot build or run the model, or the child runs past its time or memory bound.
    """
    stat = config.stat()
    key = (str(config.resolve()), stat.st_mtime_ns, dtype, batch, prompt, context, lora_r, lora_targets, split,
           most_gpus, train_step)
    if key not in _cache:
        args = [str(config.parent), dtype or "", str(batch), str(prompt), str(context), str(lora_r),
                json.dumps(list(lora_targets))]
        if split is not None:
            args.append("split=" + json.dumps([*split, most_gpus]))
        if train_step is not None:
            args.append("train_step=" + json.dumps({"gradient_checkpointing": train_step.gradient_checkpointing,
                                                    "mixed_precision": train_step.mixed_precision}))
        answer = run_child(_CHILD, args, str(config))
        for problem, what in (("unreadable", "transformers cannot read it"),
                              ("unbuildable", "transformers cannot build it"),
                              ("unrunnable", "transformers cannot run its forward on the meta device"),
                              ("unadaptable", "peft cannot add LoRA adapters to it"),
                              ("unsplittable", 'transformers cannot split it over GPUs (device_map="auto")')):
            if problem in answer:
                raise OomMagicError(f"{config.name}: {what} ({answer[problem]}); the job is not sized")
        activations = answer.get("activations")
        _cache[key] = JobProbe(
            None if activations is None else int(activations), int(answer["kv_after_prompt"]), int(answer["kv_at_context"]), float(answer["kv_growth_per_token"]),
            tuple((str(n), str(d), int(e), int(b)) for n, d, e, b in answer["parameters"]),
            tuple((str(n), str(d), int(e), int(b)) for n, d, e, b in answer["adapters"]),
            tuple(str(t) for t in answer.get("lora_targets", ())), int(answer["largest_layer"]),
            bool(answer["encoder_decoder"]), _splits(answer.get("splits", ())), *_train_step_answer(answer, train_step))
    return _cache[key]


def _splits(rows: list[dict]) -> tuple[SplitFigures, ...]:
    return tuple(SplitFigures(int(row["gpus"]), tuple(int(b) for b in row["weights"]),
                              tuple(int(b) for b in row["kv_cache"]),
                              tuple(float(g) for g in row["kv_growth_per_token"]),
                              tuple(tuple(int(i) for i in held) for held in row["layers"]), int(row["spilled"]),
                              tuple(str(m) for m in row["spilled_modules"])) for row in rows)


@dataclass(frozen=True)
class TrainStep:
    """How one training step runs, for its activations: labels = the inputs, the loss transformers computes.

    A step's activations are its peak live bytes during the forward and backward, above what existed
    before the forward (weights, optimizer state) and what the step leaves (the gradients): with the
    gradients and the state, the step's whole peak. They include the loss's float32 logits
    (batch x context x vocab, upcast by transformers' loss), eager attention's scores, and under
    ``mixed_precision`` autocast's low-precision copies of the weights it casts, as far as they are
    still live at the peak (the backward frees each once it has used it; the peak is often late in
    the backward, when the gradients are nearly all there).
    """

    gradient_checkpointing: bool = False  # transformers' own: each layer's activations recomputed in the backward
    mixed_precision: str | None = None    # "bf16"/"fp16": float32 weights under torch.autocast


def _train_step_answer(answer: dict, train_step: TrainStep | None) -> tuple[int | None, int, int]:
    # a model whose step cannot run on fake tensors keeps its other parts; its activations are "not sized"
    if train_step is None or "train_unsized" in answer:
        return None, 0, 0
    return int(answer["train_activations"]), int(answer["train_per_sequence"]), int(answer["weight_casts"])
