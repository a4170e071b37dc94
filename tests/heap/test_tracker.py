"""The heap scan on real tensors: one record per storage, exact bytes, no references kept."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from oom_magic.heap.holders import attribute, forget_paths
from oom_magic.heap.roots import Roots
from oom_magic.heap.tracker import find_tensors, tensor_types


def _scan(**user):
    live = find_tensors(torch, "cpu")
    try:
        attribution = attribute(live, Roots(user=tuple(user.items())), torch, tensor_types(torch),
                                find_garbage=False, trace_other=False)
        return dict(live.storages), {k: h.path for k, h in attribution.holders.items()}
    finally:
        live.release()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def test_views_share_one_storage_counted_once():
    base = torch.zeros(1000, 250)
    view, row = base[10:20], base[3]
    storages, paths = _scan(base=base, view=view, row=row)
    record = storages[_key(base)]
    assert record.bytes == 1000 * 250 * 4
    assert record.tensor_count == 3
    assert record.shape == (1000, 250)  # the largest view names the storage
    assert paths[_key(base)] == "base"
    assert sum(1 for r in storages.values() if r.key == _key(view)) == 1


def test_tied_weights_counted_once():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    storages, paths = _scan(model=model)
    assert storages[_key(emb.weight)].bytes == 100 * 16 * 4
    assert paths[_key(emb.weight)] in {"model.emb.weight", "model.head.weight"}


def test_parameter_subclass_and_custom_subclass_found():
    class QuantParam(torch.nn.Parameter):
        pass

    p = QuantParam(torch.ones(64, 64, dtype=torch.float16))
    plain = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    assert type(p) in tensor_types(torch)
    storages, paths = _scan(p=p, plain=plain)
    assert storages[_key(p)].bytes == 64 * 64 * 2 and storages[_key(p)].dtype == "float16"
    assert storages[_key(plain)].dtype == "bfloat16" and paths[_key(plain)] == "plain"


def test_meta_tensors_hold_no_bytes():
    meta = torch.empty(10_000, 10_000, device="meta")
    live = find_tensors(torch, None)
    try:
        assert all(r.device != "meta" for r in live.storages.values())
        assert live.byteless >= 1
    finally:
        live.release()
    del meta


def test_no_reference_kept_after_scan():
    t = torch.ones(300, 300)
    ref = weakref.ref(t)
    storages, paths = _scan(t=t)
    assert paths[_key(t)] == "t"
    del t
    gc.collect()
    assert ref() is None


def test_snapshot_keeps_no_reference(ip):
    import oom_magic

    ip.run_cell("import torch; big = torch.ones(512, 512)", store_history=True)
    ref = weakref.ref(ip.user_ns["big"])
    snap = oom_magic.snapshot("cpu")
    assert snap.held_by("big") == 512 * 512 * 4
    ip.run_cell("del big", store_history=True)
    gc.collect()
    assert ref() is None


def test_transformers_model_bytes_exact(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(config)
    storages, paths = _scan(model=model)
    expected = {_key(p): p.numel() * p.element_size() for p in model.parameters()}
    expected.update({_key(b): b.untyped_storage().nbytes() for b in model.buffers()})
    for key, nbytes in expected.items():
        assert storages[key].bytes == nbytes
    by_path = {paths[_key(p)]: p for p in model.parameters()}
    assert "model.model.layers[1].mlp.up_proj.weight" in by_path
    assert by_path["model.model.layers[1].mlp.up_proj.weight"] is model.model.layers[1].mlp.up_proj.weight


def test_library_global_is_other_with_a_python_path(monkeypatch):
    import sys
    import types

    import oom_magic

    lib = types.ModuleType("fake_lib")
    lib.CACHE = {"weights": [torch.ones(256, 256)]}
    monkeypatch.setitem(sys.modules, "fake_lib", lib)

    class Box:
        pass

    box = Box()
    box.inner = {"t": torch.ones(64, 64)}
    orphan_holder = [box]  # held only by this test's frame: not a user variable, not a module
    snap = oom_magic.snapshot("cpu", roots=Roots(), find_garbage=False)
    paths = {g.path: g for g in snap.holders("other")}
    assert paths["fake_lib.CACHE['weights'][0]"].bytes == 256 * 256 * 4
    assert any(p.endswith(".inner['t']") for p in paths), paths
    assert orphan_holder


class Row:
    """A user's record object (plain __dict__, no slots)."""

    def __init__(self, i: int) -> None:
        self.id, self.tokens, self.meta = i, [i, 13, 262], {"len": 3}


