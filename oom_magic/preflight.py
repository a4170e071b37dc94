"""Check a model-load cell before it runs: which checkpoint, how big, whether it fits, what to fix.

Pure: the cell is parsed with ``ast`` and never executed. Arguments are resolved only when they
are literals, names bound earlier in the cell to resolvable values, or names in the user
namespace holding plain values (str, int, paths, torch dtypes and devices, dicts and lists of
them, modules, a ``BitsAndBytesConfig``); attributes of user objects are read from the instance
``__dict__`` only, so no property, ``__getattr__`` or other user code runs. Checkpoints are sized
from their headers (``estimate_checkpoint``); a torch checkpoint's top-level keys and saved
devices are read from ``data.pkl``'s opcodes with ``pickletools``, never unpickled.
"""
from __future__ import annotations

import ast
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any
from collections.abc import Iterator, Mapping

from .checkpoints import CheckpointKeys, read_checkpoint_keys
from .holders import instance_dict as _instance_dict
from ._torch import cuda_initialized
from .diagnose import FitOption, device_index, fit_options
from .errors import OomMagicError
from .offload import OffloadCheck, check_offload
from .sizes import parse_size
from .targets import Target, parse_target

__all__ = ["CUDA_CONTEXT_BYTES", "CheckpointKeys", "FitCheck", "Lint", "LoadCall", "Preflight",
           "cuda_process_cap", "find_load_calls", "load_target", "parse_headroom", "preflight_check", "read_checkpoint_keys",
           "usable_ram"]

# What a CUDA context costs on the device before PyTorch allocates anything: 300-600 MiB with
# lazy module loading (CUDA 11.7+), more with eager loading. An estimate, said as one.
CUDA_CONTEXT_BYTES = 512 * 1024**2
DEFAULT_HEADROOM = "5%"
_FLOAT_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                 "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}
_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
# from_pretrained on these loads a few KiB of JSON, not weights.
_NOT_WEIGHTS = re.compile(r"(Tokenizer|Processor|Config|FeatureExtractor|Scheduler|TokenizerFast)$")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class LoadCall:
    """One model or checkpoint load found in the cell, with its arguments as far as they resolve."""

    kind: str  # 'from_pretrained' | 'torch.load' | 'load_file'
    line: int
    source: str  # the call as written, shortened to one line
    target: str | None  # the variable the result is assigned to
    checkpoint: str | None  # path or hub id, resolved; None when it cannot be known before running
    unresolved: str | None  # why the checkpoint is unknown
    dtype: str | None  # requested load dtype ('bfloat16', 'float32', 'auto'); None = not given
    quantization: str | None  # 'int8' | 'nf4' | 'fp4' | another config's name
    double_quant: bool
    device: str | None  # where the weights land: 'cuda:0', 'cuda', 'cpu', 'mps', 'auto', 'mixed'; None = default
    max_memory: tuple[tuple[int | str, int], ...] | None
    offload_folder: str | None
    map_location_given: bool = False
    weights_only: bool | None = None  # None: not given; False: explicitly off
    mmap: bool = False
    moved_to: str | None = None  # .to(device) / .cuda() applied to the result
    cast_to: str | None = None  # .to(dtype) / .half() / .bfloat16() applied to the result
    notes: tuple[str, ...] = ()
    skip_modules: tuple[str, ...] | None = None  # BitsAndBytesConfig(llm_int8_skip_modules=[...])


@dataclass(frozen=True)
class FitCheck:
    """Will one load fit where it is going: need against the free memory there, with headroom."""

    call: LoadCall
    device: str  # where it must fit ('cuda:0', 'cpu'; 'auto' spreads over device + RAM)
    verdict: str  # 'fits' | 'will-not-fit' | 'unknown'
    reason: str | None  # why 'unknown', in words
    need: int | None  # bytes the weights take there
    dtype: str | None  # the dtype `need` assumes; None = as stored
    free: int | None  # free on that device now
    context: int  # the CUDA context still to come (0 once CUDA is initialized, and off CUDA)
    headroom: int
    parameters: int | None = None
    format: str | None = None
    declared_dtype: str | None = None
    split: tuple[tuple[str, int], ...] = ()  # device_map="auto": (place, bytes) for device, cpu, disk
    options: tuple[FitOption, ...] = ()
    files: int = 0
    estimate: Any = field(default=None, repr=False, compare=False)  # the CheckpointEstimate (no tensors)
    process_cap: int | None = None  # torch.cuda.set_per_process_memory_fraction's limit, when set
    # --target: checked against that GPU's usable memory (free = usable, context already in it), not this device
    target: Target | None = None
    offload: OffloadCheck | None = None  # the advised offload plan's CPU and disk shares checked here
    # --target: the same load checked against this machine too (a 25 GiB load must not run on a
    # 24 GiB machine because an 80 GiB target would hold it); None without --target
    local: FitCheck | None = None
    # cpu loads: RAM at the load's peak when above `need` (a cast or MoE fusion copies beside the
    # file pages it reads; see load_peak); None when the peak is the weights themselves
    ram_peak: int | None = None

    @property
    def budget(self) -> int | None:
        """Bytes the load may use: free − context − headroom (device + RAM for device_map="auto")."""
        if self.split:
            return sum(b for _, b in self.split)
        if self.free is None:
            return None
        return self.free - self.context - self.headroom

    @property
    def margin(self) -> int | None:
        """Budget − need: what stays free after the load (negative: the shortfall)."""
        if self.need is None or self.budget is None:
            return None
        return self.budget - max(self.need, self.ram_peak or 0)


@dataclass(frozen=True)
class Lint:
    """One problem in a load call, one line, with the fix. ``{name}`` in the message is a size."""

    code: str  # 'map-location' | 'weights-only' | 'safetensors-sibling' | 'training-checkpoint' | 'fp32-of-half'
    line: int
    message: str
    fix: str
    severity: str = "warning"  # 'warning' | 'info'
    sizes: tuple[tuple[str, int], ...] = ()

    def text(self) -> str:
        """The lint as one line of text, sizes filled in."""
        from .render.guard import lint_text

        return lint_text(self)


@dataclass(frozen=True)
class Preflight:
    """What the cell will load, whether it fits, and what in the calls should change."""

    device: str | None  # the device the guard measures; None when no load targets one
    calls: tuple[LoadCall, ...]
    checks: tuple[FitCheck, ...]
    lints: tuple[Lint, ...]
    notes: tuple[str, ...] = ()

    @property
    def will_not_fit(self) -> tuple[FitCheck, ...]:
        """The loads that will not fit where they are going (under --target: there, or here)."""
        return tuple(c for c in self.checks if c.verdict == "will-not-fit"
                     or (c.local is not None and c.local.verdict == "will-not-fit"))

    @property
    def fits(self) -> bool | None:
        """True when every sized load fits, False when one will not, None when none could be sized."""
        if self.will_not_fit:
            return False
        return True if any(c.verdict == "fits" for c in self.checks) else None

    def lint(self, code: str) -> Lint | None:
        """The first lint with this code, or None."""
        return next((x for x in self.lints if x.code == code), None)

    def __repr__(self) -> str:
        verdicts = ", ".join(c.verdict for c in self.checks) or "no load found"
        return f"<Preflight {len(self.calls)} load(s): {verdicts}; {len(self.lints)} lint(s)>"

    def __str__(self) -> str:
        from .render.guard import preflight_text

        return preflight_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        from .render.guard import preflight_html

        return preflight_html(self)


