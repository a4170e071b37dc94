"""Build a synthetic notebook heap of a chosen gc-object count and tensor count, for the scan benchmarks.

What a heap holds, in the order it is built (every part is a real Python or torch object):

- the libraries a notebook imports: torch (~170k gc objects), and from ~800k objects up also
  transformers with ``LlamaForCausalLM`` imported (~360k together);
- a model: from ~800k objects a real transformers ``LlamaForCausalLM`` built from a tiny config
  with enough layers for ~1,000 parameters and buffers; below that a plain ``torch.nn`` decoder
  stack of the same shape (transformers alone would overshoot a 200k heap);
- with 100,000 tensors: Adam-style optimizer state (``opt_state[param]['exp_avg']``), views of one
  large activation tensor (``chunks``, sharing one storage) and a tokenised dataset whose records
  each hold a small tensor (``dataset[i]['input_ids']``), as a user's own notebook would;
- filler up to the target count, about 30% of it user data in the namespace (``records``: dicts with a
  token list and a metadata dict; ``examples``: instances with attributes) and the rest library state
  reached only through ``sys.modules`` (a registry module, as pandas/sklearn/tokenizers leave).

The user variables go into the namespace given (a notebook's ``user_ns`` or ``__main__.__dict__``),
so the holder walk starts from the same place it would in a notebook.
"""
from __future__ import annotations

import gc
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

LIBRARY_MODULE = "_oom_bench_library"
# Nominal sizes used in the table, and the tensor counts each is built with.
HEAP_SIZES = {"200k": 200_000, "800k": 800_000, "3M": 3_000_000}
TENSOR_COUNTS = (1_000, 100_000)
_TRANSFORMERS_FROM = 500_000  # objects: below this, transformers alone would overshoot the heap


@dataclass(frozen=True)
class HeapInfo:
    """What a built heap holds: counts the benchmark reports beside its timings."""

    label: str
    target_objects: int
    objects: int          # len(gc.get_objects()) after building
    tensors: int          # live torch tensors in the heap
    storages: int         # distinct storages among them
    model: str            # which model the heap holds
    user_objects: int     # gc objects the filler put in the user namespace
    library_objects: int  # gc objects the filler put behind sys.modules
    build_seconds: float
    garbage: str | None   # None, "young" (orphaned before any collection) or "old" (orphaned after promotion)


class Example:
    """A user's record object (a notebook's dataclass-like row)."""

    def __init__(self, i: int) -> None:
        self.text = f"example {i}"
        self.label = i % 7
        self.spans = [i, i + 3, i + 9]


class _Node:
    """An object in a reference cycle (the garbage a cell can leave behind)."""


def _cycle(torch: Any) -> _Node:
    """A reference cycle holding a 256 KiB tensor (the caller drops the last outside reference)."""
    node = _Node()
    node.self = node
    node.hidden_states = torch.ones(256, 256)
    return node


def _torch_model(torch: Any, layers: int) -> Any:
    """A plain torch decoder stack: 9 parameters per layer, like a Llama block."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            self.gate_proj, self.up_proj = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
            self.down_proj = nn.Linear(2 * d, d, bias=False)
            self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)

    class Decoder(nn.Module):
        def __init__(self, d: int, n: int, vocab: int) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
            self.norm = nn.LayerNorm(d, bias=False)
            self.lm_head = nn.Linear(d, vocab, bias=False)

    return Decoder(16, layers, 256)


def _llama_model(layers: int) -> Any:
    """A real transformers LlamaForCausalLM from a tiny config (small tensors, real module tree)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _count() -> int:
    return len(gc.get_objects())


def _fill(target: int, user: list, library: list) -> tuple[int, int]:
    """Add records (user) and registry entries (library) in equal shares until the heap reaches target."""
    user_added = library_added = 0
    per_item = 8.0  # gc objects one loop below adds; measured after the first chunk
    i = 0
    while True:
        missing = target - _count()
        if missing <= 1_000:
            return user_added, library_added
        chunk = max(int(missing / per_item * 0.9), 100)
        before_user = _count()
        for j in range(i, i + chunk):
            if j % 2:
                user[0].append({"id": j, "text": f"row {j}", "tokens": [j % 50257, 13, 262, (j * 7) % 50257],
                                "meta": {"source": "train", "length": 4}})
            else:
                user[1].append(Example(j))
        before_library = _count()
        for j in range(i, i + chunk):
            library.append([f"entry-{j}", {"hits": j, "path": ["cache", j]}, types.SimpleNamespace(key=j), [j, None]])
        after = _count()
        user_added += before_library - before_user
        library_added += after - before_library
        per_item = (after - before_user) / chunk
        i += chunk


