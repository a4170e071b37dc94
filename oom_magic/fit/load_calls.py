"""The model and checkpoint loads a cell will make, read from its source without running it.

The cell is parsed with ``ast``: ``from_pretrained``, ``torch.load`` and safetensors'
``load_file`` calls are found in statement order, their arguments resolved by ``cell_values``
(the checkpoint, dtype, quantization, where the weights land, max_memory), and later
``.to(...)`` / ``.cuda()`` / ``.half()`` calls on the result are followed; the job the model is loaded
for (generate's lengths, a fine-tune's settings) is read by ``cell_job``. Nothing is imported or executed.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

from .cell_job import JobReader, attach_job
from .cell_values import DeviceValue, DtypeValue, Opaque, QuantValue, Resolver, Symbol, Unknown, float_dtype
from ..common.errors import OomMagicError
from ..records.request import LoadKind, LoadRequest
from ..common.sizes import shorten

__all__ = ["device_text", "find_load_calls", "scan_cell"]

_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
# from_pretrained on these loads a few KiB of JSON, not weights.
_NOT_WEIGHTS = re.compile(r"(Tokenizer|Processor|Config|FeatureExtractor|Scheduler|TokenizerFast)$")




def _arg(call: ast.Call, position: int | None, *names: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg in names:
            return kw.value
    if position is not None and len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def _is_llama_cpp(name: str | None) -> bool:
    """llama-cpp-python's model class, however it was imported (read from the source, never imported)."""
    return name is not None and (name == "Llama" or name.endswith("llama_cpp.Llama"))


def _kind_of(resolver: Resolver, call: ast.Call) -> LoadKind | None:
    func = call.func
    if _is_llama_cpp(resolver.name(func)):
        return "llama_cpp"
    if isinstance(func, ast.Attribute) and func.attr == "from_pretrained":
        if _is_llama_cpp(resolver.name(func.value)):
            return "llama_cpp"
        receiver = resolver.name(func.value) or ast.unparse(func.value)
        if _NOT_WEIGHTS.search(receiver.rstrip("()")):
            return None
        return "from_pretrained"
    name = resolver.name(func) or ""
    if name in ("torch.load", "torch.serialization.load"):
        return "torch.load"
    if name in ("pipeline", "transformers.pipeline") or name.endswith("transformers.pipelines.pipeline"):
        return "pipeline"
    if name in ("LLM", "vllm.LLM") or (name.startswith("vllm.") and name.endswith(".LLM")):
        return "vllm"
    if name in ("safetensors.torch.load_file",) or name.endswith("safetensors.torch.load_file"):
        return "load_file"
    return None


def _dtype_of(value: object) -> str | None | Unknown:
    """The dtype a dtype= / torch_dtype= argument asks for ('auto', a float name), None when not given."""
    if value is None or isinstance(value, Unknown):
        return value
    if isinstance(value, DtypeValue):
        return float_dtype(value.name)
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("torch.")
        return "auto" if text == "auto" else float_dtype(text)
    return Unknown(f"dtype {value!r} is not a torch dtype")


def _device_of(value: object) -> str | None | Unknown:
    """Where a device_map / map_location / device argument puts the weights."""
    if value is None or isinstance(value, Unknown):
        return value
    if isinstance(value, DeviceValue):
        return device_text(value.name)
    if isinstance(value, bool):
        return Unknown(f"{value!r} is not a device")
    if isinstance(value, int):
        return f"cuda:{value}"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _AUTO_MAPS:
            return "auto"
        return device_text(text)
    if isinstance(value, dict):
        placements = {_device_of(v) for v in value.values()}
        if len(placements) == 1:
            only = next(iter(placements))
            if "" in value or len(value) == 1:
                return only
        return "mixed"
    if isinstance(value, Symbol) and value.name == "<lambda>":
        return Unknown("map_location is a function")
    return Unknown(f"{shorten(repr(value))} is not a device")


def device_text(text: str) -> str:
    text = text.strip().lower()
    if text.isdigit():
        return f"cuda:{text}"
    if text in ("gpu",):
        return "cuda"
    return text


def _is_cpu_lambda(node: ast.AST | None) -> bool:
    """``lambda storage, loc: storage``: the classic spelling of map_location="cpu"."""
    return (isinstance(node, ast.Lambda) and len(node.args.args) >= 1 and isinstance(node.body, ast.Name)
            and node.body.id == node.args.args[0].arg)


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    return parents


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements in execution order, entering with/if/try/for bodies (not functions or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from _statements(inner)
        for handler in getattr(stmt, "handlers", []) or []:
            yield from _statements(handler.body)


def _own_calls(stmt: ast.stmt) -> Iterator[ast.Call]:
    """Calls in one statement, not those in nested statement bodies (visited on their own)."""
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.Lambda)):  # a def is a statement too
                continue
            stack.append(child)