# --------------------------------------------------------------------------- sizes the user types


def parse_headroom(spec: str | int | None, base: int | None) -> int:
    """Turn a headroom ("5%", "2GiB", 1024, None = 5%) into bytes; percentages are of ``base``."""
    if spec is None:
        spec = DEFAULT_HEADROOM
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise OomMagicError(f"headroom must be 0 or more, not {spec}")
        return spec
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100 or math.isnan(percent):
            raise OomMagicError(f"cannot read headroom {text!r}: write a percentage from 0% to 99% or a size such as 2GiB")
        return int((base or 0) * percent / 100)
    try:
        return parse_size(text)
    except OomMagicError:
        raise OomMagicError(f"cannot read headroom {text!r}: write a size such as 512MiB or 2GiB, "
                            "or a percentage of the device such as 5%") from None


def usable_ram() -> tuple[int | None, str | None]:
    """Bytes of RAM this process can still get, and what limits it when not the machine's RAM.

    The least of: psutil's available memory, the address-space limit (``ulimit -v``, RLIMIT_AS)
    minus this process's virtual size, and the cgroup memory limit (containers) minus its usage
    (page cache that can be reclaimed counts as free).
    """
    candidates: list[tuple[int, str | None]] = []
    try:
        import psutil

        candidates.append((int(psutil.virtual_memory().available), None))
        vms = int(psutil.Process().memory_info().vms)
    except Exception:
        vms = None
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and vms is not None:
            candidates.append((max(soft - vms, 0), "the address-space limit (ulimit -v)"))
    except Exception:
        pass
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        candidates.append((cgroup, "the container's memory limit (cgroup)"))
    if not candidates:
        return None, None
    return min(candidates, key=lambda c: c[0])


def cuda_process_cap(device: str, torch: Any = None) -> int | None:
    """Bytes this process may reserve on a CUDA device when ``set_per_process_memory_fraction`` caps it.

    None when CUDA is not initialized (reading the fraction would initialize it), when there is
    no cap (fraction 1.0), or when this torch cannot say.
    """
    if not device.startswith("cuda"):
        return None
    if torch is None:
        from ._torch import loaded_torch

        torch = loaded_torch()
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get is None:
            return None
        index = int(device.partition(":")[2] or 0)
        fraction = float(get(index))
        if fraction >= 1.0:
            return None
        return int(int(torch.cuda.get_device_properties(index).total_memory) * fraction)
    except Exception:
        return None


def _cgroup_headroom() -> int | None:
    """memory.max − memory.current + reclaimable page cache (cgroup v2), or v1's figures."""
    root = Path("/sys/fs/cgroup")
    try:
        if (root / "memory.max").is_file():
            limit_text = (root / "memory.max").read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int((root / "memory.current").read_text())
            stat = (root / "memory.stat").read_text() if (root / "memory.stat").is_file() else ""
        elif (root / "memory" / "memory.limit_in_bytes").is_file():
            limit = int((root / "memory" / "memory.limit_in_bytes").read_text())
            if limit >= 1 << 60:  # v1 spells "no limit" as a huge number
                return None
            usage = int((root / "memory" / "memory.usage_in_bytes").read_text())
            stat = (root / "memory" / "memory.stat").read_text()
        else:
            return None
    except (OSError, ValueError):
        return None
    inactive = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            inactive = int(value)
    return max(limit - usage + inactive, 0)


# --------------------------------------------------------------------------- resolving arguments


