"""Tests for oom_magic.notebook.watch: the cheap after-cell change check and the per-cell history.

cpu figures are real (real torch CPU tensors and modules, this process's real resident set, real
CPU out-of-memory errors). There is no GPU here, so the FAKE torch.cuda (tests/fakes/
fake_torch_cuda.py) is put on torch for the GPU cases: the watcher's own probe reads its
allocator counters (allocated, reserved, allocated peak) through ``memory_stats_as_nested_dict``.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch

from oom_magic.notebook import watch
from oom_magic.heap.roots import collect_roots
from oom_magic.heap.snapshot import snapshot
from oom_magic.notebook.watch import CellRecord, Probe, Thresholds, Watcher, cell_peak, mark_cell
from tests.fakes.fake_torch_cuda import GiB, FakeTorchCuda

MiB = 1 << 20


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FAKE torch.cuda on torch (two 80 GiB devices, CUDA initialized), read by the real probe."""
    return FakeTorchCuda(80 * GiB, 80 * GiB).install(monkeypatch, torch)


DEFAULT_THRESHOLDS = Thresholds()


def run_cell(w: Watcher, count: int, ns: dict, action=None, error: BaseException | None = None,
             thresholds: Thresholds = DEFAULT_THRESHOLDS):
    """One cell as the hooks see it: before_cell, the cell's action, after_cell."""
    w.before_cell()
    if action is not None:
        action()
    return w.after_cell(count, error, ns, thresholds)


def test_without_torch_the_watcher_does_nothing_and_never_imports_it() -> None:
    code = ("import sys\nfrom oom_magic.notebook.watch import Watcher, mark_cell\nw = Watcher()\n"
            "w.before_cell()\nchange = w.after_cell(1, None, {'x': 1})\n"
            "print(change is None, len(w.history), mark_cell('x'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "0", "False", "False"]


def test_cpu_first_cell_sets_the_baseline_and_tiny_changes_do_not_count() -> None:
    w = Watcher()
    ns: dict = {}
    first = w.after_cell(1, None, ns)  # no reading before: the extension just arrived
    assert first is not None and first.before is None and first.delta is None
    assert first.changed is False and first.variable_delta is None
    second = run_cell(w, 2, ns, lambda: ns.update(x=torch.ones(1000)))
    assert second.device == "cpu"
    assert second.variable_delta == 4000
    assert "variables" not in second.reasons
    assert second.record.rss is not None and second.record.allocated is None


def test_cpu_tensor_bound_to_a_variable_counts_even_when_no_page_is_touched() -> None:
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)
    # torch.empty maps memory without touching it: RSS barely moves, the variable check sees it.
    change = run_cell(w, 2, ns, lambda: ns.update(x=torch.empty(64 * MiB, dtype=torch.uint8)))
    assert change.variable_delta == 64 * MiB
    assert "variables" in change.reasons and change.changed
    view = run_cell(w, 3, ns, lambda: ns.update(v=ns["x"][:10], same=ns["x"]))
    assert view.variable_delta == 0 and not view.changed  # one storage, counted once
    gone = run_cell(w, 4, ns, lambda: [ns.pop(k) for k in ("x", "v", "same")])
    assert gone.variable_delta == -64 * MiB and gone.changed


def test_the_output_cache_is_not_counted_as_variables() -> None:
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)
    # What IPython's displayhook binds after a cell shows a tensor: `_`, `_2` and `Out`.
    shown = torch.empty(64 * MiB, dtype=torch.uint8)
    change = run_cell(w, 2, ns, lambda: ns.update({"_": shown, "_2": shown, "Out": {2: shown}}))
    assert change.variable_delta == 0 and "variables" not in change.reasons
    bound = run_cell(w, 3, ns, lambda: ns.update(kept=shown))
    assert bound.variable_delta == 64 * MiB  # the same tensor, now bound by the user