@pytest.mark.parametrize("rows", [40, 10_000])  # a normal list, and one past the walk's big-container size
def test_records_are_walked_in_bulk_yet_a_tensor_among_them_is_found(rows: int):
    records = [{"id": i, "tokens": [i, 13, 262], "meta": {"len": 3}} for i in range(rows)]
    objects = [Row(i) for i in range(rows)]
    records[rows - 7]["pixels"] = torch.ones(11)  # one row of each holds a tensor
    objects[rows // 2].pixels = torch.ones(13)
    storages, paths = _scan(records=records, objects=objects)
    assert paths[_key(records[rows - 7]["pixels"])] == f"records[{rows - 7}]['pixels']"
    assert paths[_key(objects[rows // 2].pixels)] == f"objects[{rows // 2}].pixels"


def test_a_row_class_with_a_dict_property_is_never_read_in_bulk():
    calls = []

    class Odd:
        @property
        def __dict__(self):
            calls.append(1)
            return {}

    rows = [Odd() for _ in range(64)]
    t = torch.ones(5)
    _, paths = _scan(rows=rows, t=t)
    assert calls == [] and paths[_key(t)] == "t"


@pytest.mark.parametrize("enabled", [True, False])
def test_a_scan_pauses_automatic_collection_and_puts_it_back(enabled: bool, monkeypatch):
    """A scan allocates a record per storage: with the collector on, that would start full collections."""
    from oom_magic.heap import storages, walk

    during: list[bool] = []
    # The engine never calls a subclass's methods any more (no user code runs), so the collector's
    # state is noted by wrapping the engine's own steps: grouping storages and expanding a level.
    no_subclass_code = storages._Reader.no_subclass_code
    expand = walk.Walk._expand

    def noting_grouping(self):
        during.append(gc.isenabled())
        return no_subclass_code(self)

    def noting_expand(self, level):
        during.append(gc.isenabled())
        return expand(self, level)

    monkeypatch.setattr(storages._Reader, "no_subclass_code", noting_grouping)
    monkeypatch.setattr(walk.Walk, "_expand", noting_expand)
    spy = [torch.ones(3)]
    forget_paths()  # a path remembered from an earlier scan would need no walk
    (gc.enable if enabled else gc.disable)()
    try:
        storages, paths = _scan(spy=spy)
        after = gc.isenabled()
    finally:
        gc.enable()
    assert len(during) >= 2 and not any(during) and after is enabled
    assert paths[_key(spy[0])] == "spy[0]"


def test_a_mapped_file_and_the_tensors_viewing_it_count_each_byte_once(tmp_path):
    """safetensors maps the whole file as one storage and views each tensor's range of it."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1000, 1000), "b": torch.ones(500, 1000)}, str(path))
    size = path.stat().st_size
    staged = load_file(str(path))
    start = min(t.untyped_storage().data_ptr() for t in staged.values()) - (size - 6_000_000)  # the header

    def in_file() -> list[int]:
        live = find_tensors(torch, "cpu")
        try:
            return sorted(r.bytes for r in live.storages.values() if start <= r.address < start + size)
        finally:
            live.release()

    # The tensors' bytes once; the file's own storage (kept alive by the views, from C++) adds
    # only file pages no tensor uses: not counted on the cpu.
    assert in_file() == [2_000_000, 4_000_000]
    del staged["a"]
    assert in_file() == [2_000_000]
    del staged["b"]
    assert in_file() == []  # nothing views the file any more: the mapping is gone with them


def test_the_storage_objects_a_scan_leaves_alive_change_nothing_the_next_scan_counts():
    """Reading a tensor's storage leaves torch's storage object alive beside it: the next scan finds
    one per storage on the heap, skips each (its tensor counts it), and counts the same bytes."""
    tensors = [torch.ones(10 + i) for i in range(50)]
    alone = torch.ones(30).untyped_storage()  # a storage held on its own: counted by itself
    first, _ = _scan(tensors=tensors, alone=alone)
    left = sum(1 for o in gc.get_objects() if type(o) is torch.UntypedStorage)
    again, _ = _scan(tensors=tensors, alone=alone)
    assert left >= len(tensors) + 1  # the objects this test is about are really there
    assert again == first
    assert {first[_key(t)].bytes for t in tensors} == {(10 + i) * 4 for i in range(50)}
    assert first[alone._cdata].bytes == 120 and first[alone._cdata].tensor_count == 0


def _every_tensor_by_isinstance() -> set[int]:
    """Ground truth: each live tensor's and bare storage's id, by the naive whole-heap scan."""
    return {id(o) for o in gc.get_objects() if isinstance(o, (torch.Tensor, torch.UntypedStorage))}


class _Node:
    def __init__(self) -> None:
        self.me = self
        self.t = torch.ones(7)


def _the_hard_tensors() -> dict[str, object]:
    """Tensors C++ also holds (the ones older torch's traverse skips), and ones only C++ or a cycle holds."""
    weight = torch.nn.Parameter(torch.zeros(4))
    weight.grad = torch.ones(4)
    leaf = torch.randn(3, requires_grad=True)
    out = leaf.exp()  # saved for backward: the graph holds it too
    base = torch.zeros(10)
    script = torch.jit.script(torch.nn.Linear(3, 3))
    saved_only = leaf.sin()
    keep_graph = saved_only.exp()  # its graph holds saved_only's result
    cycle = _Node()

    class Mine(torch.Tensor):
        pass

    return {"weight": weight, "grad": weight.grad, "out": out, "base": base, "view": base[2:5],
            "script": script, "script_weight": script.weight, "bare": torch.UntypedStorage(16),
            "storage_of": base.untyped_storage(), "sub": torch.zeros(2).as_subclass(Mine), "graph": keep_graph,
            "leaf": leaf, "cycle": weakref.ref(cycle)}


def _heap_pass() -> set[int]:
    from oom_magic.heap.tracker import heap_tensors, storage_types

    found = heap_tensors(torch, [*tensor_types(torch), *storage_types(torch)])
    try:
        return set(map(id, found))
    finally:
        found.clear()


def test_the_heap_pass_by_class_referrers_finds_every_tensor_the_naive_scan_finds():
    """The pass asks the tensor classes' referrers (every instance visits its class in its traverse):
    it must find all the naive isinstance scan finds, the tensors C++ also holds and those only a
    graph, a TorchScript module or a dropped cycle hold included."""
    from oom_magic.heap.tracker import instances_visit_their_class, storage_types

    hard = _the_hard_tensors()
    gc.disable()
    try:
        assert instances_visit_their_class(torch, [*tensor_types(torch), *storage_types(torch)])
        truth, found = _every_tensor_by_isinstance(), _heap_pass()
    finally:
        gc.enable()
    for name in ("weight", "grad", "out", "base", "view", "script_weight", "bare", "storage_of", "sub", "graph",
                 "leaf"):
        assert id(hard[name]) in truth and id(hard[name]) in found, name
    assert found == truth and len(truth) > 12


def test_where_the_probe_says_no_the_pass_reads_the_whole_heap_and_finds_the_same(monkeypatch):
    from oom_magic.heap import tracker

    hard = _the_hard_tensors()
    asked: list[int] = []
    real_referrers = gc.get_referrers

    def counting_referrers(*targets):
        asked.append(len(targets))
        return real_referrers(*targets)

    monkeypatch.setattr(tracker.gc, "get_referrers", counting_referrers)
    gc.disable()
    try:
        by_referrers = _heap_pass()
        assert asked, "this torch's traverse visits the class: the pass asks the referrers"
        monkeypatch.setitem(tracker._VISITED, id(torch), False)
        asked.clear()
        whole = _heap_pass()
    finally:
        gc.enable()
    assert not asked and whole == by_referrers and id(hard["grad"]) in whole


def test_the_probe_runs_no_user_mode_and_skips_while_a_dispatch_mode_is_on(monkeypatch):
    """The probe makes two tiny CPU tensors: a user's torch-function mode never sees them (it is off
    during the probe), and under a dispatch mode the probe is not run at all (asked again later)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from oom_magic.heap import tracker

    seen: list[str] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class DispatchSpy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    classes = [*tensor_types(torch), *tracker.storage_types(torch)]
    monkeypatch.delitem(tracker._VISITED, id(torch), raising=False)
    with DispatchSpy():
        assert tracker.instances_visit_their_class(torch, classes) is False
    assert id(torch) not in tracker._VISITED and seen == []
    with Spy(), torch.device("meta"):
        seen.clear()  # entering the device context is itself a torch function call the spy sees
        probed = tracker.instances_visit_their_class(torch, classes)
        during = list(seen)
    assert probed is True and during == [] and tracker._VISITED[id(torch)] is True