class _Unknown:
    """An argument that cannot be known without running the cell, and why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unknown: {self.reason}>"


@dataclass(frozen=True)
class _Dtype:
    name: str


@dataclass(frozen=True)
class _Device:
    name: str


@dataclass(frozen=True)
class _Quant:
    kind: str | None  # 'int8' | 'nf4' | 'fp4' | None (not bitsandbytes)
    double_quant: bool
    type_name: str
    skip_modules: tuple[str, ...] | None = None  # llm_int8_skip_modules: transformers' modules_to_not_convert


def _skip_modules(value: object) -> tuple[str, ...] | None:
    """llm_int8_skip_modules as given (a list of module names), else None (transformers' defaults)."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


@dataclass(frozen=True)
class _Symbol:
    """A module, class or function, by its qualified name."""

    name: str


class _Opaque:
    """A user object whose instance __dict__ may be read (never its properties)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj


_TORCH_DTYPES = frozenset({"float32", "float", "float16", "half", "bfloat16", "float64", "double",
                           "int8", "uint8", "int16", "int32", "int64", "bool"})




def _qualified(obj: object) -> str | None:
    """'torch.load', 'transformers.AutoModelForCausalLM' for a function, class or module."""
    # type(obj), never isinstance: isinstance falls back to obj.__class__, which a proxy can override
    if issubclass(type(obj), ModuleType):
        return obj.__name__
    if issubclass(type(obj), type) or type(obj).__name__ in ("function", "builtin_function_or_method"):
        module = getattr(obj, "__module__", None)
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if isinstance(module, str) and isinstance(name, str):
            return f"{module}.{name}"
    return None


_METACLASS_OVERRIDES = ("__module__", "__name__", "__qualname__", "__eq__", "__hash__", "__getattribute__")


def _odd_metaclass(obj: object) -> str | None:
    """Why an object's class (or the object, when it is a class) cannot be inspected safely: a
    metaclass that computes ``__module__``/``__name__`` or overrides ``==``/hashing would run its
    code (and may raise) when the preflight reads it. Decided from the metaclasses' own dicts only."""
    classes = [type(obj)]
    if issubclass(type(obj), type):
        classes.append(obj)  # type: ignore[arg-type]
    for cls in classes:
        meta = type(cls)
        if meta is type:
            continue
        for klass in type.__dict__["__mro__"].__get__(meta):
            if klass is type or klass is object:
                continue
            own = type.__dict__["__dict__"].__get__(klass)
            for name in _METACLASS_OVERRIDES:
                value = own.get(name, None)
                if name in own and not (name in ("__module__", "__qualname__") and type(value) is str):
                    return f"its metaclass {klass.__name__!r} overrides {name}"
    return None


def _from_object(obj: object, depth: int = 0) -> object:
    """A namespace value as the resolver sees it: plain data, a symbol, or an opaque object."""
    odd = _odd_metaclass(obj)
    if odd is not None:
        return _Unknown(f"a value that cannot be inspected ({odd}) was skipped")
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if issubclass(type(obj), PurePath):
        return Path(obj)
    cls = type(obj)
    if cls.__module__ == "torch" and cls.__name__ == "dtype":
        return _Dtype(str(obj).removeprefix("torch."))
    if cls.__module__ == "torch" and cls.__name__ == "device":
        return _Device(str(obj))
    if depth < 4 and cls in (dict, list, tuple) and len(obj) <= 1000:  # type: ignore[arg-type]
        if cls is dict:
            return {_from_object(k, depth + 1): _from_object(v, depth + 1) for k, v in dict.items(obj)}  # type: ignore[arg-type]
        items = [_from_object(v, depth + 1) for v in (list.__iter__(obj) if cls is list else tuple.__iter__(obj))]  # type: ignore[arg-type]
        return items if cls is list else tuple(items)
    quant = _quant_from_object(obj)
    if quant is not None:
        return quant
    name = _qualified(obj)
    if name is not None:
        return _Symbol(name)
    if issubclass(type(obj), os.PathLike):
        try:
            return Path(os.fspath(obj))
        except Exception:
            return _Unknown(f"a {cls.__name__} path")
    return _Opaque(obj)


def _quant_from_object(obj: object) -> _Quant | None:
    """A BitsAndBytesConfig (or another quantization config) read from its instance dict."""
    name = type(obj).__name__
    if not name.endswith("Config") or not any(mark in name for mark in ("Quant", "BitsAndBytes", "GPTQ", "Awq", "Hqq")):
        return None
    attrs = _instance_dict(obj)
    if name == "BitsAndBytesConfig":
        four = bool(attrs.get("_load_in_4bit", attrs.get("load_in_4bit", False)))
        eight = bool(attrs.get("_load_in_8bit", attrs.get("load_in_8bit", False)))
        kind = ("fp4" if attrs.get("bnb_4bit_quant_type") == "fp4" else "nf4") if four else "int8" if eight else None
        return _Quant(kind, bool(attrs.get("bnb_4bit_use_double_quant", False)), name,
                      _skip_modules(attrs.get("llm_int8_skip_modules")))
    return _Quant(None, False, name)


class _Resolver:
    """Resolve argument expressions against cell-local bindings and the user namespace."""

    def __init__(self, namespace: Mapping[str, Any]) -> None:
        self.namespace = namespace
        self.local: dict[str, object] = {}  # names bound earlier in the cell
        self.imports: dict[str, str] = {}  # local alias -> qualified name
        self.skipped: list[str] = []  # notes: namespace objects that could not be inspected

    # Statement effects, in cell order.
    def bind(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    self.imports[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    self.imports[top] = top
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
            for alias in stmt.names:
                self.imports[alias.asname or alias.name] = f"{stmt.module}.{alias.name}"
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            self.local[stmt.targets[0].id] = self.value(stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            self.local[stmt.target.id] = self.value(stmt.value)

    def name(self, node: ast.AST) -> str | None:
        """The qualified name a callee refers to ('torch.load'), from imports or the namespace."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        base = node.id
        if base in self.imports:
            head = self.imports[base]
        elif base in self.local:
            value = self.local[base]
            head = value.name if isinstance(value, _Symbol) else base
        elif base in self.namespace and _odd_metaclass(self.namespace[base]) is not None:
            self.skipped.append(f"`{base}` was skipped: {_odd_metaclass(self.namespace[base])}, so the preflight "
                                "cannot inspect it")
            head = base
        elif base in self.namespace:
            obj = self.namespace[base]
            head = _qualified(obj) or (f"{type(obj).__module__}.{type(obj).__qualname__}()" if type(obj) not in (str, int, float) else base)
        else:
            head = base
        return ".".join([head, *reversed(parts)])

    def value(self, node: ast.AST | None) -> object:
        """The value of an argument expression, or _Unknown with the reason."""
        try:
            return self._value(node, 0)
        except RecursionError:
            return _Unknown("the expression is too deeply nested")

    def _value(self, node: ast.AST | None, depth: int) -> object:
        if node is None:
            return None
        if depth > 30:
            return _Unknown("the expression is too deeply nested")
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self._named(node.id)
        if isinstance(node, ast.Attribute):
            return self._attribute(node, depth)
        if isinstance(node, ast.JoinedStr):
            return self._fstring(node, depth)
        if isinstance(node, ast.BinOp):
            return self._binop(node, depth)
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self._value(e, depth + 1) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                return _Unknown("a dict built with ** is computed when the cell runs")
            return {self._hashable(self._value(k, depth + 1)): self._value(v, depth + 1)
                    for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Subscript):
            return self._subscript(node, depth)
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        if isinstance(node, ast.Lambda):
            return _Symbol("<lambda>")
        return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")

    @staticmethod
    def _hashable(value: object) -> object:
        try:
            hash(value)
            return value
        except TypeError:
            return repr(value)

    def _named(self, name: str) -> object:
        if name in self.local:
            return self.local[name]
        if name in self.imports:
            return _Symbol(self.imports[name])
        if name in self.namespace:
            value = _from_object(self.namespace[name])
            if isinstance(value, _Unknown) and _odd_metaclass(self.namespace[name]) is not None:
                self.skipped.append(f"`{name}` was skipped: {_odd_metaclass(self.namespace[name])}, so the "
                                    "preflight cannot inspect it")
            return value
        return _Unknown(f"`{name}` is not defined yet (it is set when the cell runs)")

    def _attribute(self, node: ast.Attribute, depth: int) -> object:
        base = self._value(node.value, depth + 1)
        attr = node.attr
        if isinstance(base, _Symbol):
            module = sys.modules.get(base.name)
            if module is not None:
                sub = sys.modules.get(f"{base.name}.{attr}")
                if sub is not None:
                    return _Symbol(sub.__name__)
                # A module's own __dict__: never its __getattr__ (lazy modules import on access).
                found = module.__dict__.get(attr, _MISSING)
                if found is not _MISSING:
                    return _from_object(found)
            if base.name == "torch" and attr in _TORCH_DTYPES:
                return _Dtype(_FLOAT_DTYPES.get(attr, attr))
            return _Symbol(f"{base.name}.{attr}")
        if isinstance(base, _Opaque):
            attrs = _instance_dict(base.obj)
            if attr in attrs:
                return _from_object(attrs[attr])
            return _Unknown(f"`{_short(ast.unparse(node))}` is not a plain attribute (a property or computed value)")
        if isinstance(base, _Unknown):
            text = ast.unparse(node)
            if text.startswith("torch.") and attr in _TORCH_DTYPES:
                return _Dtype(_FLOAT_DTYPES.get(attr, attr))
            return base
        if isinstance(base, Path) and attr in ("parent", "name", "stem"):
            return getattr(base, attr)
        return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")

    def _fstring(self, node: ast.JoinedStr, depth: int) -> object:
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
                continue
            if not isinstance(part, ast.FormattedValue) or part.format_spec is not None or part.conversion not in (-1, 115):
                return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")
            value = self._value(part.value, depth + 1)
            if isinstance(value, _Unknown):
                return value
            if type(value) not in (str, int) and not isinstance(value, Path):
                return _Unknown(f"`{_short(ast.unparse(part.value))}` is not a plain value")
            out.append(str(value))
        return "".join(out)

    def _binop(self, node: ast.BinOp, depth: int) -> object:
        left, right = self._value(node.left, depth + 1), self._value(node.right, depth + 1)
        for side in (left, right):
            if isinstance(side, _Unknown):
                return side
        if isinstance(node.op, ast.Add) and type(left) is str and type(right) is str:
            return left + right
        if isinstance(node.op, ast.Div) and isinstance(left, Path) and isinstance(right, (str, Path)):
            return left / right
        return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")

    def _subscript(self, node: ast.Subscript, depth: int) -> object:
        base = self._value(node.value, depth + 1)
        key = self._value(node.slice, depth + 1)
        if isinstance(base, _Unknown):
            return base
        if isinstance(base, dict) and not isinstance(key, _Unknown):
            try:
                if key in base:
                    return base[key]
            except TypeError:
                pass
        if isinstance(base, (list, tuple)) and type(key) is int and -len(base) <= key < len(base):
            return base[key]
        return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")

    def _call(self, node: ast.Call, depth: int) -> object:
        func = self.name(node.func) or ""
        last = func.rsplit(".", 1)[-1]
        args = [self._value(a, depth + 1) for a in node.args]
        kwargs = {k.arg: self._value(k.value, depth + 1) for k in node.keywords if k.arg}
        if any(isinstance(a, _Unknown) for a in args):
            return next(a for a in args if isinstance(a, _Unknown))
        if func in ("pathlib.Path", "pathlib.PurePath", "pathlib.PosixPath") and all(isinstance(a, (str, Path)) for a in args):
            return Path(*args) if args else Path()  # type: ignore[arg-type]
        if func in ("os.path.join", "posixpath.join") and args and all(isinstance(a, (str, Path)) for a in args):
            return os.path.join(*map(str, args))
        if func in ("os.path.expanduser", "posixpath.expanduser") and len(args) == 1 and isinstance(args[0], (str, Path)):
            return os.path.expanduser(str(args[0]))
        if func in ("os.getenv", "os.environ.get") and args and isinstance(args[0], str):
            return os.environ.get(args[0], args[1] if len(args) > 1 else None)
        if func in ("builtins.str", "str") and len(args) == 1 and isinstance(args[0], (str, Path, int)):
            return str(args[0])
        if func.endswith("torch.device") or func == "torch.device":
            if args and isinstance(args[0], str):
                return _Device(args[0] if len(args) == 1 or type(args[1]) is not int else f"{args[0]}:{args[1]}")
            if args and type(args[0]) is int:
                return _Device(f"cuda:{args[0]}")
        if last == "BitsAndBytesConfig":
            four, eight = kwargs.get("load_in_4bit") is True, kwargs.get("load_in_8bit") is True
            # transformers' default bnb_4bit_quant_type is "fp4" (same size as nf4)
            kind = ("nf4" if kwargs.get("bnb_4bit_quant_type") == "nf4" else "fp4") if four else "int8" if eight else None
            return _Quant(kind, kwargs.get("bnb_4bit_use_double_quant") is True, last,
                          _skip_modules(kwargs.get("llm_int8_skip_modules")))
        if last.endswith("Config") and ("Quant" in last or last.startswith(("GPTQ", "Awq", "Hqq", "Quanto"))):
            return _Quant(None, False, last)
        if func in ("builtins.dict", "dict") and not args:
            return dict(kwargs)
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("expanduser", "absolute", "resolve") and not args:
            base = self._value(node.func.value, depth + 1)
            if isinstance(base, Path):
                return base.expanduser() if node.func.attr == "expanduser" else base
        if isinstance(node.func, ast.Attribute) and node.func.attr == "joinpath":
            base = self._value(node.func.value, depth + 1)
            if isinstance(base, Path) and all(isinstance(a, (str, Path)) for a in args):
                return base.joinpath(*args)  # type: ignore[arg-type]
        return _Unknown(f"`{_short(ast.unparse(node))}` is computed when the cell runs")


_MISSING = object()


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- finding load calls


def _arg(call: ast.Call, position: int | None, *names: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg in names:
            return kw.value
    if position is not None and len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def _kind_of(resolver: _Resolver, call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "from_pretrained":
        receiver = resolver.name(func.value) or ast.unparse(func.value)
        if _NOT_WEIGHTS.search(receiver.rstrip("()")):
            return None
        return "from_pretrained"
    name = resolver.name(func) or ""
    if name in ("torch.load", "torch.serialization.load"):
        return "torch.load"
    if name in ("safetensors.torch.load_file",) or name.endswith("safetensors.torch.load_file"):
        return "load_file"
    return None


def _dtype_of(value: object) -> str | None | _Unknown:
    if value is None:
        return None
    if isinstance(value, _Unknown):
        return value
    if isinstance(value, _Dtype):
        return _FLOAT_DTYPES.get(value.name, value.name)
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("torch.")
        return "auto" if text == "auto" else _FLOAT_DTYPES.get(text, text)
    return _Unknown(f"dtype {value!r} is not a torch dtype")


def _device_of(value: object) -> str | None | _Unknown:
    """Where a device_map / map_location / device argument puts the weights."""
    if value is None:
        return None
    if isinstance(value, _Unknown):
        return value
    if isinstance(value, _Device):
        return _device_text(value.name)
    if isinstance(value, bool):
        return _Unknown(f"{value!r} is not a device")
    if isinstance(value, int):
        return f"cuda:{value}"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _AUTO_MAPS:
            return "auto"
        return _device_text(text)
    if isinstance(value, dict):
        placements = {_device_of(v) for v in value.values()}
        if len(placements) == 1:
            only = next(iter(placements))
            if "" in value or len(value) == 1:
                return only
        return "mixed"
    if isinstance(value, _Symbol) and value.name == "<lambda>":
        return _Unknown("map_location is a function")
    return _Unknown(f"{_short(repr(value))} is not a device")


def _device_text(text: str) -> str:
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


def find_load_calls(cell: str, namespace: Mapping[str, Any] | None = None) -> tuple[LoadCall, ...]:
    """Find the model and checkpoint loads in a cell's source, without running it.

    Raises OomMagicError when the cell is not valid Python (after IPython's transforms).
    """
    return _find_load_calls(cell, namespace)[0]


def _find_load_calls(cell: str, namespace: Mapping[str, Any] | None) -> tuple[tuple[LoadCall, ...], tuple[str, ...]]:
    """The load calls, and a note for each namespace object the resolver had to skip."""
    try:
        tree = ast.parse(cell)
    except SyntaxError as exc:
        raise OomMagicError(f"the cell is not valid Python (line {exc.lineno}: {exc.msg}); nothing was checked") from None
    resolver = _Resolver(namespace if namespace is not None else {})
    parents = _parents(tree)
    found: list[tuple[LoadCall, ast.Call]] = []
    for stmt in _statements(tree.body):
        for node in sorted(_own_calls(stmt), key=lambda n: (n.lineno, n.col_offset)):
            kind = _kind_of(resolver, node)
            if kind is not None:
                found.append((_describe(kind, node, stmt, resolver, parents), node))
        _track_moves(stmt, resolver, found, parents)
        resolver.bind(stmt)
    return tuple(call for call, _ in found), tuple(dict.fromkeys(resolver.skipped))


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


def _chain_effects(node: ast.Call, parents: dict[int, ast.AST], resolver: _Resolver) -> tuple[str | None, str | None]:
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


def _move_effect(method: str, call: ast.Call, resolver: _Resolver, moved: str | None,
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
            if isinstance(value, _Dtype):
                cast = _FLOAT_DTYPES.get(value.name, value.name)
            else:
                device = _device_of(value)
                if isinstance(device, str) and device not in ("auto", "mixed"):
                    moved = device
    return moved, cast


def _track_moves(stmt: ast.stmt, resolver: _Resolver, found: list[tuple[LoadCall, ast.Call]],
                 parents: dict[int, ast.AST]) -> None:
    """``model.to("cuda")`` / ``model = model.cuda()`` in a later statement moves that load's result."""
    targets = {call.target: i for i, (call, _) in enumerate(found) if call.target}
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


def _describe(kind: str, node: ast.Call, stmt: ast.stmt, resolver: _Resolver, parents: dict[int, ast.AST]) -> LoadCall:
    notes: list[str] = []
    path_node = _arg(node, 0, "pretrained_model_name_or_path", "f", "filename")
    path_value = resolver.value(path_node) if path_node is not None else _Unknown("no checkpoint argument")
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
    if kind == "from_pretrained":
        value = _dtype_of(resolver.value(_arg(node, None, "dtype", "torch_dtype")))
        if isinstance(value, _Unknown):
            notes.append(f"dtype: {value.reason}")
        else:
            dtype = value
        q = resolver.value(_arg(node, None, "quantization_config"))
        if isinstance(q, _Quant):
            quant, double, skip = q.kind or q.type_name, q.double_quant, q.skip_modules
        elif isinstance(q, _Unknown) and _arg(node, None, "quantization_config") is not None:
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
    return LoadCall(
        kind=kind, line=node.lineno, source=_short(ast.unparse(node), 120),
        target=_assigned_name(node, stmt, parents), checkpoint=checkpoint, unresolved=unresolved,
        dtype=dtype, quantization=quant, double_quant=double, device=device, max_memory=max_memory,
        offload_folder=offload, map_location_given=map_given, weights_only=weights_only, mmap=mmap,
        moved_to=moved, cast_to=cast, notes=tuple(notes), skip_modules=skip,
    )


def _checkpoint_text(value: object) -> tuple[str | None, str | None]:
    if isinstance(value, _Unknown):
        return None, value.reason
    if isinstance(value, (str, Path)) and str(value).strip():
        return str(value), None
    if isinstance(value, _Opaque):
        return None, f"the checkpoint argument is a {type(value.obj).__name__} object, not a path or hub id"
    return None, f"the checkpoint argument {_short(repr(value))} is not a path or hub id"


def _placement(value: object, notes: list[str], what: str) -> str | None:
    device = _device_of(value)
    if isinstance(device, _Unknown):
        notes.append(f"{what}: {device.reason}")
        return "unknown"  # given, but only known when the cell runs
    return device


def _max_memory(value: object, notes: list[str]) -> tuple[tuple[int | str, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        notes.append("max_memory: " + (value.reason if isinstance(value, _Unknown) else "not a dict"))
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


# --------------------------------------------------------------------------- the check


class _Budgets:
    """Free memory per device, read once per check (NVML for CUDA, no context; psutil for RAM)."""

    def __init__(self, free_bytes: int | None, total_bytes: int | None, ram_bytes: int | None,
                 disk_bytes: int | None, headroom: str | int | None, nvml: Any, target: Target | None = None) -> None:
        self.target = target
        self.free_override = free_bytes
        self.total_override = total_bytes
        self.ram_override = ram_bytes
        self.disk_override = disk_bytes
        self.headroom_spec = headroom
        self.nvml = nvml
        self.cache: dict[str, tuple[int | None, int | None, int, str | None]] = {}
        self.limits: dict[str, int] = {}  # per-process caps (torch.cuda.set_per_process_memory_fraction)

    def device(self, device: str) -> tuple[int | None, int | None, int, str | None]:
        """(free, total, context still to come, why unknown) for a device."""
        if device not in self.cache:
            self.cache[device] = self._read(device)
        return self.cache[device]

    def _read(self, device: str) -> tuple[int | None, int | None, int, str | None]:
        if self.target is not None and device != "cpu":
            # The target's usable memory already leaves out its driver's share and a CUDA context.
            return self.target.usable, self.target.total, 0, None
        context = CUDA_CONTEXT_BYTES if device.startswith("cuda") and not cuda_initialized() else 0
        if self.free_override is not None:
            return self.free_override, self.total_override, context, None
        if device == "cpu":
            free, _ = usable_ram()
            total = self._ram_total()
            return free, total, 0, None if free is not None else "psutil could not read the RAM"
        from .devices import available_devices, read_device

        present = available_devices(self.nvml)
        if device not in present:
            return None, None, 0, f"this machine has no {device} (it has {', '.join(present)})"
        reading = read_device(device, self.nvml)
        if reading.free is None:
            why = next((n for n in reading.notes if "NVML" in n or "mem_get_info" in n), "no reading of its free memory")
            return None, reading.total, context, why
        # PyTorch's own cache (reserved, unallocated) is free for this load too.
        free = reading.free + (reading.cache or 0)
        cap = cuda_process_cap(device)
        if cap is not None:
            # set_per_process_memory_fraction: this process may reserve only `cap` of the device.
            self.limits[device] = cap
            return min(free, max(cap - (reading.allocated or 0), 0)), cap, context, None
        return free, reading.total, context, None

    @staticmethod
    def _ram_total() -> int | None:
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:
            return None

    def auto_device(self, guard_device: str | None) -> str | None:
        """The GPU device_map="auto" fills first: the guard's (with a free-bytes override) or the first present."""
        if self.target is not None:
            return guard_device if guard_device and guard_device.startswith("cuda") else "cuda:0"
        if self.free_override is not None:
            return guard_device if guard_device and guard_device.startswith(("cuda", "mps")) else None
        from .devices import available_devices

        return next((d for d in available_devices(self.nvml) if d.startswith(("cuda", "mps"))), None)

    def headroom(self, total: int | None, free: int | None) -> int:
        return parse_headroom(self.headroom_spec, total if total is not None else free)

    def ram(self) -> int | None:
        """RAM the load may use after headroom (for device_map='auto' and CPU-first loading)."""
        if self.ram_override is not None:
            return self.ram_override
        free, _ = usable_ram()
        if free is None:
            return None
        return max(free - parse_headroom(self.headroom_spec, self._ram_total()), 0)

    def disk(self) -> int | None:
        if self.disk_override is not None:
            return self.disk_override
        try:
            return int(shutil.disk_usage(os.getcwd()).free)
        except OSError:
            return None


def _transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:
        return 5


def _torch_version() -> tuple[int, int] | None:
    try:
        from importlib.metadata import version

        major, minor = version("torch").split(".")[:2]
        return int(major), int(re.match(r"\d+", minor).group())  # type: ignore[union-attr]
    except Exception:
        return None


def _load_dtype(call: LoadCall, declared: str | None, stored: str | None) -> str | None:
    """The float dtype from_pretrained loads in: dtype=, else "auto" (transformers 5) or fp32 (4.x)."""
    request = call.dtype
    if request is None:
        request = "auto" if _transformers_major() >= 5 else "float32"
    if request == "auto":
        if declared in ("float32", "float16", "bfloat16", "float64"):
            return declared
        return stored
    return request


def _stored_float(estimate: Any) -> str | None:
    for name, _ in estimate.stored_dtypes:
        if name.startswith(("float", "bfloat")):
            return name
    return None


def preflight_check(cell: str, namespace: Mapping[str, Any] | None = None, *, device: str | None = None,
                    free_bytes: int | None = None, total_bytes: int | None = None,
                    ram_bytes: int | None = None, disk_bytes: int | None = None,
                    headroom: str | int | None = None, nvml: Any = None,
                    target: str | Target | None = None) -> Preflight:
    """Say what a cell will load, whether it fits where it goes, and what to fix — without running it.

    ``device`` is the guard's device (used when a call does not say where it loads). Overrides,
    for planning and tests: ``free_bytes`` / ``total_bytes`` replace the target device's
    reading, ``ram_bytes`` the RAM budget, ``disk_bytes`` the disk budget. ``headroom`` is kept
    free on the target: a size ("2GiB") or a percentage of its capacity ("5%", the default).
    ``target`` ("T4", "16GiB"; see ``targets.parse_target``) checks each load against that GPU's
    usable memory instead of this machine's: a load placed on one device here is checked as if its
    weights went to the target GPU, ``device_map="auto"`` as the target plus this machine's RAM and
    disk, and the options are those that fit there. Raises OomMagicError for a bad headroom or
    target; a cell that does not parse gives a note, not an error.
    """
    parse_headroom(headroom, 0)  # a bad spelling fails now, not after reading files
    rehearsed = parse_target(target) if target is not None else None
    notes: list[str] = []
    try:
        calls, skipped = _find_load_calls(cell, namespace)
    except OomMagicError as exc:
        return Preflight(device, (), (), (), (str(exc),))
    notes += skipped
    if not calls:
        notes.append("no from_pretrained / torch.load / load_file call found: nothing to size")
    budgets = _Budgets(free_bytes, total_bytes, ram_bytes, disk_bytes, headroom, nvml, rehearsed)
    # --target: the local fit check always applies too (the cell runs here, whatever the target).
    here = _Budgets(free_bytes, total_bytes, ram_bytes, disk_bytes, headroom, nvml) if rehearsed else None
    checks: list[FitCheck] = []
    lints: list[Lint] = []
    for call in calls:
        check, call_lints = _check_call(call, device, budgets)
        if here is not None and check.target is not None:
            local, _ = _check_call(call, device, here)
            check = replace(check, local=local)
        checks.append(check)
        lints += call_lints
        if rehearsed is not None and check.target is not None and not check.device.startswith(("cuda", "auto")):
            notes.append(f"line {call.line} loads to {check.device} here; --target {rehearsed.name} checked it as if "
                         "its weights went to that GPU")
    target = next((d for d in map(_measured_device, checks) if d is not None), device)
    return Preflight(target, calls, tuple(checks), tuple(lints), tuple(notes))


def load_target(cell: str, namespace: Mapping[str, Any] | None = None) -> str | None:
    """The device the cell's first sized load puts its weights on ('cuda', 'cuda:1', 'cpu'), or None.

    Read from the call alone (and, for torch.load without map_location, the devices the file was
    saved from): no estimate, no device reading.
    """
    try:
        calls = find_load_calls(cell, namespace)
    except OomMagicError:
        return None
    for call in calls:
        where = _target(call, None)
        if where is None and call.kind == "torch.load" and call.checkpoint and Path(call.checkpoint).is_file():
            try:
                keys = read_checkpoint_keys(call.checkpoint)
            except OomMagicError:
                keys = None
            saved = {_device_text(loc) for loc in (keys.locations if keys else ())}
            where = saved.pop() if len(saved) == 1 else "cpu"
        if where == "auto":
            from .devices import available_devices

            return "cuda" if any(d.startswith("cuda") for d in available_devices()) else "cpu"
        if where is not None and where not in ("mixed", "disk", "meta", "unknown"):
            return where
    return None


def _measured_device(check: FitCheck) -> str | None:
    """The device a guard should watch for this load: its target, or the GPU of an "auto" split."""
    if check.device == "auto":
        return next((d for d, _ in check.split if d not in ("cpu", "disk")), "cpu")
    if check.device in ("mixed", "unknown", "disk", "meta"):
        return None
    return check.device


def _check_call(call: LoadCall, guard_device: str | None, budgets: _Budgets) -> tuple[FitCheck, list[Lint]]:
    lints: list[Lint] = []
    keys: CheckpointKeys | None = None
    where = _target(call, guard_device)
    if call.checkpoint is None:
        return _unknown(call, where, f"cannot size the checkpoint: {call.unresolved}"), _lints(call, None, None, None)
    try:
        # A from_pretrained cell runs transformers anyway: its quantized / float16 sizes may ask
        # transformers' own rules (a meta model, built only when such a size is asked for).
        estimate = _estimate(call.checkpoint, follow_transformers=call.kind == "from_pretrained")
    except OomMagicError as exc:
        lints = _lints(call, None, None, None)
        return _unknown(call, where, f"cannot size {call.checkpoint}: {exc}"), lints
    if call.kind == "torch.load":
        try:
            keys = read_checkpoint_keys(estimate.files[0]) if len(estimate.files) == 1 else None
        except OomMagicError:
            keys = None
        if where is None:
            saved = {_device_text(loc) for loc in (keys.locations if keys else ())}
            where = saved.pop() if len(saved) == 1 else "cpu"
    lints = _lints(call, estimate, keys, _load_dtype(call, estimate.declared_dtype, _stored_float(estimate)))
    need, dtype = _need(call, estimate)
    where = where or "cpu"
    if where == "unknown":
        why = next((n for n in call.notes if n.startswith(("device_map:", "map_location:", "device:"))), "")
        return _unknown(call, where, f"where it loads is known only when the cell runs ({why})", estimate, need,
                        dtype), lints
    if where == "mixed":
        return _unknown(call, where, "device_map places modules one by one: not checked", estimate, need, dtype), lints
    if where in ("disk", "meta"):
        return _unknown(call, where, f"weights go to {where}, not to memory", estimate, need, dtype), lints
    if where == "auto":
        return _check_auto(call, estimate, need, dtype, budgets, guard_device), lints
    resolved = _resolve_cuda(where)
    # --target: the weights go to the target GPU (keeping a cuda:N index), whatever this machine has.
    place = (resolved if resolved.startswith("cuda") else "cuda:0") if budgets.target is not None else resolved
    free, total, context, why = budgets.device(place)
    headroom = budgets.headroom(total, free)
    base = dict(call=call, device=resolved, need=need, dtype=dtype, free=free, context=context,
                headroom=headroom, parameters=estimate.parameters, format=estimate.format,
                declared_dtype=estimate.declared_dtype, files=len(estimate.files), estimate=estimate,
                process_cap=budgets.limits.get(place), target=budgets.target)
    if free is None:
        return FitCheck(verdict="unknown", reason=why, **base), lints  # type: ignore[arg-type]
    peak = _ram_peak(call, estimate, dtype) if place == "cpu" else None
    base["ram_peak"] = peak if peak is not None and peak > need else None
    budget = free - context - headroom
    if max(need, peak or 0) <= budget:
        return FitCheck(verdict="fits", reason=None, **base), lints  # type: ignore[arg-type]
    model_part = None
    if keys is not None and keys.optimizer_keys():
        model_part = keys.model_key()
    options = fit_options(estimate, device=place, need=need, dtype=dtype, loader=call.kind,
                          device_budget=budget, ram_budget=budgets.ram() if place != "cpu" else budget,
                          disk_budget=budgets.disk(), model_part=model_part,
                          offload_folder=call.offload_folder or "offload")
    options, offload = _check_offload_plan(options, _peak_ratio(call, estimate, dtype))
    return FitCheck(verdict="will-not-fit", reason=None, options=options, offload=offload,
                    **base), lints  # type: ignore[arg-type]


def _ram_peak(call: LoadCall, estimate: Any, dtype: str | None) -> int | None:
    """RAM a from_pretrained onto the cpu takes at its peak (load_peak), or None when not known."""
    if call.kind != "from_pretrained":
        return None
    from .load_peak import load_peak

    peak = load_peak(estimate, dtype)
    return None if peak is None else peak.ram_need


def _peak_ratio(call: LoadCall, estimate: Any, dtype: str | None) -> float:
    """RAM at the load's peak per byte of weights kept in RAM (1.0 when no copy is made)."""
    peak = _ram_peak(call, estimate, dtype)
    loaded = estimate.bytes_for(dtype) if dtype in _FLOAT_DTYPES.values() else estimate.stored_bytes
    return max(peak / loaded, 1.0) if peak and loaded else 1.0


def _check_offload_plan(options: tuple[FitOption, ...],
                        peak_ratio: float = 1.0) -> tuple[tuple[FitOption, ...], OffloadCheck | None]:
    """Check the advised disk-offload plan's RAM and disk shares here; an option that falls short does not fit.

    The RAM share counts the load's transient peak (``peak_ratio``: a cast copies beside the file).
    """
    plan = next((o for o in options if o.kind == "offload-folder"), None)
    if plan is None:
        return options, None
    try:
        offload = check_offload(int(plan.cpu_bytes * peak_ratio), plan.disk_bytes, plan.offload_folder or "offload")
    except OomMagicError:
        return options, None
    if offload.ok:
        return options, offload
    return tuple(replace(o, fits=False) if o is plan else o for o in options), offload


def _target(call: LoadCall, guard_device: str | None) -> str | None:
    if call.moved_to:
        return call.moved_to
    if call.kind == "from_pretrained":
        return call.device or "cpu"
    return call.device


def _resolve_cuda(device: str) -> str:
    """'cuda' → the current CUDA device (cuda:0 without a context)."""
    if device != "cuda":
        return device
    from .devices import default_device

    current = default_device()
    return current if current.startswith("cuda") else "cuda:0"


def _need(call: LoadCall, estimate: Any) -> tuple[int, str | None]:
    """Bytes the load puts on its target, and the dtype that assumes (None: as stored)."""
    if call.kind != "from_pretrained":
        if call.cast_to in _FLOAT_DTYPES.values():
            return estimate.bytes_for(call.cast_to), call.cast_to
        return estimate.stored_bytes, None
    dtype = _load_dtype(call, estimate.declared_dtype, _stored_float(estimate))
    if call.cast_to in _FLOAT_DTYPES.values() and call.quantization is None:
        dtype = call.cast_to
    rest = dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16"
    if call.quantization in ("int8", "nf4", "fp4"):
        kwargs = {"skip_modules": call.skip_modules} if call.skip_modules is not None else {}
        return (estimate.bytes_for(call.quantization, double_quant=call.double_quant, unquantized_dtype=rest, **kwargs),
                call.quantization)
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        return estimate.bytes_for(dtype), dtype
    return estimate.stored_bytes, None


def _unknown(call: LoadCall, where: str | None, reason: str, estimate: Any = None, need: int | None = None,
             dtype: str | None = None) -> FitCheck:
    return FitCheck(call=call, device=where or "unknown", verdict="unknown", reason=reason, need=need, dtype=dtype,
                    free=None, context=0, headroom=0,
                    parameters=estimate.parameters if estimate is not None else None,
                    format=estimate.format if estimate is not None else None,
                    declared_dtype=estimate.declared_dtype if estimate is not None else None,
                    files=len(estimate.files) if estimate is not None else 0, estimate=estimate)


def _check_auto(call: LoadCall, estimate: Any, need: int, dtype: str | None, budgets: _Budgets,
                guard_device: str | None) -> FitCheck:
    """device_map="auto": the first GPU (if any), then RAM, then (with offload_folder) disk."""
    limits = dict(call.max_memory or ())
    gpu = budgets.auto_device(guard_device)
    split: list[tuple[str, int]] = []
    free = total = None
    context = headroom = 0
    if gpu is not None:
        free, total, context, _ = budgets.device(gpu)
        headroom = budgets.headroom(total, free)
        usable = max((free or 0) - context - headroom, 0)
        key = device_index(gpu)
        if key in limits:
            usable = min(usable, limits[key])
        split.append((gpu, usable))
    ram = budgets.ram()
    if ram is not None:
        split.append(("cpu", min(ram, limits["cpu"]) if "cpu" in limits else ram))
    disk = budgets.disk()
    if call.offload_folder and disk is not None:
        split.append(("disk", disk))
    verdict = "fits" if need <= sum(b for _, b in split) else "will-not-fit"
    options: tuple[FitOption, ...] = ()
    offload: OffloadCheck | None = None
    if verdict == "will-not-fit":
        place = gpu or "cpu"
        options = fit_options(estimate, device=place, need=need, dtype=dtype,
                              device_budget=dict(split).get(place, 0), ram_budget=ram, disk_budget=disk,
                              offload_folder=call.offload_folder or "offload")
        options, offload = _check_offload_plan(options, _peak_ratio(call, estimate, dtype))
    return FitCheck(call=call, device="auto", verdict=verdict, reason=None, need=need, dtype=dtype, free=free,
                    context=context, headroom=headroom, parameters=estimate.parameters, format=estimate.format,
                    declared_dtype=estimate.declared_dtype, split=tuple(split), options=options,
                    files=len(estimate.files), estimate=estimate, target=budgets.target, offload=offload)


class _PipelineEstimate:
    """A diffusers pipeline folder sized as the sum of its components (CheckpointEstimate's interface)."""

    def __init__(self, path: Path, parts: list[Any]) -> None:
        self.path = str(path)
        self.parts = parts
        self.format = "diffusers-pipeline"
        self.files = tuple(f for p in parts for f in p.files)
        self.parameters = sum(p.parameters for p in parts)
        self.stored_bytes = sum(p.stored_bytes for p in parts)
        self.bytes = sum(p.bytes for p in parts)
        declared = {p.declared_dtype for p in parts} - {None}
        self.declared_dtype = declared.pop() if len(declared) == 1 else None
        census: dict[str, int] = {}
        for p in parts:
            for name, n in p.stored_dtypes:
                census[name] = census.get(name, 0) + n
        self.stored_dtypes = tuple(sorted(census.items(), key=lambda kv: -kv[1]))

    def bytes_for(self, dtype: str, **kwargs: Any) -> int:
        return sum(p.bytes_for(dtype, **kwargs) for p in self.parts)


def _estimate(checkpoint: str, follow_transformers: bool = False) -> Any:
    """estimate_checkpoint, or for a diffusers pipeline folder the sum over its weight folders."""
    from .estimate import estimate_checkpoint, resolve_checkpoint

    try:
        return estimate_checkpoint(checkpoint, follow_transformers=follow_transformers)
    except OomMagicError as first:
        try:
            folder = resolve_checkpoint(checkpoint)
        except OomMagicError:
            raise first from None
        if not (folder / "model_index.json").is_file():
            raise
        parts = []
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            weights = [f for f in sub.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth")]
            if weights:
                parts.append(estimate_checkpoint(sub))
        if not parts:
            raise
        return _PipelineEstimate(folder, parts)


# --------------------------------------------------------------------------- lints


def _lints(call: LoadCall, estimate: Any, keys: CheckpointKeys | None, load_dtype: str | None) -> list[Lint]:
    found: list[Lint] = []
    if call.kind == "torch.load":
        found += _torch_load_lints(call, estimate, keys)
    if call.kind == "from_pretrained" and estimate is not None:
        declared = estimate.declared_dtype
        if load_dtype == "float32" and declared in ("bfloat16", "float16") and call.quantization is None \
                and call.cast_to in (None, "float32"):
            half = estimate.bytes_for(declared)
            found.append(Lint(
                "fp32-of-half", call.line,
                f"loads in float32 a model whose config.json declares {declared}: {{fp32}} instead of {{half}}",
                f'pass dtype=torch.{declared} (or dtype="auto")',
                sizes=(("fp32", estimate.bytes_for("float32")), ("half", half))))
    return found


def _torch_load_lints(call: LoadCall, estimate: Any, keys: CheckpointKeys | None) -> list[Lint]:
    found: list[Lint] = []
    name = Path(call.checkpoint).name if call.checkpoint else "the checkpoint"
    saved_on_cpu = keys is not None and bool(keys.locations) and all(loc == "cpu" for loc in keys.locations)
    if not call.map_location_given and not saved_on_cpu:  # a cpu-saved file comes back to the cpu anyway
        saved = ", ".join(keys.locations) if keys is not None and keys.locations else None
        where = f" (this file was saved from {saved})" if saved else ""
        found.append(Lint("map-location", call.line,
                          f"torch.load without map_location restores each tensor to the device it was saved from{where}",
                          'pass map_location="cpu", then move the model with .to(device)'))
    if call.weights_only is not True:
        version = _torch_version()
        safe_default = version is not None and version >= (2, 6) and call.weights_only is None \
            and os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "") in ("", "0")
        if call.weights_only is False:
            message = "torch.load(weights_only=False) unpickles the file, which runs any code it holds"
        elif safe_default:
            message = (f"torch.load without weights_only=True: torch {version[0]}.{version[1]} defaults to it, "  # type: ignore[index]
                       "but torch < 2.6 (or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) unpickles with code execution")
        else:
            message = "torch.load without weights_only=True unpickles the file, which runs any code it holds"
        found.append(Lint("weights-only", call.line, message, "pass weights_only=True",
                          severity="info" if safe_default else "warning"))
    if call.checkpoint is not None:
        sibling = _safetensors_sibling(Path(call.checkpoint))
        if sibling is not None:
            found.append(Lint("safetensors-sibling", call.line,
                              f"{name} is a pickle, and {sibling.name} beside it holds safetensors (no code runs, memory-mapped)",
                              f'load {sibling.name} with safetensors.torch.load_file(path, device="cpu")'))
    if keys is not None and keys.optimizer_keys() and not (call.mmap and call.device == "cpu"):
        heavy = keys.optimizer_keys()
        opt_bytes = sum(b for _, b in heavy)
        names = ", ".join(repr(k) for k, _ in heavy)
        model = keys.model_key()
        pick = f"[{model[0]!r}]" if model else ""
        found.append(Lint("training-checkpoint", call.line,
                          f"{name} is a training checkpoint: {names} {'hold' if len(heavy) > 1 else 'holds'} "
                          "{optimizer} of its {total}, "
                          "and torch.load reads all of it",
                          f'torch.load(path, map_location="cpu", weights_only=True, mmap=True){pick} reads only what you use',
                          sizes=(("optimizer", opt_bytes), ("total", keys.total))))
    return found


def _safetensors_sibling(path: Path) -> Path | None:
    """A .safetensors file beside a pickle checkpoint: same stem, the HF rename, or the only one."""
    if not path.is_file() or path.suffix == ".safetensors":
        return None
    same = path.with_suffix(".safetensors")
    if same.is_file():
        return same
    if path.name.startswith("pytorch_model"):
        renamed = path.parent / (path.name.replace("pytorch_model", "model", 1).rsplit(".", 1)[0] + ".safetensors")
        if renamed.is_file():
            return renamed
    try:
        others = sorted(p for p in path.parent.iterdir() if p.suffix == ".safetensors" and p.is_file())
    except OSError:
        return None
    return others[0] if len(others) == 1 else None

