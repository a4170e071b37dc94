"""The ways to make a checkpoint fit a device, each with its size for this model.

Lower dtypes and quantization by transformers' own rules (through the estimate), ``device_map="auto"``
with a ``max_memory`` that fits, disk offload when the disk suffices; for ``torch.load``, CPU-first
loading, ``mmap=True`` and loading only the model's weights. Used by the fit check before a load
and by the diagnosis after one fails, so both offer the same options with the same sizes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..records.diagnosis import FitOption

if TYPE_CHECKING:
    from ..checkpoints.estimate import CheckpointEstimate

__all__ = ["bitsandbytes_installed", "device_index", "fit_options"]

_HALF = "bfloat16"


def device_index(device: str) -> int | str:
    """The key accelerate's ``max_memory`` uses for a device: 0 for cuda:0, 'mps', 'cpu'."""
    kind, _, index = device.partition(":")
    if kind in ("cuda", "hip", "xpu"):
        return int(index or 0)
    return kind


def fit_options(estimate: CheckpointEstimate, *, device: str, need: int | None = None,
                dtype: str | None = None, loader: str = "from_pretrained",
                device_budget: int | None = None, ram_budget: int | None = None,
                disk_budget: int | None = None, model_part: tuple[str, int] | None = None,
                offload_folder: str = "offload", compute_capability: tuple[int, int] | None = None,
                ) -> tuple[FitOption, ...]:
    """The ways to make this checkpoint fit on ``device``, with their sizes for this model.

    ``need`` is what the load as written puts on the device (default: the estimate's bytes),
    ``dtype`` the dtype it loads in (None: as stored). Budgets are bytes usable after headroom:
    ``device_budget`` on the device, ``ram_budget`` in CPU RAM, ``disk_budget`` on the disk that
    would hold ``offload_folder``. For ``loader='torch.load'``: CPU-first loading, ``mmap=True``
    and, with ``model_part=(key, bytes)``, loading only the model's weights.
    ``compute_capability`` (NVIDIA's, when known): below 8.0 there is no native bfloat16, so the
    half-precision options are float16, and LLM.int8() needs 7.5. 8-bit and 4-bit options need
    bitsandbytes: where it is not installed they say so (``needs``) and do not count as fitting.
    """
    need = estimate.bytes if need is None else need

    def fits(nbytes: int, budget: int | None) -> bool | None:
        return None if budget is None else nbytes <= budget

    options: list[FitOption] = []
    if loader == "vllm":
        return ()  # vLLM's own knobs (gpu_memory_utilization, max_model_len) are said with its verdict
    if loader == "torch.load":
        if device != "cpu":
            options.append(FitOption("map-location-cpu", 0, fits(need, ram_budget), cpu_bytes=need))
        options.append(FitOption("mmap", 0 if device == "cpu" else need, True if device == "cpu" else fits(need, device_budget),
                                 cpu_bytes=0))
        if model_part is not None:
            key, part = model_part
            options.append(FitOption("skip-optimizer", part, fits(part, device_budget if device != "cpu" else ram_budget),
                                     key=key))
        return tuple(options)
    if loader == "load_file":
        if device != "cpu":
            options.append(FitOption("device-cpu", 0, fits(need, ram_budget), cpu_bytes=need))
        return tuple(options)
    current = _canonical(dtype)
    # No native bfloat16 below compute capability 8.0 (T4, V100): float16 is the half that runs there.
    half_dtype = "float16" if compute_capability is not None and compute_capability < (8, 0) else _HALF
    rest = current if current in ("bfloat16", "float16") else half_dtype
    offer_half = current not in ("bfloat16", "float16", "int8", "nf4")
    offer_int8 = current not in ("int8", "nf4")
    offer_nf4 = current != "nf4"
    # the figures below, sized together (one child process, not three, when torch is not imported)
    asked = (((half_dtype, False), offer_half), (("int8", False), offer_int8), (("nf4", True), offer_nf4))
    estimate.prepare_rules(tuple(load for load, offered in asked if offered), unquantized_dtype=rest)
    if offer_half:
        half = estimate.bytes_for(half_dtype)
        if half < need:
            options.append(FitOption("bfloat16", half, fits(half, device_budget), dtype=half_dtype))
    if offer_int8:
        int8 = estimate.bytes_for("int8", unquantized_dtype=rest)
        options.append(_quantized(FitOption("int8", int8, fits(int8, device_budget), dtype=rest), compute_capability))
    if offer_nf4:
        nf4 = estimate.bytes_for("nf4", double_quant=True, unquantized_dtype=rest)
        options.append(_quantized(FitOption("nf4", nf4, fits(nf4, device_budget), dtype=rest), compute_capability))
    options += _spread_options(need, device, current, device_budget, ram_budget, disk_budget, offload_folder)
    return tuple(options)


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be imported here (looked up, not imported: it would load CUDA libraries)."""
    from importlib.util import find_spec

    try:
        return find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        return False


def _quantized(option: FitOption, capability: tuple[int, int] | None) -> FitOption:
    """An 8-bit or 4-bit option, marked as not fitting when bitsandbytes cannot run it here."""
    from dataclasses import replace

    if not bitsandbytes_installed():
        return replace(option, fits=False, needs="bitsandbytes")
    if option.kind == "int8" and capability is not None and capability < (7, 5):
        return replace(option, fits=False, needs="compute capability 7.5+")  # LLM.int8(): Turing or newer
    return option


def _spread_options(need: int, device: str, dtype: str | None, device_budget: int | None,
                    ram_budget: int | None, disk_budget: int | None, folder: str) -> list[FitOption]:
    """device_map="auto" with a max_memory that fits this device and this RAM, then disk offload."""
    if device_budget is None or ram_budget is None or ram_budget <= 0:
        return []  # accelerate reads every weight through RAM: a plan with max_memory {"cpu": 0} cannot run
    device_budget = max(device_budget, 0)
    options: list[FitOption] = []
    if device == "cpu":
        on_ram = min(need, ram_budget)
        spill = need - on_ram
        if spill > 0:
            options.append(FitOption("offload-folder", on_ram, None if disk_budget is None else spill <= disk_budget,
                                     disk_bytes=spill, dtype=dtype, max_memory=(("cpu", ram_budget),),
                                     offload_folder=folder))
        return options
    key = device_index(device)
    on_device = min(need, device_budget)
    on_ram = min(need - on_device, ram_budget)
    spill = need - on_device - on_ram
    budget = ((key, device_budget), ("cpu", ram_budget))
    if need > device_budget:
        options.append(FitOption("device-map-auto", on_device, spill == 0, cpu_bytes=on_ram, dtype=dtype,
                                 max_memory=budget))
    if spill > 0:
        options.append(FitOption("offload-folder", on_device, None if disk_budget is None else spill <= disk_budget,
                                 cpu_bytes=on_ram, disk_bytes=spill, dtype=dtype, max_memory=budget,
                                 offload_folder=folder))
    return options


def _canonical(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    text = str(dtype).strip().lower().removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "8bit": "int8", "4bit": "nf4", "fp4": "nf4"}.get(text, text)