def find_load_calls(cell: str, namespace: Mapping[str, Any] | None = None) -> tuple[LoadRequest, ...]:
    """Find the model and checkpoint loads in a cell's source, without running it.

    Raises OomMagicError when the cell is not valid Python (after IPython's transforms).
    """
    return scan_cell(cell, namespace)[0]


def scan_cell(cell: str, namespace: Mapping[str, Any] | None) -> tuple[tuple[LoadRequest, ...], tuple[str, ...]]:
    """The load calls, and a note for each namespace object the resolver had to skip."""
    try:
        tree = ast.parse(cell)
    except SyntaxError as exc:
        raise OomMagicError(f"the cell is not valid Python (line {exc.lineno}: {exc.msg}); nothing was checked") from None
    resolver = Resolver(namespace if namespace is not None else {})
    parents = _parents(tree)
    found: list[tuple[LoadRequest, ast.Call]] = []
    job = JobReader(resolver)
    for stmt in _statements(tree.body):
        calls = sorted(_own_calls(stmt), key=lambda n: (n.lineno, n.col_offset))
        for node in calls:
            kind = _kind_of(resolver, node)
            if kind is not None:
                found.append((_describe(kind, node, stmt, resolver, parents), node))
        _track_moves(stmt, resolver, found, parents)
        job.see(calls, [call for call, _ in found])
        resolver.bind(stmt)
    return attach_job([call for call, _ in found], job), tuple(dict.fromkeys(resolver.skipped))


def _assigned_name(node: ast.AST, stmt: ast.stmt, parents: dict[int, ast.AST]) -> str | None:
    """The variable a call's result (possibly through .to()/.cuda()/.eval() chains) is bound to."""
    current = node
    while True:
        parent = parents.get(id(current))
        if isinstance(parent, ast.Attribute) and isinstance(parents.get(id(parent)), ast.Call):
            current = parents[id(parent)]
            continue
        if isinstance(parent, ast.Subscript) and parent.value is current:
            current = parent
            continue
        break
    if isinstance(stmt, ast.Assign) and stmt.value is current and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if isinstance(target, ast.Name):
            return target.id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is current and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def _chain_effects(node: ast.Call, parents: dict[int, ast.AST], resolver: Resolver) -> tuple[str | None, str | None]:
    """(device, dtype) from .to(...) / .cuda() / .half() calls chained on a load's result."""
    moved = cast = None
    current: ast.AST = node
    while True:
        parent = parents.get(id(current))
        if not (isinstance(parent, ast.Attribute) and isinstance(parents.get(id(parent)), ast.Call)):
            break
        call = parents[id(parent)]
        assert isinstance(call, ast.Call)
        moved, cast = _move_effect(parent.attr, call, resolver, moved, cast)
        current = call
    return moved, cast


def _move_effect(method: str, call: ast.Call, resolver: Resolver, moved: str | None,
                 cast: str | None) -> tuple[str | None, str | None]:
    if method == "cuda":
        index = resolver.value(call.args[0]) if call.args else None
        return (f"cuda:{index}" if type(index) is int else "cuda"), cast
    if method == "cpu":
        return "cpu", cast
    if method in ("half", "bfloat16", "float", "double"):
        return moved, {"half": "float16", "float": "float32", "double": "float64"}.get(method, method)
    if method == "to":
        for node in [*call.args, *(k.value for k in call.keywords if k.arg in ("device", "dtype"))]:
            value = resolver.value(node)
            if isinstance(value, DtypeValue):
                cast = float_dtype(value.name)
            else:
                device = _device_of(value)
                if isinstance(device, str) and device not in ("auto", "mixed"):
                    moved = device
    return moved, cast


def _track_moves(stmt: ast.stmt, resolver: Resolver, found: list[tuple[LoadRequest, ast.Call]],
                 parents: dict[int, ast.AST]) -> None:
    """``model.to("cuda")`` / ``model = model.cuda()`` in a later statement moves that load's result."""
    targets = {call.variable: i for i, (call, _) in enumerate(found) if call.variable}
    if not targets:
        return
    for node in _own_calls(stmt):
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in targets):
            continue
        index = targets[func.value.id]
        call, origin = found[index]
        if origin is node or func.attr not in ("to", "cuda", "cpu", "half", "bfloat16", "float", "double"):
            continue
        moved, cast = _move_effect(func.attr, node, resolver, call.moved_to, call.cast_to)
        found[index] = (replace(call, moved_to=moved, cast_to=cast), origin)


