"""The heap engine names each tensor's holder the way a user would type it, on every heap shape.

Each shape holds one spot-checked tensor; its storage must be named by the path given, on the
first scan (a walk) and on the next one (a remembered path, re-checked before it is trusted).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import tracemalloc

import numpy as np
import pytest
import torch

from oom_magic.heap.holders import attribute, forget_paths
from oom_magic.heap.roots import Roots
from oom_magic.heap.tracker import find_tensors, tensor_types


def _paths(budget_seconds: float = 60.0, **user) -> dict[int, str]:
    live = find_tensors(torch, "cpu")
    try:
        attribution = attribute(live, Roots(user=tuple(user.items())), torch, tensor_types(torch),
                                find_garbage=False, trace_other=False, budget_seconds=budget_seconds)
        assert attribution.complete
        return {k: h.path for k, h in attribution.holders.items()}
    finally:
        live.release()


def _key(t) -> int:
    return torch._C._storage_address(t)


def _named_twice(expected: str, tensor: torch.Tensor, **user) -> None:
    """The path on a first scan (walked) and on the next (remembered and re-checked) is the same."""
    forget_paths()
    assert _paths(**user).get(_key(tensor)) == expected
    assert _paths(**user).get(_key(tensor)) == expected


class Token:
    __slots__ = ("id", "vector")

    def __init__(self, i: int, vector: torch.Tensor) -> None:
        self.id, self.vector = i, vector


@dataclasses.dataclass
class Example:
    text: str
    embedding: torch.Tensor


Pair = collections.namedtuple("Pair", "label features")


class AttrsStyle:
    """What attrs generates: an __init__ assigning each field, and __slots__-free instances."""

    def __init__(self, name: str, weight: torch.Tensor) -> None:
        self.name = name
        self.weight = weight


def test_slots_records():
    tokens = [Token(i, torch.ones(3)) for i in range(50)]
    _named_twice("tokens[17].vector", tokens[17].vector, tokens=tokens)


def test_attrs_style_and_dataclass_and_namedtuple():
    rows = [AttrsStyle(f"r{i}", torch.ones(4)) for i in range(20)]
    examples = [Example("x", torch.ones(5)) for _ in range(20)]
    pairs = [Pair(i, torch.ones(6)) for i in range(20)]
    _named_twice("rows[3].weight", rows[3].weight, rows=rows)
    _named_twice("examples[4].embedding", examples[4].embedding, examples=examples)
    _named_twice("pairs[5][1]", pairs[5].features, pairs=pairs)


def test_nested_dicts_and_kv_cache():
    doc = {"a": {"b": [0, {"c": torch.ones(7)}]}}
    cache = {"past_key_values": [(torch.ones(8), torch.ones(9)) for _ in range(4)]}
    _named_twice("doc['a']['b'][1]['c']", doc["a"]["b"][1]["c"], doc=doc)
    _named_twice("cache['past_key_values'][2][1]", cache["past_key_values"][2][1], cache=cache)


def test_sets_and_frozensets_of_tuples():
    one = torch.ones(10)
    held = {(1, one)}
    frozen = frozenset({("k", torch.ones(11))})
    _named_twice("held{#0}[1]", one, held=held)
    _named_twice("frozen{#0}[1]", next(iter(frozen))[1], frozen=frozen)


def test_deque_and_numpy_object_array():
    queue = collections.deque([0, "x", torch.ones(12)])
    array = np.empty(3, dtype=object)
    array[2] = torch.ones(13)
    grid = np.empty((2, 2), dtype=object)
    grid[1, 0] = torch.ones(14)
    _named_twice("queue[2]", queue[2], queue=queue)
    _named_twice("array[2]", array[2], array=array)
    _named_twice("grid.flat[2]", grid[1, 0], grid=grid)


def test_pandas_object_column():
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"id": [0, 1, 2], "emb": [torch.ones(2), torch.ones(3), torch.ones(4)]})
    _named_twice("df['emb'].iloc[1]", df["emb"].iloc[1], df=df)


def test_a_pandas_columns_items_are_re_read_not_walked_again(monkeypatch, fresh_heap):
    """The next scan re-reads ``df['emb'].iloc[i]`` from the frame's block (no walk); a frame
    whose rows moved is walked again and named by its new rows. On a heap of its own (fresh_heap): a
    tensor an earlier test left behind would be looked for by a walk on every scan."""
    pd = pytest.importorskip("pandas")
    from oom_magic.heap import walk

    df = pd.DataFrame({"id": range(6), "name": list("abcdef"),
                       "emb": [torch.ones(i + 1) for i in range(6)], "mask": [torch.zeros(9 + i) for i in range(6)]})
    forget_paths()
    first = _paths(df=df)
    walks = []
    real_run = walk.Walk.run
    monkeypatch.setattr(walk.Walk, "run", lambda self: walks.append(1) or real_run(self))
    assert _paths(df=df) == first and walks == []
    assert first[_key(df["emb"].iloc[4])] == "df['emb'].iloc[4]" and first[_key(df["mask"].iloc[2])] == "df['mask'].iloc[2]"
    moved = df.iloc[::-1].reset_index(drop=True)
    again = _paths(df=moved)
    assert walks and again[_key(moved["emb"].iloc[0])] == "df['emb'].iloc[0]"  # the tensor df['emb'].iloc[5] was


def test_lru_cache_named_by_the_function_with_its_hint():
    @functools.lru_cache(maxsize=None)
    def cached(n: int) -> torch.Tensor:
        return torch.ones(n)

    @functools.lru_cache(maxsize=4)
    def bounded(n: int) -> torch.Tensor:
        return torch.ones(n)

    cached(15), bounded(16)
    live = find_tensors(torch, "cpu")
    try:
        holders = attribute(live, Roots(user=(("cached", cached), ("bounded", bounded))), torch,
                            tensor_types(torch), find_garbage=False, trace_other=False).holders
    finally:
        live.release()
    assert holders[_key(cached(15))].path == "cached.cache[15]"
    assert holders[_key(cached(15))].hint == "cached.cache_clear()"
    assert holders[_key(bounded(16))].path == "bounded.cache[…]"
    assert holders[_key(bounded(16))].hint == "bounded.cache_clear()"


def test_partial_and_closure():
    part = functools.partial(torch.add, torch.ones(17))

    def make(held):
        def inner():
            return held
        return inner

    closure = make([torch.ones(18)])
    _named_twice("part.args[0]", part.args[0], part=part)
    _named_twice("closure.__closure__[0].cell_contents[0]", closure.__closure__[0].cell_contents[0], closure=closure)


def test_module_path_wins_over_the_optimizer_that_holds_the_same_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    forget_paths()
    # The optimizer is the first variable: a walk in variable order would name it first.
    paths = _paths(opt=opt, model=model)
    assert paths[_key(model[2].weight)] == "model[2].weight"
    assert paths[_key(model[0].weight.grad)] == "model[0].weight.grad"
    state = opt.state[model[0].weight]
    assert paths[_key(state["exp_avg"])] == "opt.state[model[0].weight]['exp_avg']"


def test_transformers_layer_path_wins_over_optimizer_state_keys():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    forget_paths()
    paths = _paths(opt=opt, model=model)
    up = model.model.layers[3].mlp.up_proj.weight
    assert paths[_key(up)] == "model.model.layers[3].mlp.up_proj.weight"
    assert paths[_key(opt.state[up]["exp_avg"])] == "opt.state[model.model.layers[3].mlp.up_proj.weight]['exp_avg']"


def test_a_link_through_an_instance_dict_is_read_from_the_dict_not_tried_name_by_name(monkeypatch):
    """A module's ``__dict__`` is already made: the link to its child is found there. Trying first every
    name the class's methods assign (~200 on a transformers layer: 200,000 reads naming one model) made
    the after-cell hook's quick view 3x slower; those names are only for instances whose attributes
    are inline (no dict made)."""
    transformers = pytest.importorskip("transformers")
    from oom_magic.heap import links

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    tried: list[str] = []
    inline_name = links.Links._inline_name

    def noting(self, obj, cls, child_id):
        tried.append(cls.__name__)
        return inline_name(self, obj, cls, child_id)

    monkeypatch.setattr(links.Links, "_inline_name", noting)
    forget_paths()
    paths = _paths(model=model)
    assert paths[_key(model.model.layers[3].mlp.up_proj.weight)] == "model.model.layers[3].mlp.up_proj.weight"
    assert len(paths) == sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    assert tried == []


class _Node:
    __slots__ = ("next", "value")

    def __init__(self) -> None:
        self.next = None
        self.value = None


def test_a_200k_node_linked_list_is_named_in_bounded_memory():
    head = node = _Node()
    for _ in range(200_000):
        node.next = _Node()
        node = node.next
    node.value = torch.ones(19)
    forget_paths()
    tracemalloc.start()
    try:
        paths = _paths(head=head)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    path = paths[_key(node.value)]
    assert path == "head(.next ×200,000).value"  # the depth, not 200,000 identical steps
    # Linear in the nodes walked (an id -> parent entry each); a path kept per level would be quadratic.
    assert peak < 200 * 200_000, peak


def test_sparse_tensors_and_a_bare_storage_count_their_real_bytes():
    coo = torch.ones(30, 30).to_sparse()
    csr = torch.eye(40).to_sparse_csr()
    storage = torch.UntypedStorage(1000)
    live = find_tensors(torch, "cpu")
    try:
        holders = attribute(live, Roots(user=(("coo", coo), ("csr", csr), ("storage", storage))), torch,
                            tensor_types(torch), find_garbage=False, trace_other=False).holders
        by_path = {h.path: live.storages[k].bytes for k, h in holders.items()}
    finally:
        live.release()
    assert by_path["coo"] == 900 * 4 + 2 * 900 * 8  # values + indices
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())
    assert by_path["csr"] == sum(p.untyped_storage().nbytes() for p in parts)
    assert by_path["storage"] == 1000


def test_naming_makes_no_instance_dicts():
    rows = [AttrsStyle(str(i), torch.ones(2)) for i in range(2000)]
    forget_paths()
    gc.collect()
    dicts = sum(1 for o in gc.get_objects() if type(o) is dict)
    paths = _paths(rows=rows)
    assert paths[_key(rows[1999].weight)] == "rows[1999].weight"
    # No instance __dict__ is made for the rows walked or named (3.11 keeps attributes inline):
    # names come from the attributes the class's __init__ assigns, read without making one.
    gc.collect()
    assert sum(1 for o in gc.get_objects() if type(o) is dict) - dicts < 20


def test_gpumem_tells_how_to_free_an_lru_cache(ip):
    """In a real shell: the lru cache's tensor is named by the function and the report says how to free it."""
    ip.run_cell("import functools, torch\n"
                "@functools.lru_cache(maxsize=None)\n"
                "def embed(n):\n"
                "    return torch.ones(n, 1000)\n"
                "embed(300)", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
    assert snap.held_by("embed.cache") == 300 * 1000 * 4
    assert "to free what embed's cache holds: embed.cache_clear()" in snap.notes
    assert "embed.cache_clear()" in str(snap)


def test_frozenset_and_tuple_keys_of_builtin_types_are_shown_by_value(ip):
    """A dict keyed by frozensets of strings names each entry by its key (bounded), through %gpumem."""
    ip.run_cell("import torch\n"
                "pair_emb = {frozenset({f'v{i}', 'alpha'}): torch.ones(2 + i) for i in range(50)}\n"
                "spans = {(3, 'x', None): torch.ones(70)}\n"
                "long_key = {tuple(f'token{i}' for i in range(12)): torch.ones(71)}\n"
                "class K:\n    pass\n"
                "odd = {(K(), 1): torch.ones(72)}", store_history=True)
    forget_paths()
    for _ in range(2):
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
        key = next(k for k in ip.user_ns["pair_emb"] if "v7" in k)
        assert user[f"pair_emb[{key!r}]"] == 9 * 4
        assert user["spans[(3, 'x', None)]"] == 280
        (long_path,) = [p for p in user if p.startswith("long_key[")]
        assert long_path.endswith("...]") and len(long_path) <= len("long_key[]") + 80
        # A user type inside the key: never its repr; one name however the walk reached the key first
        # (a key also reached as odd.keys()[<tuple>] once made it odd[odd.keys()[<tuple>]]).
        (odd,) = [p for p in user if p.startswith("odd[")]
        assert odd == "odd[<tuple key>]" and user[odd] == 288, user


def test_views_of_one_storage_in_a_list_are_named_once_as_shared(ip):
    """kv's views of one buffer: the first index and how many views, not an arbitrary view's index."""
    ip.run_cell("import torch\nbuf = torch.zeros(40, 8)\n"
                "kv = {'layers.0.value': [torch.ones(3)] + list(buf.unbind(0))}\ndel buf", store_history=True)
    forget_paths()
    for _ in range(2):
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
        assert user == {"kv['layers.0.value'][0]": 12, "kv['layers.0.value'][1] (first of 40 views)": 40 * 8 * 4}


def test_a_suspended_generators_local_is_named_by_the_local(ip):
    ip.run_cell("import torch\n"
                "def batches():\n"
                "    batch = [torch.ones(33), torch.ones(34)]\n"
                "    yield len(batch)\n"
                "g = batches()\nnext(g)", store_history=True)
    forget_paths()
    for _ in range(2):
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
        assert user["g.gi_frame.f_locals['batch'][0]"] == 132 and user["g.gi_frame.f_locals['batch'][1]"] == 136


def test_a_compiled_model_is_named_through_its_original_module(ip):
    """torch.compile's wrapper copies the model's __dict__ into its forward: the name goes through _orig_mod."""
    ip.run_cell("import torch\n"
                "class Net(torch.nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(4))\n"
                "cm = torch.compile(Net())", store_history=True)
    forget_paths()
    for _ in range(2):
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path for r in snap.storages if r.holder_kind == "user"}
        assert user == {f"cm._orig_mod.layers[{i}].weight" for i in range(4)}


