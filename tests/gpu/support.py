"""Shared by the GPU suite and its runner: the CUDA probe, fresh interpreters, and ground truth.

Ground truth is read straight from PyTorch (``torch.cuda.memory_allocated`` and friends, the
allocator's own ``memory_snapshot``) and from NVML through ``pynvml`` itself, never through
oom-magic's figures, so a check compares our figures with independent ones. *Which* NVML device
is torch's ``cuda:N`` is the one thing taken from the package (``oom_magic.device.nvml``): on a MIG
instance or with CUDA_VISIBLE_DEVICES remapped, NVML index 0 or the parent GPU's PCI handle is
the wrong device, and the suite must fail only for the package's own mistakes.

Importing this module imports neither torch nor IPython (the runner imports it to probe for a
GPU); every function that needs torch takes it as an argument or imports it inside.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT_MARK = "@@OOM_MAGIC_RESULT@@"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# Allocator settings that change how memory is laid out: the suite controls them itself.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
PROBE_ENV = "OOM_MAGIC_GPU_PROBE"  # the runner hands its probe result to pytest through this
ROWS_ENV = "OOM_MAGIC_GPU_ROWS"  # JSON-lines file the suite appends its rows to
OUT_ENV = "OOM_MAGIC_GPU_OUT"  # folder for JSON and plots (default gpu-check-out/)

_PROBE_SOURCE = r'''
import json
out = {"available": False, "reason": None}
try:
    import torch
except Exception as exc:
    out["reason"] = "torch cannot be imported (%s: %s)" % (type(exc).__name__, exc)
else:
    out["torch"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["hip_build"] = getattr(torch.version, "hip", None)
    if out["hip_build"]:
        out["reason"] = "torch %s is a ROCm build: this suite checks NVIDIA GPUs (CUDA + NVML)" % torch.__version__
    elif torch.version.cuda is None:
        out["reason"] = "torch %s is a CPU-only build (torch.version.cuda is None)" % torch.__version__
    elif not torch.cuda.is_available():
        out["reason"] = ("torch.cuda.is_available() is False (torch %s built for CUDA %s): "
                         "no NVIDIA GPU or driver is visible" % (torch.__version__, torch.version.cuda))
    else:
        out["available"] = True
        out["device_count"] = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        out["device_name"] = props.name
        out["total_memory"] = int(props.total_memory)
        out["capability"] = list(torch.cuda.get_device_capability(0))
try:
    import pynvml
    pynvml.nvmlInit()
    driver = pynvml.nvmlSystemGetDriverVersion()
    out["driver"] = driver.decode() if isinstance(driver, bytes) else driver
except Exception as exc:
    out["nvml"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
'''


def probe_cuda(timeout: float = 180.0) -> dict[str, Any]:
    """Ask a fresh interpreter whether CUDA works here; {'available': bool, 'reason': str, ...}.

    A subprocess, so the asking process never initialises CUDA (or even imports torch).
    """
    cached = os.environ.get(PROBE_ENV)
    if cached:
        try:
            return json.loads(cached)
        except ValueError:
            pass
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_SOURCE], capture_output=True, text=True,
                              timeout=timeout, env=_child_env({}, ()))
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"the CUDA probe did not answer within {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"available": False, "reason": f"the CUDA probe failed (exit {done.returncode}): {tail[0]}"}
    return json.loads(lines[-1])


# -- fresh interpreters -----------------------------------------------------------------------


def nvml_processes() -> dict[int, int | None]:
    """Every process NVML lists on any GPU or MIG instance: pid -> device bytes (None where NVML cannot say).

    A GPU in MIG mode lists its processes without bytes: each MIG instance's own handle gives them.
    """
    import pynvml
    from oom_magic.device.nvml import Nvml

    pynvml.nvmlInit()
    nvml = Nvml(module=pynvml)
    found: dict[int, int | None] = {}
    for device in nvml.devices():
        handle = None if device.mig_enabled else nvml.handle(device)
        if handle is None:
            continue
        for listing in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                        pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                processes = listing(handle)
            except pynvml.NVMLError:
                continue
            for proc in processes:
                used = proc.usedGpuMemory
                used = int(used) if isinstance(used, int) and 0 <= used < 2**64 - 1 else None
                previous = found.get(int(proc.pid))
                found[int(proc.pid)] = used if previous is None else max(previous, used or 0)
    return found


def _child_prelude() -> str:
    return "\n".join([
        "import json, os, sys",
        f"RESULT_MARK = {RESULT_MARK!r}",
        "def emit(obj):",
        "    print(RESULT_MARK + json.dumps(obj, default=str), flush=True)",
        "def start_shell():",
        "    from IPython.testing.globalipapp import start_ipython",
        "    return start_ipython()",
        "def cell(ip, source):",
        "    result = ip.run_cell(source, store_history=True)",
        "    error = result.error_in_exec or result.error_before_exec",
        "    return None if error is None else f'{type(error).__name__}: {error}'",
        inspect.getsource(nvml_processes),
    ])


def _child_env(extra: dict[str, str], drop: tuple[str, ...]) -> dict[str, str]:
    env = dict(os.environ)
    for name in drop:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_fresh(code: str, *, env: dict[str, str] | None = None, timeout: float = 240.0) -> dict[str, Any]:
    """Run ``code`` in a fresh ``sys.executable`` and return the object it passed to ``emit()``.

    The child gets ``emit``, ``start_shell`` (a real IPython shell from
    ``IPython.testing.globalipapp``), ``cell(ip, source)`` (error text or None) and
    ``nvml_processes()``; the allocator settings variables are removed unless ``env`` sets them.
    """
    source = _child_prelude() + "\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout,
                          env=_child_env(env or {}, ALLOC_CONF_VARS), cwd=str(REPO))
    results = [line[len(RESULT_MARK):] for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not results:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise AssertionError(f"the fresh interpreter emitted no result (exit {done.returncode}):\n{tail}")
    return json.loads(results[-1])


# -- ground truth in this process -------------------------------------------------------------


def nvml_handle(torch: Any, index: int = 0) -> Any:
    """pynvml's handle for torch's ``cuda:index``, found as the package finds it.

    ``oom_magic.device.nvml.nvml_device_for_torch``: the PCI bus id when CUDA is initialized, else
    CUDA_VISIBLE_DEVICES (indices, GPU/MIG UUIDs); a GPU in MIG mode is its MIG instance.
    """
    import pynvml
    from oom_magic.device.nvml import Nvml, format_pci_bus_id, nvml_device_for_torch

    pynvml.nvmlInit()
    nvml = Nvml(module=pynvml)
    bus = None
    if torch.cuda.is_initialized():
        props = torch.cuda.get_device_properties(index)
        parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        if all(isinstance(p, int) for p in parts):
            bus = format_pci_bus_id(*parts)
    device = nvml_device_for_torch(nvml, index, bus)
    handle = None if device is None else nvml.handle(device)
    if handle is None:
        raise AssertionError(f"NVML has no device for cuda:{index} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): {nvml.errors_text()}")
    return handle


def nvml_memory(torch: Any, index: int = 0) -> dict[str, int]:
    """NVML's total/free/used for torch's ``cuda:index``: the v2 query (nvidia-smi's figures), else v1."""
    import pynvml

    handle = nvml_handle(torch, index)
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except (pynvml.NVMLError, AttributeError, TypeError):
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"total": int(info.total), "free": int(info.free), "used": int(info.used)}