def _describe(kind: LoadKind, node: ast.Call, stmt: ast.stmt, resolver: Resolver, parents: dict[int, ast.AST]) -> LoadRequest:
    if kind == "pipeline":
        return _describe_pipeline(node, stmt, resolver, parents)
    if kind == "vllm":
        return _describe_vllm(node, stmt, resolver, parents)
    notes: list[str] = []
    if kind == "llama_cpp":
        return _describe_llama_cpp(node, stmt, resolver, parents)
    path_node = _arg(node, 0, "pretrained_model_name_or_path", "f", "filename")
    path_value = resolver.value(path_node) if path_node is not None else Unknown("no checkpoint argument")
    checkpoint, unresolved = _checkpoint_text(path_value)
    if kind == "from_pretrained" and checkpoint is not None:
        sub = resolver.value(_arg(node, None, "subfolder"))
        if isinstance(sub, str) and sub:
            checkpoint = os.path.join(checkpoint, sub)
    dtype: str | None = None
    quant: str | None = None
    double = False
    skip: tuple[str, ...] | None = None
    device: str | None = None
    max_memory: tuple[tuple[int | str, int], ...] | None = None
    offload: str | None = None
    map_given = False
    weights_only: bool | None = None
    mmap = False
    revision: str | None = None
    gguf_file: str | None = None
    token: str | None = None
    if kind == "from_pretrained":
        asked = resolver.value(_arg(node, None, "revision"))
        revision = asked if isinstance(asked, str) and asked else None
        named = resolver.value(_arg(node, None, "gguf_file"))
        gguf_file = named if isinstance(named, str) and named.endswith(".gguf") else None
        given = resolver.value(_arg(node, None, "token", "use_auth_token"))
        token = given if isinstance(given, str) and given else None
        value = _dtype_of(resolver.value(_arg(node, None, "dtype", "torch_dtype")))
        if isinstance(value, Unknown):
            notes.append(f"dtype: {value.reason}")
        else:
            dtype = value
        q = resolver.value(_arg(node, None, "quantization_config"))
        if isinstance(q, QuantValue):
            quant, double, skip = q.kind or q.type_name, q.double_quant, q.skip_modules
        elif isinstance(q, Unknown) and _arg(node, None, "quantization_config") is not None:
            notes.append(f"quantization_config: {q.reason}")
        if resolver.value(_arg(node, None, "load_in_8bit")) is True:
            quant = "int8"
        if resolver.value(_arg(node, None, "load_in_4bit")) is True:
            quant = "fp4"  # load_in_4bit=True builds BitsAndBytesConfig(load_in_4bit=True): fp4
        device = _placement(resolver.value(_arg(node, None, "device_map")), notes, "device_map")
        max_memory = _max_memory(resolver.value(_arg(node, None, "max_memory")), notes)
        folder = resolver.value(_arg(node, None, "offload_folder"))
        offload = str(folder) if isinstance(folder, (str, Path)) else None
    elif kind == "torch.load":
        location = _arg(node, 1, "map_location")
        map_given = location is not None
        if _is_cpu_lambda(location):
            device = "cpu"
        elif location is not None:
            device = _placement(resolver.value(location), notes, "map_location")
        wo = resolver.value(_arg(node, None, "weights_only"))
        weights_only = wo if isinstance(wo, bool) else None
        mmap = resolver.value(_arg(node, None, "mmap")) is True
    else:
        device = _placement(resolver.value(_arg(node, 1, "device")), notes, "device") or "cpu"
    moved, cast = _chain_effects(node, parents, resolver)
    source = ast.unparse(node)
    if token is not None:
        source = source.replace(token, "***")  # a token written in the cell is never printed back
    return LoadRequest(
        kind=kind, line=node.lineno, source=source,
        variable=_assigned_name(node, stmt, parents), checkpoint=checkpoint, unresolved=unresolved,
        dtype=dtype, quantization=quant, double_quant=double, device=device, max_memory=max_memory,
        offload_folder=offload, map_location_given=map_given, weights_only=weights_only, mmap=mmap,
        moved_to=moved, cast_to=cast, notes=tuple(notes), skip_modules=skip, revision=revision,
        gguf_file=gguf_file, token=token,
    )