def test_a_dict_subclasss_own_attributes_are_named_as_attributes(ip):
    """`c.t` on a `class Cfg(dict)` (and an OrderedDict's attribute) is the user's, named as typed; an
    OrderedDict with no attributes gets no attribute dict from being walked."""
    ip.run_cell("import collections, gc, torch\n"
                "class Cfg(dict):\n    pass\n"
                "c = Cfg(a=torch.ones(10))\nc.t = torch.ones(1000)\n"
                "od = collections.OrderedDict(w=torch.ones(20))\nod.meta = torch.ones(30)\n"
                "plain = collections.OrderedDict(w=torch.ones(50))\n"
                "plain_refs = len(gc.get_referents(plain))", store_history=True)
    forget_paths()
    for _ in range(2):  # walked, then re-read from the remembered paths
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}
        assert user["c.t"] == 4000 and user["c['a']"] == 40, user
        assert user["od.meta"] == 120 and user["od['w']"] == 80 and user["plain['w']"] == 200
    assert len(gc.get_referents(ip.user_ns["plain"])) == ip.user_ns["plain_refs"]


def test_a_peft_models_weights_are_named_through_its_base_model_not_a_bound_method(ip):
    """A PEFT model keeps its base model's bound `prepare_inputs_for_generation`, one link shorter than
    `base_model.model`: a bound method's object is entered after every other path, so the names are the
    ones a user types; an object only a bound method holds is still named through it."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    ip.run_cell("import torch, transformers, peft\n"
                "config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                "                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)\n"
                "model = peft.get_peft_model(transformers.LlamaForCausalLM(config),\n"
                "                            peft.LoraConfig(r=4, task_type='CAUSAL_LM'))\n"
                "class Box:\n"
                "    def __init__(self):\n"
                "        self.t = torch.ones(7)\n"
                "    def get(self):\n"
                "        return self.t\n"
                "step = Box().get", store_history=True)
    assert ip.run_cell("assert model.base_model_prepare_inputs_for_generation.__self__ is "
                       "model.base_model.model").success  # the shorter path this test is about
    forget_paths()
    for _ in range(2):  # walked, then re-read from the remembered paths
        snap = ip.run_line_magic("gpumem", "-o --device cpu --all")
        user = {r.holder_path for r in snap.storages if r.holder_kind == "user"}
        assert "model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight" in user
        assert "model.base_model.model.model.layers[0].self_attn.v_proj.lora_B.default.weight" in user
        assert "step.__self__.t" in user
        assert [p for p in user if "__self__" in p] == ["step.__self__.t"]
