"""Size a model from its config.json alone, in a child Python bounded in time and memory.

Building the architecture on the meta device is the only general way to count what a config
describes, but it runs transformers' model code: a config declaring 100k layers takes minutes
and gigabytes, a million kills the process. So it runs in a child process with a deadline and a
resident-memory cap, and the user's kernel never imports torch or transformers for it. A config
that declares more layers than any real model is refused from the JSON before a child starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..common.errors import OomMagicError

__all__ = ["CONFIG_CHILD_PRELUDE", "MAX_LAYERS", "MEMORY_LIMIT", "TIME_LIMIT", "child_env", "declared_layers", "run_child", "size_from_config",
           "start_child"]

MAX_LAYERS = 4096  # more than any released model has (the deepest have a few hundred)
TIME_LIMIT = 120.0  # seconds
MEMORY_LIMIT = 3 << 30  # bytes resident in the child
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
               "encoder_layers", "decoder_layers", "num_encoder_layers")
_cache: dict[tuple, list[tuple[str, str, tuple[int, ...], int, int]]] = {}

# How a sizing child that reads a config starts (argv[1]: the config's folder): torch and transformers
# imported, else {"missing"}; ``first(exc)``, an error's first line; ``config`` read, else {"unreadable"}.
CONFIG_CHILD_PRELUDE = r"""
import json, sys
try:
    import torch, transformers
except ImportError as exc:
    print(json.dumps({"missing": str(exc)})); sys.exit(0)
def first(exc):
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:160]
try:
    config = transformers.AutoConfig.from_pretrained(sys.argv[1], local_files_only=True, trust_remote_code=False)
except Exception as exc:
    print(json.dumps({"unreadable": first(exc)})); sys.exit(0)
"""

# Run by the child: build on meta, print one JSON line of (name, dtype, shape, elements, bytes).
_CHILD = CONFIG_CHILD_PRELUDE + r"""
declared = sys.argv[2]
dtype = getattr(torch, declared) if declared else torch.float32
candidates = []
for arch in getattr(config, "architectures", None) or []:
    found = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
        candidates.append(found._from_config)
candidates += [transformers.AutoModelForCausalLM.from_config, transformers.AutoModel.from_config]
model, error = None, None
for build in candidates:
    try:
        with torch.device("meta"):
            model = build(config, dtype=dtype)
        break
    except Exception as exc:
        error = error or exc
if model is None:
    print(json.dumps({"unbuildable": first(error), "model_type": str(getattr(config, "model_type", "?"))}))
    sys.exit(0)
rows, seen = [], set()
for module_name, module in model.named_modules():
    prefix = f"{module_name}." if module_name else ""
    tensors = list(module._parameters.items()) + [
        (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
    for name, tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        rows.append((prefix + name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                     tensor.numel(), tensor.numel() * tensor.element_size()))
print(json.dumps({"rows": rows}))
"""


def declared_layers(config: dict) -> tuple[str, int] | None:
    """The largest layer count a config.json declares (top level or a nested sub-config), and its key."""
    best: tuple[str, int] | None = None
    stack: list[tuple[str, object]] = [("", config)]
    while stack:
        prefix, item = stack.pop()
        if type(item) is not dict or len(prefix) > 200:
            continue
        for key, value in item.items():
            if key in _LAYER_KEYS and type(value) is int and (best is None or value > best[1]):
                best = (prefix + key, value)
            elif type(value) is dict:
                stack.append((f"{prefix}{key}.", value))
    return best


def size_from_config(config: Path, declared: str | None) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, elements, bytes) of each unique parameter and persistent buffer.

    Raises OomMagicError with one line when the config is too deep to size, transformers is
    missing or cannot read or build it, or the child runs past its time or memory bound.
    """
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OomMagicError(f"{config.name}: cannot read it as JSON ({type(exc).__name__})") from None
    layers = declared_layers(data) if type(data) is dict else None
    if layers is not None and layers[1] > MAX_LAYERS:
        raise OomMagicError(f"{config.name} declares {layers[1]:,} layers ({layers[0]}), more than any real model "
                            f"(at most {MAX_LAYERS:,} are sized from a config): not sized; check the config")
    stat = config.stat()
    key = (str(config.resolve()), stat.st_mtime_ns, stat.st_size, declared)
    if key not in _cache:
        _cache[key] = _run_child(config, declared)
    return list(_cache[key])


def _wait_bounded(proc: Any, config: Path) -> None:
    """Wait for the child, killing it (OomMagicError) past MEMORY_LIMIT resident or TIME_LIMIT seconds."""
    import psutil

    from ..render.units import format_bytes

    watched = psutil.Process(proc.pid)
    deadline = time.monotonic() + TIME_LIMIT
    while proc.poll() is None:
        try:
            rss = watched.memory_info().rss
        except psutil.Error:
            rss = 0
        if rss > MEMORY_LIMIT:
            raise OomMagicError(f"{config.name}: building the model it describes took more than "
                                f"{format_bytes(MEMORY_LIMIT)} of memory; stopped, not sized")
        if time.monotonic() > deadline:
            raise OomMagicError(f"{config.name}: building the model it describes took longer than "
                                f"{TIME_LIMIT:g} s; stopped, not sized")
        time.sleep(0.05)


def child_env() -> dict[str, str]:
    """The environment of a sizing child: no GPU, no network, this package importable."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", PYTHONPATH=path)


def _popen(code: str, args: list[str], env: dict[str, str], answer_file: Any) -> Any:
    return subprocess.Popen([sys.executable, "-c", code, *args],
                            stdin=subprocess.DEVNULL, stdout=answer_file, stderr=subprocess.DEVNULL, env=env)


# How a sizing child starts: a fresh interpreter. Anything with Popen's pid, poll(), kill(), wait() and
# returncode may stand in (the test suite forks its children from one warm interpreter: tests/zygote.py).
start_child = _popen


def run_child(code: str, args: list[str], label: str) -> dict[str, Any]:
    """Run ``code`` in a child Python bounded in time and memory; return the JSON object it prints last.

    The child sees no GPU and no network (hub and transformers offline) and can import this
    package. Raises OomMagicError naming ``label`` when it runs past a bound, prints no JSON
    object, or reports torch or transformers missing (``{"missing": ...}``).
    """
    config = Path(label)
    # Its answer goes to a file, not a pipe: a big model's rows fill a pipe's 64 KiB and the child
    # would block writing them while this loop waits for it to exit.
    with tempfile.TemporaryFile() as answer_file:
        proc = start_child(code, args, child_env(), answer_file)
        try:
            _wait_bounded(proc, config)
            answer_file.seek(0)
            out = answer_file.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    try:
        answer = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        answer = None
    if not isinstance(answer, dict):
        raise OomMagicError(f"{config.name}: sizing it from the config failed (the sizing process exited "
                            f"with status {proc.returncode})")
    if "missing" in answer:
        raise OomMagicError(f"{config.name}: sizing a checkpoint from its config alone needs torch and "
                            "transformers (pip install 'oom-magic[hf]')")
    return answer


def _run_child(config: Path, declared: str | None) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    answer = run_child(_CHILD, [str(config.parent), declared or ""], str(config))
    if "unreadable" in answer:
        raise OomMagicError(f"{config.name}: transformers cannot read it ({answer['unreadable']})")
    if "unbuildable" in answer:
        raise OomMagicError(f"{config.name}: transformers cannot build this {answer.get('model_type', '?')} model "
                            f"({answer['unbuildable']})")
    return [(str(n), str(d), tuple(int(x) for x in s), int(e), int(b)) for n, d, s, e, b in answer["rows"]]