def _int_arg(resolver: Resolver, node: ast.AST | None) -> object:
    """An integer argument's value: a literal such as -1 as written, else what the resolver finds."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return resolver.value(node)


def _describe_llama_cpp(node: ast.Call, stmt: ast.stmt, resolver: Resolver, parents: dict[int, ast.AST]) -> LoadRequest:
    """llama_cpp.Llama(model_path=..., n_gpu_layers=..., n_ctx=...) or Llama.from_pretrained(repo_id, filename)."""
    remote = isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained"
    where = resolver.value(_arg(node, 0, "repo_id" if remote else "model_path"))
    checkpoint, unresolved = _checkpoint_text(where)
    gguf_file = None
    if remote:
        named = resolver.value(_arg(node, 1, "filename"))
        gguf_file = named if isinstance(named, str) else None
        if gguf_file is None or any(c in gguf_file for c in "*?["):
            checkpoint, unresolved = None, "Llama.from_pretrained's filename is a pattern or unknown: name the .gguf file"
    layers, ctx = (_int_arg(resolver, _arg(node, None, key)) for key in ("n_gpu_layers", "n_ctx"))
    n_gpu_layers = layers if isinstance(layers, int) and not isinstance(layers, bool) else None
    n_ctx = ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None
    device = "cpu" if not n_gpu_layers else "cuda"
    return LoadRequest(
        kind="llama_cpp", line=node.lineno, source=ast.unparse(node),
        variable=_assigned_name(node, stmt, parents), checkpoint=checkpoint, unresolved=unresolved, dtype=None,
        quantization=None, double_quant=False, device=device, max_memory=None, offload_folder=None,
        gguf_file=gguf_file, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx,
    )


def _given(node: ast.Call, resolver: Resolver, extra: Mapping[object, object], *names: str) -> object:
    """An argument's value from the call's keywords, else from its model_kwargs dict (None: not given)."""
    found = _arg(node, None, *names)
    if found is not None:
        return resolver.value(found)
    return next((extra[n] for n in names if n in extra), None)


def _model_checkpoint(node: ast.Call, position: int, resolver: Resolver,
                      absent: str) -> tuple[str | None, str | None]:
    """(checkpoint, why it is unresolved) from a call's ``model`` argument; ``absent`` when it has none."""
    model_node = _arg(node, position, "model")
    if model_node is None:
        return None, absent
    return _checkpoint_text(resolver.value(model_node))


def _describe_pipeline(node: ast.Call, stmt: ast.stmt, resolver: Resolver, parents: dict[int, ast.AST]) -> LoadRequest:
    """transformers.pipeline(task, model=..., device=..., device_map=..., dtype=..., model_kwargs=...): a from_pretrained."""
    notes: list[str] = []
    checkpoint, unresolved = _model_checkpoint(
        node, 1, resolver, "pipeline() without model= loads the task's default model, chosen when the cell runs")
    extra = resolver.value(_arg(node, None, "model_kwargs"))
    if isinstance(extra, Unknown):
        notes.append(f"model_kwargs: {extra.reason}")
    kwargs: Mapping[object, object] = extra if isinstance(extra, dict) else {}
    dtype: str | None = None
    value = _dtype_of(_given(node, resolver, kwargs, "dtype", "torch_dtype"))
    if isinstance(value, Unknown):
        notes.append(f"dtype: {value.reason}")
    else:
        dtype = value if value is not None else "auto"  # pipeline's dtype defaults to "auto"
    quant: str | None = None
    double = False
    skip: tuple[str, ...] | None = None
    q = _given(node, resolver, kwargs, "quantization_config")
    if isinstance(q, QuantValue):
        quant, double, skip = q.kind or q.type_name, q.double_quant, q.skip_modules
    # pipeline: device= wins over device_map=; with neither, device 0 (the first GPU, else the cpu).
    device_value = _given(node, resolver, kwargs, "device")
    if device_value is not None:
        device = "cpu" if type(device_value) is int and device_value < 0 else _placement(device_value, notes, "device")
    else:
        device = _placement(_given(node, resolver, kwargs, "device_map"), notes, "device_map") or "default"
    max_memory = _max_memory(_given(node, resolver, kwargs, "max_memory"), notes)
    folder = _given(node, resolver, kwargs, "offload_folder")
    moved, cast = _chain_effects(node, parents, resolver)
    return LoadRequest(
        kind="pipeline", line=node.lineno, source=ast.unparse(node),
        variable=_assigned_name(node, stmt, parents), checkpoint=checkpoint, unresolved=unresolved,
        dtype=dtype, quantization=quant, double_quant=double, device=device, max_memory=max_memory,
        offload_folder=str(folder) if isinstance(folder, (str, Path)) else None, moved_to=moved, cast_to=cast,
        notes=tuple(notes), skip_modules=skip,
    )