def test_cpu_module_parameters_and_buffers_count_once() -> None:
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)
    change = run_cell(w, 2, ns, lambda: ns.update(model=torch.nn.Linear(2048, 2048)))
    assert change.variable_delta == (2048 * 2048 + 2048) * 4
    assert change.changed
    alias = run_cell(w, 3, ns, lambda: ns.update(weight=ns["model"].weight, again=ns["model"]))
    assert alias.variable_delta == 0


def test_cpu_resident_set_growth_counts_without_any_variable(reset_high_water) -> None:
    w = Watcher()
    ns: dict = {}
    kept: list = []
    w.after_cell(1, None, ns)
    change = run_cell(w, 2, ns, lambda: kept.append(torch.ones(64 * MiB, dtype=torch.uint8)))
    assert change.variable_delta == 0
    assert change.delta is not None and change.delta >= 60 * MiB
    assert "rss" in change.reasons
    assert change.record.peak is not None and change.record.peak >= change.record.rss


def test_no_strong_reference_survives_a_check() -> None:
    w = Watcher()
    ns = {"model": torch.nn.Linear(64, 64), "x": torch.ones(10)}
    refs = [weakref.ref(ns["model"]), weakref.ref(ns["x"])]
    run_cell(w, 1, ns)
    run_cell(w, 2, ns)
    ns.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_objects_that_lie_about_their_class_are_never_asked() -> None:
    class Liar:
        calls = 0

        @property
        def __class__(self):  # isinstance() would consult this; type() does not
            Liar.calls += 1
            return torch.Tensor

        def __getattr__(self, name):
            Liar.calls += 1
            raise RuntimeError("touched")

    w = Watcher()
    ns = {"liar": Liar()}
    w.after_cell(1, None, ns)
    change = run_cell(w, 2, ns)
    assert change.variable_delta == 0
    assert Liar.calls == 0


def test_gpu_thresholds_on_allocated_and_reserved(fake_cuda) -> None:
    fake = fake_cuda
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)
    below = run_cell(w, 2, ns, lambda: fake.hold(MiB - 1))
    assert below.delta == MiB - 1 and not below.changed
    at = run_cell(w, 3, ns, lambda: fake.hold(2 * MiB - 1))
    assert at.delta == MiB and at.reasons == ("allocated", "reserved")
    grown = run_cell(w, 4, ns, lambda: fake.hold(fake.memory_allocated(), reserved=40 * MiB))  # the cache grew only
    assert grown.reasons == ("reserved",) and grown.delta == 0
    # empty_cache(): allocated unchanged, the cache goes back.
    released = run_cell(w, 5, ns, lambda: fake.hold(2 * MiB - 1, reserved=2 * MiB))
    assert released.reasons == ("reserved",)
    assert released.record.reserved == 2 * MiB and released.record.allocated == 2 * MiB - 1
    assert released.record.rss is None


def test_gpu_per_cell_peak_known_only_when_the_high_water_mark_says_so(fake_cuda) -> None:
    fake = fake_cuda
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)

    def load_then_free_temporaries() -> None:
        fake.hold(13 * 1024 * MiB)   # weights + temporaries
        fake.hold(12 * 1024 * MiB)   # temporaries freed

    load = run_cell(w, 2, ns, load_then_free_temporaries)
    assert load.delta == 12 * 1024 * MiB
    assert load.record.peak == 13 * 1024 * MiB and load.peak_delta == 13 * 1024 * MiB
    small = run_cell(w, 3, ns, lambda: fake.hold(12 * 1024 * MiB + 5 * MiB))
    assert small.record.peak is None and small.peak_delta is None  # below the old mark: unknown


def test_cuda_initialized_during_the_cell_compares_with_nothing_held(fake_cuda) -> None:
    fake_cuda.initialized = False
    w = Watcher()
    w.before_cell()  # cpu: no CUDA yet
    fake_cuda.init()
    fake_cuda.hold(9 * MiB)
    fake_cuda.hold(8 * MiB, reserved=20 * MiB)
    change = w.after_cell(7, None, {})
    assert change.device == "cuda:0"
    assert change.delta == 8 * MiB and change.reasons == ("allocated", "reserved")
    assert change.record.peak == 9 * MiB


