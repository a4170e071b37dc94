"""The known-GPU table, --target parsing, the memory-fraction math and the cap's restore."""
from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oom_magic.common.errors import OomMagicError
from oom_magic.common.sizes import parse_size
from oom_magic.fit.targets import Cap, Target, capped, known_targets, memory_fraction_for, parse_target
from tests.fakes.fake_torch_cuda import FakeOutOfMemoryError, FakeTorchCuda

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 500 * MiB
DEFAULT_DRIVER = 768 * MiB


def _raw_table() -> dict:
    text = resources.files("oom_magic").joinpath("data").joinpath("gpus.json").read_text(encoding="utf-8")
    return json.loads(text)


# -- the table ----------------------------------------------------------------------------------

def test_every_known_gpu_has_a_capacity_and_a_source():
    targets = known_targets()
    names = [t.name for t in targets]
    for expected in ("T4", "L4", "A10G", "A10", "RTX3090", "RTX4090", "A100-40GB", "A100-80GB",
                     "H100-80GB", "H100-NVL", "H200", "L40S", "V100-16GB", "V100-32GB", "MI250X", "MI300X"):
        assert expected in names
    assert len(set(names)) == len(names)
    for t in targets:
        assert isinstance(t.total, int) and isinstance(t.usable, int)
        assert 0 < t.usable < t.total
        assert t.context_reserve == t.total - t.usable
        assert t.context_reserve >= CONTEXT
        assert "https://" in t.source, t.name
        assert "CUDA context assumed 500MiB" in t.source


def test_table_figures_are_the_reported_ones():
    by_name = {t.name: t for t in known_targets()}
    t4 = by_name["T4"]
    assert t4.total == 15360 * MiB  # nvidia-smi
    assert t4.usable == parse_size("14.56GiB") - CONTEXT  # CUDA's total minus the context
    a100 = by_name["A100-40GB"]
    assert a100.total == 40960 * MiB
    assert a100.usable == 42298834944 - CONTEXT
    a10 = by_name["A10"]
    assert a10.total == 24146608128 == 23028 * MiB
    # No CUDA-reported total recorded: the default driver reservation is assumed.
    h200 = by_name["H200"]
    assert h200.total == 143771 * MiB
    assert h200.context_reserve == DEFAULT_DRIVER + CONTEXT
    assert "driver reservation assumed 768MiB" in h200.source
    # AMD: the HIP total is both figures, so only the context is reserved.
    mi300x = by_name["MI300X"]
    assert mi300x.total == 206141652992
    assert mi300x.context_reserve == CONTEXT


def test_default_driver_reservation_covers_every_recorded_gap():
    data = _raw_table()
    default = parse_size(data["default_driver_reserved"]["size"])
    gaps = {
        e["name"]: parse_size(e["total"]) - parse_size(e["device_total"])
        for e in data["gpus"] if e.get("device_total")
    }
    assert len(gaps) >= 10
    assert all(gap >= 0 for gap in gaps.values())
    assert max(gaps.values()) <= default
    assert max(gaps, key=gaps.get) == "A100-80GB" and gaps["A100-80GB"] == 768 * MiB


def test_every_table_entry_cites_each_figure():
    for entry in _raw_table()["gpus"]:
        assert entry["total_source"].strip(), entry["name"]
        if entry.get("device_total"):
            assert entry["device_total_source"].strip(), entry["name"]


# -- parse_target ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, name", [
    ("T4", "T4"), ("t4", "T4"), ("Tesla T4", "T4"),
    ("a100-80gb", "A100-80GB"), ("A100_80GB", "A100-80GB"), ("a100 80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("A100-40GB", "A100-40GB"),
    ("h100", "H100-80GB"), ("H100 80GB HBM3", "H100-80GB"), ("h100-pcie", "H100-80GB"), ("H100 NVL", "H100-NVL"),
    ("rtx4090", "RTX4090"), ("GeForce RTX 4090", "RTX4090"), ("4090", "RTX4090"),
    ("a10g", "A10G"), ("A10", "A10"), ("l40s", "L40S"), ("h200", "H200"),
    ("v100-32gb", "V100-32GB"), ("mi300x", "MI300X"), ("AMD Instinct MI250X", "MI250X"),
])
def test_known_names_any_spelling(text, name):
    target = parse_target(text)
    assert target.name == name
    assert target is parse_target(name)