def _describe_vllm(node: ast.Call, stmt: ast.stmt, resolver: Resolver, parents: dict[int, ast.AST]) -> LoadRequest:
    """vllm.LLM(model=, dtype=, quantization=, gpu_memory_utilization=, max_model_len=, tensor_parallel_size=)."""
    notes: list[str] = []
    checkpoint, unresolved = _model_checkpoint(node, 0, resolver, "LLM() without model= names no checkpoint")
    dtype = _dtype_of(resolver.value(_arg(node, None, "dtype")))
    if isinstance(dtype, Unknown):
        notes.append(f"dtype: {dtype.reason}")
        dtype = None
    quant = resolver.value(_arg(node, None, "quantization"))
    utilization = resolver.value(_arg(node, None, "gpu_memory_utilization"))
    length = resolver.value(_arg(node, None, "max_model_len"))
    parallel = resolver.value(_arg(node, None, "tensor_parallel_size"))
    for what, value, ok in (("gpu_memory_utilization", utilization, isinstance(utilization, (int, float))
                             and not isinstance(utilization, bool) and 0 < utilization <= 1),
                            ("max_model_len", length, type(length) is int and length > 0),
                            ("tensor_parallel_size", parallel, type(parallel) is int and parallel > 0)):
        if value is not None and not ok:
            notes.append(f"{what}: {value.reason if isinstance(value, Unknown) else f'{value!r} cannot be read'}")
    return LoadRequest(
        kind="vllm", line=node.lineno, source=ast.unparse(node),
        variable=_assigned_name(node, stmt, parents), checkpoint=checkpoint, unresolved=unresolved,
        dtype=dtype or "auto", quantization=quant if isinstance(quant, str) else None, double_quant=False,
        device="cuda", max_memory=None, offload_folder=None, notes=tuple(notes),
        memory_utilization=float(utilization) if isinstance(utilization, (int, float)) and not isinstance(
            utilization, bool) and 0 < utilization <= 1 else 0.9,  # vLLM's default
        max_model_len=length if type(length) is int and length > 0 else None,
        tensor_parallel=parallel if type(parallel) is int and parallel > 0 else 1,
    )


def _checkpoint_text(value: object) -> tuple[str | None, str | None]:
    if isinstance(value, Unknown):
        return None, value.reason
    if isinstance(value, (str, Path)) and str(value).strip():
        return str(value), None
    if isinstance(value, Opaque):
        return None, f"the checkpoint argument is a {type(value.obj).__name__} object, not a path or hub id"
    return None, f"the checkpoint argument {shorten(repr(value))} is not a path or hub id"


def _placement(value: object, notes: list[str], what: str) -> str | None:
    device = _device_of(value)
    if isinstance(device, Unknown):
        notes.append(f"{what}: {device.reason}")
        return "unknown"  # given, but only known when the cell runs
    return device


def _max_memory(value: object, notes: list[str]) -> tuple[tuple[int | str, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        notes.append("max_memory: " + (value.reason if isinstance(value, Unknown) else "not a dict"))
        return None
    out: list[tuple[int | str, int]] = []
    for key, size in value.items():
        nbytes = _accelerate_size(size)
        if nbytes is None:
            notes.append(f"max_memory[{key!r}]: cannot read {size!r}")
            continue
        place: int | str = key if type(key) is int else str(key)
        if isinstance(place, str) and place.isdigit():
            place = int(place)
        if isinstance(place, str) and place.startswith("cuda:") and place[5:].isdigit():
            place = int(place[5:])
        out.append((place, nbytes))
    return tuple(out)


def _accelerate_size(size: object) -> int | None:
    """Bytes of a max_memory value as accelerate reads it: GiB/MiB/KiB binary, GB/MB/KB decimal."""
    if type(size) is int:
        return size if size >= 0 else None
    if not isinstance(size, str):
        return None
    text = size.strip()
    units = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    for unit, factor in units:
        if text.upper().endswith(unit):
            try:
                value = int(float(text[: -len(unit)]) * factor)
            except ValueError:
                return None
            # accelerate: a lowercase "b" (Gb, Mb) means bits
            return value // 8 if unit in ("GB", "MB", "KB") and text.endswith("b") else value
    return None