@pytest.mark.parametrize("level_before, high_before, level_after, high_after, expected", [
    (0, 0, 10, 12, 12),            # the mark rose: the cell's peak
    (10, 20, 12, 20, None),        # below an older mark: unknown
    (10, 10, 5, 10, 10),           # the mark is the level the cell started at
    (None, None, 5, 9, None),      # nothing before: unknown
    (10, 20, 5, 8, None),          # the mark was reset in the cell: unknown
    (10, 10, 10, 10, 10),          # nothing moved and the mark is the level: that is the peak
])
def test_cell_peak(level_before, high_before, level_after, high_after, expected) -> None:
    assert cell_peak(level_before, high_before, level_after, high_after) == expected


def test_a_cell_peak_is_never_below_where_the_cell_ended() -> None:
    assert cell_peak(0, 10, 30, 25) == 30


def test_out_of_memory_errors_mark_the_cell() -> None:
    w = Watcher()
    ns: dict = {}
    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as exc:
        error = exc
    else:  # pragma: no cover - a machine with a PiB of memory
        pytest.skip("the allocation succeeded")
    oom = w.after_cell(1, error, ns)
    assert oom.oom and oom.record.oom
    other = w.after_cell(2, ValueError("not memory"), ns)
    assert not other.oom


def test_mark_cell_labels_the_running_cell_only_while_active() -> None:
    w = Watcher()
    ns: dict = {}
    assert mark_cell("load", oom=True) is False
    watch.activate(w)
    try:
        w.before_cell()
        assert mark_cell("load tiny-llama", oom=True) is True
        labelled = w.after_cell(5, None, ns)
        plain = run_cell(w, 6, ns)
    finally:
        watch.deactivate(w)
    assert labelled.record.label == "load tiny-llama" and labelled.oom
    assert plain.record.label is None and not plain.oom
    assert mark_cell("late") is False


def test_history_is_capped_oldest_first() -> None:
    w = Watcher(history_limit=3)
    ns: dict = {}
    for count in range(1, 6):
        run_cell(w, count, ns)
    assert [r.execution_count for r in w.records()] == [3, 4, 5]
    assert all(isinstance(r, CellRecord) for r in w.history)


def test_note_scan_stores_the_tensor_bytes_in_that_cells_record() -> None:
    w = Watcher()
    ns = {"x": torch.ones(1024)}
    change = run_cell(w, 1, ns)
    snap = snapshot("cpu", roots=collect_roots(namespace=ns))
    updated = w.note_scan(snap, change.record)
    assert updated is not None and updated.tensor_bytes == snap.tracked_bytes
    assert snap.tracked_bytes >= 4096
    assert w.history[-1].tensor_bytes == snap.tracked_bytes
    assert w.note_scan(snap, change.record) is None  # not the last record any more (replaced)


def test_records_filter_by_device(fake_cuda) -> None:
    fake_cuda.set_device(1)
    w = Watcher()
    run_cell(w, 1, {})
    assert [r.device for r in w.records("cuda:1")] == ["cuda:1"]
    assert w.records("cpu") == ()