def build_heap(label: str, tensors: int, namespace: dict, *, garbage: str | None = None) -> HeapInfo:
    """Fill ``namespace`` (and a library module) so the process holds ~HEAP_SIZES[label] gc objects.

    ``garbage`` adds one unreachable reference cycle holding a 256 KiB tensor: "young" is orphaned
    right away (it sits in generation 0, as a cycle from the cell just run), "old" is orphaned
    after a collection promoted it (a model deleted cells after it was built). The heap is left
    collected, as a notebook's is after its last full collection; the caller decides gc.enable().
    """
    started = time.perf_counter()
    target = HEAP_SIZES[label]
    import torch

    if target >= _TRANSFORMERS_FROM:
        import transformers  # noqa: F401  (the import itself is part of a real notebook's heap)

        model = _llama_model(111)
        model_name = "transformers LlamaForCausalLM, 111 tiny layers"
    else:
        model = _torch_model(torch, 111)
        model_name = "torch.nn decoder, 111 tiny layers"
    namespace["torch"] = torch
    namespace["model"] = model
    params = list(model.parameters())
    count = len(params) + len(list(model.buffers()))
    if tensors > count:
        # Optimizer state: two moments and a step per parameter, keyed by the parameter.
        opt_state = {p: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                     for p in params}
        namespace["opt_state"] = opt_state
        count += 3 * len(params)
        # Views of one activation tensor: many tensors, one storage.
        views = min(10_000, (tensors - count) // 10)
        acts = torch.zeros(views, 8)
        namespace["chunks"] = list(acts.unbind(0))
        count += views
        if target >= _TRANSFORMERS_FROM:
            # A tokenised dataset: one small tensor per record.
            namespace["dataset"] = [{"input_ids": torch.arange(8), "label": i % 2} for i in range(tensors - count)]
        else:
            # Flat, so that 100k tensors still fit a heap this small: cached embeddings.
            namespace["features"] = [torch.arange(8) for _ in range(tensors - count)]
        count = tensors
    gc.collect()  # import and construction leftovers: a notebook's heap after its first collection
    user: list[list[Any]] = [[], []]
    namespace["records"], namespace["examples"] = user
    library_module = types.ModuleType(LIBRARY_MODULE)
    library_module.registry = []
    sys.modules[LIBRARY_MODULE] = library_module
    user_objects, library_objects = _fill(target, user, library_module.registry)
    if garbage not in (None, "young", "old"):
        raise ValueError(f"garbage must be None, 'young' or 'old', not {garbage!r}")
    reachable = [_cycle(torch)] if garbage == "old" else []
    gc.collect()  # everything built so far is long-lived: the oldest generation
    reachable.clear()  # "old": orphaned in the oldest generation, where only a full collection frees it
    if garbage == "young":
        _cycle(torch)  # orphaned at once: generation 0
    objects = gc.get_objects()
    types_ = _tensor_types(torch)
    live = [o for o in objects if type(o) in types_]
    del objects
    storages = len({t.untyped_storage()._cdata for t in live})
    info = HeapInfo(label, target, _count(), len(live), storages, model_name, user_objects, library_objects,
                    time.perf_counter() - started, garbage)
    del live
    return info


def _tensor_types(torch: Any) -> set[type]:
    found, stack = {torch.Tensor}, [torch.Tensor]
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return found


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    gc.disable()
    print(build_heap(sys.argv[1] if len(sys.argv) > 1 else "800k", int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
                     sys.modules["__main__"].__dict__, garbage=sys.argv[3] if len(sys.argv) > 3 else None))


# --------------------------------------------------------------------------- heap shapes (issue 12)
# Each shape fills the user namespace with one kind of data a notebook holds, to ~SHAPE_OBJECTS gc
# objects in all (torch included), with ``tensors`` tensors placed inside that data; ``spot`` gives
# the path a user would type to one tensor and the tensor itself, so the benchmark checks its name.
SHAPE_OBJECTS = 800_000
SHAPES = ("slots", "attrs", "dataclass", "namedtuple", "nested_dicts", "tree", "sets", "deque", "numpy",
          "pandas", "model_adamw", "kv_cache", "module_list",
          # issue 24: holders outside the variables, deep chains, and whole notebooks of three users
          "class_attrs", "user_module", "garbage", "linked_list", "researcher", "finetuner", "data_scientist")
# Where the user-module shape writes its module: a folder inside the repository (the notebook's
# folder, as the benchmark runs from the repository root), under test-output/ (never tracked).
USER_MODULE_DIR = "test-output/bench-user-module"


class Cfg:
    """A user's configuration class that caches tensors as class attributes."""

    table: list[Any] = []


class ListNode:
    """One node of a user's singly linked list."""

    def __init__(self, value: Any, following: ListNode | None) -> None:
        self.value = value
        self.next = following


class Orphan:
    """A node of a reference cycle nothing reaches (what a deleted model's closure leaves)."""


class Token:
    """A token record with a vector slot."""

    __slots__ = ("id", "text", "vector")

    def __init__(self, i: int, vector: Any) -> None:
        self.id, self.text, self.vector = i, f"tok{i}", vector


class AttrsRecord:
    """What attrs generates: plain instances whose __init__ assigns each field."""

    def __init__(self, i: int, embedding: Any) -> None:
        self.id = i
        self.name = f"r{i}"
        self.tags = [i % 5, i % 7]
        self.embedding = embedding


class TreeNode:
    def __init__(self, value: Any) -> None:
        self.children: list[TreeNode] = []
        self.value = value


def build_shape(shape: str, tensors: int, namespace: dict, objects: int = SHAPE_OBJECTS) -> tuple[str, Any]:
    """Fill ``namespace`` with heap shape ``shape`` holding ``tensors`` tensors; (spot path, spot tensor).

    The shape's data takes ~70% of the objects (tuples of atoms that the collector untracks are not
    counted); records, instances and a library's registry (as in ``build_heap``) top it up.
    """
    spot = _shape_data(shape, tensors, namespace, int(objects * 0.7))
    gc.collect()
    if _count() < objects - 10_000:
        user: list[list[Any]] = [[], []]
        namespace["records"], namespace["examples"] = user
        library_module = types.ModuleType(LIBRARY_MODULE)
        library_module.registry = []
        sys.modules[LIBRARY_MODULE] = library_module
        _fill(objects, user, library_module.registry)
    return spot


def _shape_data(shape: str, tensors: int, namespace: dict, objects: int) -> tuple[str, Any]:
    import collections
    import dataclasses
    import torch

    namespace["torch"] = torch
    gc.collect()
    budget = max(objects - _count(), 10_000)

    def vec(i: int) -> Any:
        return torch.ones(4) if i % every == 0 and i // every < tensors else [i, i + 1]

    if shape == "slots":
        every = max(budget // 2 // tensors, 1)  # a token and its list
        namespace["tokens"] = data = [Token(i, vec(i)) for i in range(budget // 2)]
        k = every * (tensors // 2)
        return f"tokens[{k}].vector", data[k].vector
    if shape == "attrs":
        every = max(budget // 4 // tensors, 1)
        namespace["rows"] = data = [AttrsRecord(i, vec(i)) for i in range(budget // 4)]
        k = every * (tensors // 2)
        return f"rows[{k}].embedding", data[k].embedding
    if shape == "dataclass":
        Example_ = dataclasses.make_dataclass("Sample", [("id", int), ("label", str), ("features", Any)])
        namespace["Sample"] = Example_
        every = max(budget // 3 // tensors, 1)
        namespace["samples"] = data = [Example_(i, f"l{i}", vec(i)) for i in range(budget // 3)]
        k = every * (tensors // 2)
        return f"samples[{k}].features", data[k].features
    if shape == "namedtuple":
        Row = collections.namedtuple("Row", "id label features")
        namespace["Row"] = Row
        every = max(budget // 3 // tensors, 1)
        namespace["table"] = data = [Row(i, f"l{i}", vec(i)) for i in range(budget // 3)]
        k = every * (tensors // 2)
        return f"table[{k}][2]", data[k].features
    if shape == "nested_dicts":
        every = max(budget // 4 // tensors, 1)
        namespace["docs"] = data = [{"id": i, "meta": {"source": "web", "spans": [i, i + 3]}, "emb": vec(i)}
                                    for i in range(budget // 4)]
        k = every * (tensors // 2)
        return f"docs[{k}]['emb']", data[k]["emb"]
    if shape == "tree":
        every = max(budget // 3 // tensors, 1)
        root = TreeNode(None)
        nodes = [root]
        for i in range(1, budget // 3):
            node = TreeNode(vec(i))
            nodes[(i - 1) // 4].children.append(node)
            nodes.append(node)
        namespace["tree"] = root
        k = every * (tensors // 2) or every
        path, i = [], k
        while i:
            path.append((i - 1) % 4)
            i = (i - 1) // 4
        text = "tree" + "".join(f".children[{j}]" for j in reversed(path)) + ".value"
        result = nodes[k].value
        nodes.clear()
        return text, result
    if shape == "sets":
        every = max(budget // 2 // tensors, 1)
        items = [(i, vec(i)) if i % every == 0 and i // every < tensors else (i, f"s{i}") for i in range(budget // 2)]
        namespace["pairs"] = set(items[: len(items) // 2])
        namespace["frozen"] = frozenset(items[len(items) // 2:])
        spot = next(p for p in namespace["pairs"] if type(p[1]) is not str)
        index = list(namespace["pairs"]).index(spot)
        items.clear()
        return f"pairs{{#{index}}}[1]", spot[1]
    if shape == "deque":
        every = max(budget // 3 // tensors, 1)
        namespace["queue"] = data = collections.deque({"step": i, "obs": vec(i)} for i in range(budget // 3))
        k = every * (tensors // 2)
        return f"queue[{k}]['obs']", data[k]["obs"]
    if shape == "numpy":
        import numpy as np

        every = max(budget // 2 // tensors, 1)
        n = budget // 2
        array = np.empty(n, dtype=object)
        for i in range(n):
            array[i] = vec(i)
        namespace["column"] = array
        k = every * (tensors // 2)
        return f"column[{k}]", array[k]
    if shape == "pandas":
        import pandas as pd

        every = max(budget // 2 // tensors, 1)
        n = budget // 2
        namespace["df"] = df = pd.DataFrame({"id": range(n), "emb": [vec(i) for i in range(n)]})
        k = every * (tensors // 2)
        return f"df['emb'].iloc[{k}]", df["emb"].iloc[k]
    if shape in ("model_adamw", "kv_cache", "module_list"):
        import transformers  # noqa: F401  (part of such a notebook's heap)

        if shape == "model_adamw":
            layers = max((tensors // 3 - 3) // 9, 1)  # params + two moments each
            model = _llama_model(layers)
            opt = torch.optim.AdamW(model.parameters())
            model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
            opt.step()
            from torch.utils.data import DataLoader

            namespace["model"], namespace["opt"] = model, opt
            namespace["loader"] = DataLoader([torch.arange(4) for _ in range(16)], batch_size=4)
            target = model.model.layers[layers // 2].mlp.up_proj.weight
            spot = (f"model.model.layers[{layers // 2}].mlp.up_proj.weight", target)
        elif shape == "kv_cache":
            n = tensors // 2
            namespace["cache"] = cache = {f"layer_{i}": (torch.ones(2, 4), torch.ones(2, 4)) for i in range(n)}
            spot = (f"cache['layer_{n // 2}'][1]", cache[f"layer_{n // 2}"][1])
        else:
            namespace["blocks"] = blocks = [torch.nn.Linear(4, 4) for _ in range(tensors // 2)]
            spot = (f"blocks[{len(blocks) // 2}].weight", blocks[len(blocks) // 2].weight)
        return spot
    if shape == "class_attrs":
        Cfg.table = [torch.ones(4) for _ in range(tensors)]
        namespace["Cfg"] = Cfg
        return f"Cfg.table[{tensors // 2}]", Cfg.table[tensors // 2]
    if shape == "user_module":
        import importlib
        import os

        os.makedirs(USER_MODULE_DIR, exist_ok=True)
        with open(os.path.join(USER_MODULE_DIR, "mymod.py"), "w") as f:
            f.write("CACHE = []\n")
        sys.path.insert(0, os.path.abspath(USER_MODULE_DIR))
        mymod = importlib.import_module("mymod")
        mymod.CACHE.extend(torch.ones(4) for _ in range(tensors))
        namespace["mymod"] = mymod
        return f"mymod.CACHE[{tensors // 2}]", mymod.CACHE[tensors // 2]
    if shape == "garbage":
        # Orphaned after the benchmark's own collection (``late``): cycles a cell left behind.
        def late() -> tuple[str, Any]:
            spot = None
            for i in range(tensors):
                node = Orphan()
                node.self = node
                node.state = {"hidden": torch.ones(4)}
                if i == tensors // 2:
                    spot = node.state["hidden"]
            return "unreachable reference cycle", spot

        namespace["__late__"] = late
        return "unreachable reference cycle", None
    if shape == "linked_list":
        n = 200_000
        every = n // min(tensors, 500)
        head = None
        for i in range(n - 1, -1, -1):
            head = ListNode(torch.ones(4) if i % every == 0 else i, head)
        namespace["head"] = head
        k, node = n - every, head
        for _ in range(k):
            node = node.next
        return f"head(.next ×{k:,}).value", node.value
    if shape == "researcher":
        return _researcher(torch, tensors, namespace)
    if shape == "finetuner":
        return _finetuner(torch, tensors, namespace)
    if shape == "data_scientist":
        return _data_scientist(torch, tensors, namespace)
    raise ValueError(f"unknown heap shape {shape!r}")


def _researcher(torch: Any, tensors: int, namespace: dict) -> tuple[str, Any]:
    """A researcher's notebook: a model, activations hooked per layer into a dict of lists, attention
    maps kept per prompt, a results table of dicts, a few experiment globals."""
    model = _llama_model(8)
    acts: dict[str, list[Any]] = {f"model.layers.{i}": [] for i in range(8)}
    per_layer = max((tensors - 100) // 16, 1)
    for i in range(8):
        acts[f"model.layers.{i}"].extend(torch.ones(2, 16) for _ in range(per_layer))
    attn = {f"prompt {p}": [torch.ones(2, 4, 4) for _ in range(8)] for p in range(per_layer // 8 + 1)}
    results = [{"prompt": f"prompt {p}", "layer": p % 8, "score": p / 7, "tokens": list(range(p % 13))}
               for p in range(50_000)]
    namespace.update(model=model, acts=acts, attn=attn, results=results, seed=0)
    return "acts['model.layers.5'][3]", acts["model.layers.5"][3]


def _finetuner(torch: Any, tensors: int, namespace: dict) -> tuple[str, Any]:
    """A fine-tuner's notebook: a model with LoRA adapters, AdamW over the adapters, a DataLoader,
    the last batch, a loss history of floats, and the best checkpoint's state dict."""
    import peft

    base = _llama_model(max(tensors // 40, 2))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long)}
    model(**batch).loss.backward()
    opt.step()
    from torch.utils.data import DataLoader

    loader = DataLoader([{"input_ids": torch.arange(8)} for _ in range(64)], batch_size=8)
    best = {k: v.clone() for k, v in model.state_dict().items() if "lora" in k}
    history = [float(i) / 3 for i in range(20_000)]
    namespace.update(model=model, opt=opt, batch=batch, loader=loader, best=best, history=history)
    # A base weight: a PEFT model also keeps its base model's bound prepare_inputs_for_generation, a
    # shorter way in that a user never types (named `model.base_model_prepare_...__self__` before).
    weight = model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight
    return "model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight", weight


def _data_scientist(torch: Any, tensors: int, namespace: dict) -> tuple[str, Any]:
    """A data scientist's notebook: a DataFrame with an embedding column, a dict of per-split
    feature matrices, a small MLP, and lists of metrics per fold."""
    import pandas as pd

    n = 60_000
    every = max(n // max(tensors - 10, 1), 1)
    df = pd.DataFrame({"id": range(n), "text": [f"row {i}" for i in range(n)],
                       "emb": [torch.ones(4) if i % every == 0 else None for i in range(n)]})
    features = {"train": torch.ones(100, 8), "valid": torch.ones(20, 8), "test": torch.ones(20, 8)}
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    folds = [{"fold": f, "auc": 0.5 + f / 100, "preds": list(range(1000))} for f in range(5)]
    namespace.update(df=df, features=features, mlp=mlp, folds=folds)
    return "features['valid']", features["valid"]