@pytest.mark.parametrize("text, total", [
    ("16GiB", 16 * GiB), ("15360MiB", 15360 * MiB), ("16 GiB", 16 * GiB), ("2.5G", int(2.5 * GiB)),
])
def test_sizes(text, total):
    target = parse_target(text)
    assert target.total == total
    assert target.context_reserve == DEFAULT_DRIVER + CONTEXT
    assert target.usable == total - DEFAULT_DRIVER - CONTEXT
    assert target.name == text.replace(" ", "")
    assert "size given as the target" in target.source


def test_a_target_passes_through():
    t4 = parse_target("T4")
    assert parse_target(t4) is t4


@pytest.mark.parametrize("text, fragment", [
    ("A99", "unknown target 'A99': give a size such as 16GiB or one of T4, L4,"),
    ("A100", "(did you mean A100-40GB or A100-80GB?)"),
    ("v100", "(did you mean V100-16GB or V100-32GB?)"),
    ("16", "has no unit: write a size such as 16MiB or 16GiB, or a GPU name"),
    ("512MiB", "no more than what a GPU keeps for its driver and the CUDA context (768MiB + 500MiB)"),
    ("16XB", "cannot read size '16XB'"),
    ("  ", "empty target"),
])
def test_bad_targets_are_one_line_errors(text, fragment):
    with pytest.raises(OomMagicError) as info:
        parse_target(text)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_unknown_target_names_every_known_gpu():
    with pytest.raises(OomMagicError) as info:
        parse_target("TPUv5")
    for t in known_targets():
        assert t.name in str(info.value)


# -- memory_fraction_for --------------------------------------------------------------------------

H100_CUDA_TOTAL = parse_size("79.11GiB")


def test_fraction_is_target_plus_what_is_already_held():
    t4 = parse_target("T4")
    fraction = memory_fraction_for(t4.usable, H100_CUDA_TOTAL, 2 * GiB)
    cap = int(fraction * H100_CUDA_TOTAL)  # what the allocator computes (C++ truncation)
    assert cap in (t4.usable + 2 * GiB, t4.usable + 2 * GiB - 1)
    assert 0.0 < fraction < 1.0


def test_no_cap_when_the_device_is_not_larger():
    a100 = parse_target("A100-80GB")
    assert memory_fraction_for(a100.usable, parse_size("39.5GiB")) == 1.0
    # Target alone fits, but target plus what is already held does not: no tighter cap exists.
    t4 = parse_target("T4")
    assert memory_fraction_for(t4.usable, 20 * GiB, 8 * GiB) == 1.0
    assert memory_fraction_for(0, 20 * GiB) == 0.0


@settings(max_examples=300, deadline=None)
@given(
    usable=st.integers(min_value=0, max_value=2**40),
    total=st.integers(min_value=1, max_value=2**41),
    held=st.integers(min_value=0, max_value=2**40),
)
def test_fraction_never_caps_above_the_intended_byte(usable, total, held):
    fraction = memory_fraction_for(usable, total, held)
    assert 0.0 <= fraction <= 1.0
    limit = usable + held
    if limit >= total:
        assert fraction == 1.0
    else:
        assert limit - 1 <= int(fraction * total) <= limit


@pytest.mark.parametrize("args", [(-1, 10), (1, 0), (1, 10, -5), (1.5, 10), (True, 10), (1, "10")])
def test_fraction_rejects_bad_figures(args):
    with pytest.raises(OomMagicError):
        memory_fraction_for(*args)


def test_the_cap_fails_a_load_the_target_cannot_hold():
    """On the fake allocator: the cell gets the target's usable memory, not the cache on top."""
    t4 = parse_target("T4")
    cuda = FakeTorchCuda(H100_CUDA_TOTAL)
    cuda.allocate(3 * GiB)
    cuda.free(1 * GiB)  # 2 GiB live, 1 GiB cached
    held = cuda.memory_allocated(0)
    fraction = memory_fraction_for(t4.usable, cuda.get_device_properties(0).total_memory, held)
    with capped(cuda, 0, fraction):
        with pytest.raises(FakeOutOfMemoryError):
            cuda.allocate(t4.usable + 64 * MiB)
    cuda2 = FakeTorchCuda(H100_CUDA_TOTAL)
    cuda2.allocate(3 * GiB)
    cuda2.free(1 * GiB)
    with capped(cuda2, 0, memory_fraction_for(t4.usable, H100_CUDA_TOTAL, cuda2.memory_allocated(0))):
        cuda2.allocate(t4.usable - MiB)  # fits: uses the 1 GiB cache plus new segments
        assert cuda2.memory_allocated(0) == 2 * GiB + t4.usable - MiB
    # Counting the cache as held would have let the cell take more than a T4 has.
    cuda3 = FakeTorchCuda(H100_CUDA_TOTAL)
    cuda3.allocate(3 * GiB)
    cuda3.free(1 * GiB)
    too_generous = memory_fraction_for(t4.usable, H100_CUDA_TOTAL, cuda3.memory_reserved(0))
    with capped(cuda3, 0, too_generous):
        cuda3.allocate(t4.usable + 512 * MiB)  # would have failed on the T4