def test_with_the_cells_source_only_new_mentioned_and_tracked_names_are_checked() -> None:
    w = Watcher()
    ns: dict = {f"_i{i}": "x = 1" for i in range(5000)}
    ns["model"] = 1
    w.after_cell(1, None, ns, source="")  # first call: every key, once
    bound = w._bound
    ns["_i5000"] = "y = torch.empty(...)"
    ns["y"] = torch.empty(64 * MiB, dtype=torch.uint8)  # a new key: at the dict's end
    assert set(bound._candidates(ns, "y = torch.empty(64 << 20)")) == {"y", "_i5000"}
    new = w.after_cell(2, None, ns, source="y = torch.empty(64 << 20)")
    assert new.variable_delta == 64 * MiB
    # An old key rebound in place keeps its position: found because the cell names it.
    ns["model"] = torch.nn.Linear(2048, 2048)
    rebound = w.after_cell(3, None, ns, source="model = torch.nn.Linear(2048, 2048)")
    assert rebound.variable_delta == (2048 * 2048 + 2048) * 4
    # A tracked name removed by something the source does not show (%reset_selective, a function).
    del ns["y"]
    gone = w.after_cell(4, None, ns, source="cleanup()")
    assert gone.variable_delta == -64 * MiB
    assert gone.variable_bytes == (2048 * 2048 + 2048) * 4


def test_switching_gpus_leaves_nothing_to_compare_with(fake_cuda) -> None:
    fake_cuda.hold(9 * MiB)
    fake_cuda.hold(8 * MiB, reserved=20 * MiB)
    w = Watcher()
    w.before_cell()  # cuda:0
    fake_cuda.set_device(1)
    fake_cuda.hold(4 * MiB, device=1)
    change = w.after_cell(3, None, {})
    assert change.device == "cuda:1" and change.before is None and change.delta is None
    assert not change.changed


def test_a_mark_in_a_cell_without_torch_does_not_leak_into_a_later_cell(monkeypatch) -> None:
    w = Watcher()
    watch.activate(w)
    try:
        monkeypatch.setattr(watch, "loaded_torch", lambda: None)  # as if torch were not imported yet
        mark_cell("early", oom=True)
        assert w.after_cell(1, None, {}) is None
        monkeypatch.undo()
        later = w.after_cell(2, None, {})
    finally:
        watch.deactivate(w)
    assert later.record.label is None and not later.oom


def test_a_guards_own_peak_stands_in_when_it_reset_the_high_water_mark() -> None:
    # Each cell reads 500 MiB resident before and 520 MiB after; the high-water mark reads 900 MiB
    # before and 700 MiB after, because the guard reset it during the cell (VmHWM via clear_refs).
    readings = iter([Probe("cpu", rss=500 * MiB, high_water=900 * MiB), Probe("cpu", rss=520 * MiB, high_water=700 * MiB)] * 3)
    w = Watcher(probe=lambda torch: next(readings))
    w.before_cell()
    assert w.after_cell(1, None, {}).record.peak is None  # reset inside, nothing said: unknown
    w.before_cell()
    w.mark("%%guardload", peak=(700 * MiB, "resident"))  # what the guard measured after its reset
    change = w.after_cell(2, None, {})
    assert change.record.peak == 700 * MiB and change.record.label == "%%guardload"
    w.before_cell()
    w.mark("%%guardload", peak=(700 * MiB, "allocated"))  # another measure than this device's: not used
    assert w.after_cell(3, None, {}).record.peak is None


def test_what_our_own_scan_keeps_resident_is_not_the_cells_change() -> None:
    """Pages touched inside ``own_scan`` (a %gpumem in the cell) are taken off the cell's resident
    change; the same pages touched by the cell's own code count."""
    w = Watcher()
    ns: dict = {}
    w.after_cell(1, None, ns)
    kept: list[bytes] = []

    def scan_that_keeps_pages() -> None:
        with w.own_scan():
            kept.append(b"x" * (64 * MiB))  # written: resident, as a scan's freed lists stay in the C heap

    ours = run_cell(w, 2, ns, scan_that_keeps_pages)
    assert ours.delta is not None and abs(ours.delta) < 16 * MiB and "rss" not in ours.reasons
    users = run_cell(w, 3, ns, lambda: kept.append(b"y" * (64 * MiB)))
    assert users.delta is not None and users.delta >= 60 * MiB and "rss" in users.reasons
    after = run_cell(w, 4, ns)
    assert abs(after.delta) < 16 * MiB  # the discount is the one cell's alone