def allocator_facts(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures from the allocator's own snapshot segments (``torch.cuda.memory_snapshot()``).

    ``largest_free_block``: the biggest inactive block (the allocator merges neighbouring free
    blocks, so each inactive block is a maximal hole); ``expandable``: whether any segment is an
    expandable segment (None when this torch does not say).
    """
    inactive = [b["size"] for s in segments for b in s.get("blocks", ()) if b.get("state") == "inactive"]
    flags = [s["is_expandable"] for s in segments if "is_expandable" in s]
    return {
        "segments": len(segments),
        "reserved": sum(int(s["total_size"]) for s in segments),
        "allocated": sum(int(s["allocated_size"]) for s in segments),
        "inactive_blocks": len(inactive),
        "inactive_bytes": sum(inactive),
        "largest_free_block": max(inactive, default=0),
        "expandable": (any(flags) if flags else None),
    }


def block_sizes(segments: list[dict[str, Any]]) -> dict[int, int]:
    """Each allocated block's address and size (what ``memory_allocated`` counts for it), from the
    allocator's own snapshot segments (``torch.cuda.memory_snapshot()``)."""
    blocks: dict[int, int] = {}
    for segment in segments:
        address = int(segment["address"])
        for block in segment.get("blocks", ()):
            start = int(block.get("address", address))  # older snapshots: blocks lie end to end
            if block.get("state") == "active_allocated":
                blocks[start] = int(block["size"])
            address = start + int(block["size"])
    return blocks


def print_tolerance(value: int) -> int:
    """Half the last printed digit of PyTorch's ``format_size`` for ``value`` ("1.23 GiB" → 0.005 GiB)."""
    for unit in (GiB, MiB, KiB):
        if value >= unit:
            return unit // 200 + 1
    return 0


# -- models built from configs ----------------------------------------------------------------


def build_causal_lm(path: Path, *, hidden: int, intermediate: int, layers: int, heads: int,
                    vocab: int = 32000, dtype: str = "bfloat16", kv_heads: int | None = None,
                    max_positions: int = 512) -> dict[str, int]:
    """Save a Llama-shaped causal LM built from a config (zero weights, no hub) as safetensors.

    Built on the meta device and materialised with zeros, so a model of a billion parameters
    takes seconds, not minutes of random initialisation. ``kv_heads`` below ``heads`` is GQA
    (default: as many as ``heads``). Returns its parameter count and bytes.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads or heads, vocab_size=vocab,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.zero_()
    model.save_pretrained(str(path))
    parameters = sum(p.numel() for p in model.parameters())
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {"parameters": parameters, "stored_bytes": stored}


def settle(torch: Any) -> None:
    """Collect garbage, finish queued work and return cached blocks, so readings are stable."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def wait_until(predicate: Any, timeout: float = 30.0, step: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (for other processes' state)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


# -- %%guardload through the real shell -----------------------------------------------------------


def guard_cell(ip: Any, line: str, body: str) -> tuple[Any, Any, BaseException | None]:
    """Run ``%%guardload line`` over ``body`` as a cell; return (ExecutionResult, GuardReport, error).

    The report comes from the short exception's ``oom_report`` after an out-of-memory error, else
    from the cell's value (the magic returns it) or the magics object's last report.
    """
    result = ip.run_cell(f"%%guardload {line}\n{body}", store_history=True)
    error = result.error_in_exec or result.error_before_exec
    if error is not None and "guardload" in str(error) and "not found" in str(error):
        raise AssertionError("%%guardload is not registered: issue 3's magic has not landed in oom_magic/magics.py")
    report = getattr(error, "oom_report", None)
    if report is None and type(result.result).__name__ == "GuardReport":
        report = result.result
    if report is None:
        magics = ip.magics_manager.registry.get("OomMagics")
        for name in ("last_report", "report", "guard_report"):
            candidate = getattr(magics, name, None)
            if type(candidate).__name__ == "GuardReport":
                report = candidate
                break
    return result, report, error


def make_holes(ip: Any, torch: Any) -> dict[str, Any]:
    """Leave eight 64 MiB holes inside one 1 GiB segment, then cap the process just above its reserve.

    Carved from one cached 1 GiB segment, the 16 pieces sit side by side; freeing every other one
    leaves holes the allocator cannot release (their segment is partly in use) nor merge. With the
    cap 32 MiB above what is reserved, a 128 MiB request fits in no hole and no new segment:
    reserved-but-unallocated (512 MiB) is larger than the request, which still fails.
    Returns the allocator's own figures (from ``memory_snapshot``) before the failing request.
    """
    settle(torch)
    source = ("big = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
              "del big\n"
              "pieces = [torch.empty(64 << 20, dtype=torch.uint8, device='cuda') for _ in range(16)]\n"
              "del pieces[::2]\n")
    result = ip.run_cell(source, store_history=True)
    assert result.error_in_exec is None, result.error_in_exec
    torch.cuda.synchronize()
    facts = allocator_facts(torch.cuda.memory_snapshot())
    total = int(torch.cuda.mem_get_info(0)[1])
    cap = int(torch.cuda.memory_reserved(0)) + 32 * MiB
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    facts.update(cap=cap, device_total=total, allocated_now=int(torch.cuda.memory_allocated(0)),
                 reserved_now=int(torch.cuda.memory_reserved(0)))
    return facts