# -- capped ----------------------------------------------------------------------------------------

def test_capped_sets_and_restores_the_previous_fraction():
    cuda = FakeTorchCuda(80 * GiB)
    cuda.set_per_process_memory_fraction(0.9, 0)
    before = cuda.get_per_process_memory_fraction(0)
    with capped(cuda, 0, 0.25) as cap:
        assert isinstance(cap, Cap)
        assert cap.fraction == 0.25 and cap.device_index == 0
        assert cap.previous == before and cap.restore_to == before
        assert cuda.get_per_process_memory_fraction(0) == pytest.approx(0.25)
    assert cuda.set_calls(0) == [0.9, 0.25, before]
    assert cuda.get_per_process_memory_fraction(0) == pytest.approx(0.9)


def test_capped_restores_on_failure():
    cuda = FakeTorchCuda(80 * GiB)
    with pytest.raises(FakeOutOfMemoryError):
        with capped(cuda, 0, 0.1):
            cuda.allocate(9 * GiB)
    assert cuda.get_per_process_memory_fraction(0) == 1.0
    assert cuda.set_calls(0) == [0.1, 1.0]


def test_capped_restores_on_keyboard_interrupt():
    cuda = FakeTorchCuda(80 * GiB, 40 * GiB)
    with pytest.raises(KeyboardInterrupt):
        with capped(cuda, 1, 0.5):
            raise KeyboardInterrupt
    assert cuda.set_calls(1) == [0.5, 1.0]
    assert cuda.set_calls(0) == []


def test_capped_without_a_getter_restores_the_default():
    cuda = FakeTorchCuda(80 * GiB, has_getter=False)
    assert not hasattr(cuda, "get_per_process_memory_fraction")
    with capped(cuda, 0, 0.3) as cap:
        assert cap.previous is None and cap.restore_to == 1.0
    assert cuda.set_calls(0) == [0.3, 1.0]


def test_a_failed_restore_does_not_hide_the_cells_error():
    cuda = FakeTorchCuda(80 * GiB, fail_restore=True)
    with pytest.raises(ZeroDivisionError) as info:
        with capped(cuda, 0, 0.3):
            1 / 0
    notes = getattr(info.value, "__notes__", [])
    assert any("could not restore the memory fraction 1.0 on cuda:0" in n for n in notes)


def test_a_failed_restore_after_success_raises():
    cuda = FakeTorchCuda(80 * GiB, fail_restore=True)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with capped(cuda, 0, 0.3):
            pass


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "0.5", None, True])
def test_capped_rejects_bad_fractions_before_touching_torch(fraction):
    cuda = FakeTorchCuda(80 * GiB)
    with pytest.raises(OomMagicError):
        with capped(cuda, 0, fraction):
            pass
    assert cuda.set_calls(0) == []


def test_capped_passes_an_int_fraction_as_float():
    cuda = FakeTorchCuda(80 * GiB)
    with capped(cuda, 0, 1):
        pass
    assert cuda.set_calls(0) == [1.0, 1.0]


def test_real_torch_has_the_calls_capped_makes():
    """The names capped() calls exist on the installed torch.cuda (no CUDA call is made)."""
    import torch

    assert callable(torch.cuda.set_per_process_memory_fraction)
    assert callable(torch.cuda.get_per_process_memory_fraction)
    assert hasattr(torch.cuda, "get_device_properties")


def test_target_repr_is_short():
    assert repr(parse_target("T4")).startswith("Target('T4', total=16106127360, usable=")
    assert isinstance(parse_target("T4"), Target)
