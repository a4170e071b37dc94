"""The values of a load call's arguments, read without running the cell.

An argument resolves when it is a literal, a name bound earlier in the cell to a resolvable value,
or a name in the user namespace holding a plain value (str, int, paths, torch dtypes and devices,
dicts and lists of them, modules, a ``BitsAndBytesConfig``). Attributes of user objects are read
from the instance ``__dict__`` only, so no property, ``__getattr__`` or other user code runs; a
value that cannot be known before the cell runs is an ``Unknown`` with the reason.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path, PosixPath, PurePath, PurePosixPath, PureWindowsPath, WindowsPath
from types import ModuleType
from typing import Any, cast
from collections.abc import Iterable, Mapping, Sized

from ..common.dtypes import canonical_dtype
from ..heap.holders import instance_dict as _instance_dict
from ..common.sizes import shorten

__all__ = ["DeviceValue", "DtypeValue", "Opaque", "QuantValue", "Resolver", "Symbol", "Unknown", "float_dtype",
           "odd_metaclass"]

# torch's float dtype attributes, each with the canonical name of what it is.
_TORCH_FLOATS = ("float32", "float", "float16", "half", "bfloat16", "float64", "double")


def float_dtype(name: str) -> str:
    """A torch float dtype attribute's canonical name ('half' → 'float16'); any other name unchanged."""
    return canonical_dtype(name) if name in _TORCH_FLOATS else name


class Unknown:
    """An argument that cannot be known without running the cell, and why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unknown: {self.reason}>"


@dataclass(frozen=True)
class DtypeValue:
    """A torch dtype, by name ('bfloat16')."""

    name: str


@dataclass(frozen=True)
class DeviceValue:
    """A torch.device, as str() writes it ('cuda:0')."""

    name: str


@dataclass(frozen=True)
class QuantValue:
    """A quantization config: bitsandbytes' kind and double quantization, or another config's type name."""

    kind: str | None  # 'int8' | 'nf4' | 'fp4' | None (not bitsandbytes)
    double_quant: bool
    type_name: str
    skip_modules: tuple[str, ...] | None = None  # llm_int8_skip_modules: transformers' modules_to_not_convert


def skip_modules_of(value: object) -> tuple[str, ...] | None:
    """llm_int8_skip_modules as given (a list of module names), else None (transformers' defaults)."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


@dataclass(frozen=True)
class Symbol:
    """A module, class or function, by its qualified name."""

    name: str


class Opaque:
    """A user object whose instance __dict__ may be read (never its properties)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj


_TORCH_DTYPES = frozenset({"float32", "float", "float16", "half", "bfloat16", "float64", "double",
                           "int8", "uint8", "int16", "int32", "int64", "bool"})
_MISSING = object()  # an attribute a module's own __dict__ does not hold


def _qualified(obj: object) -> str | None:
    """'torch.load', 'transformers.AutoModelForCausalLM' for a function, class or module."""
    # type(obj), never isinstance: isinstance falls back to obj.__class__, which a proxy can override
    if issubclass(type(obj), ModuleType):
        return cast(ModuleType, obj).__name__
    if issubclass(type(obj), type) or type(obj).__name__ in ("function", "builtin_function_or_method"):
        module = getattr(obj, "__module__", None)
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if isinstance(module, str) and isinstance(name, str):
            return f"{module}.{name}"
    return None


_METACLASS_OVERRIDES = ("__module__", "__name__", "__qualname__", "__eq__", "__hash__", "__getattribute__")


def odd_metaclass(obj: object) -> str | None:
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


_PATH_TYPES = (Path, PosixPath, WindowsPath, PurePath, PurePosixPath, PureWindowsPath)


def _from_object(obj: object, depth: int = 0) -> object:
    """A namespace value as the resolver sees it: plain data, a symbol, or an opaque object."""
    odd = odd_metaclass(obj)
    if odd is not None:
        return Unknown(f"a value that cannot be inspected ({odd}) was skipped")
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if type(obj) in _PATH_TYPES:  # exact pathlib types: a subclass's __fspath__ or __str__ is user code
        return Path(cast(PurePath, obj))
    cls = type(obj)
    if cls.__module__ == "torch" and cls.__name__ == "dtype":
        return DtypeValue(str(obj).removeprefix("torch."))
    if cls.__module__ == "torch" and cls.__name__ == "device":
        return DeviceValue(str(obj))
    if depth < 4 and cls in (dict, list, tuple) and len(cast("Sized", obj)) <= 1000:
        # The base classes' own methods: exactly these types, so no user __iter__ or items() runs.
        if cls is dict:
            pairs = dict.items(cast("dict[object, object]", obj))
            return {_from_object(k, depth + 1): _from_object(v, depth + 1) for k, v in pairs}
        values: Iterable[object] = (list.__iter__(cast("list[object]", obj)) if cls is list
                                    else tuple.__iter__(cast("tuple[object, ...]", obj)))
        items = [_from_object(v, depth + 1) for v in values]
        return items if cls is list else tuple(items)
    quant = _quant_from_object(obj)
    if quant is not None:
        return quant
    name = _qualified(obj)
    if name is not None:
        return Symbol(name)
    return Opaque(obj)  # any other path-like object: reading it would run its __fspath__


def _quant_from_object(obj: object) -> QuantValue | None:
    """A BitsAndBytesConfig (or another quantization config) read from its instance dict."""
    name = type(obj).__name__
    if not name.endswith("Config") or not any(mark in name for mark in ("Quant", "BitsAndBytes", "GPTQ", "Awq", "Hqq")):
        return None
    attrs = _instance_dict(obj)
    if name == "BitsAndBytesConfig":
        four = bool(attrs.get("_load_in_4bit", attrs.get("load_in_4bit", False)))
        eight = bool(attrs.get("_load_in_8bit", attrs.get("load_in_8bit", False)))
        kind = ("fp4" if attrs.get("bnb_4bit_quant_type") == "fp4" else "nf4") if four else "int8" if eight else None
        return QuantValue(kind, bool(attrs.get("bnb_4bit_use_double_quant", False)), name,
                      skip_modules_of(attrs.get("llm_int8_skip_modules")))
    return QuantValue(None, False, name)


class Resolver:
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
            head = value.name if isinstance(value, Symbol) else base
        elif base in self.namespace and odd_metaclass(self.namespace[base]) is not None:
            self.skipped.append(f"`{base}` was skipped: {odd_metaclass(self.namespace[base])}, so the preflight "
                                "cannot inspect it")
            head = base
        elif base in self.namespace:
            obj = self.namespace[base]
            head = _qualified(obj) or (f"{type(obj).__module__}.{type(obj).__qualname__}()" if type(obj) not in (str, int, float) else base)
        else:
            head = base
        return ".".join([head, *reversed(parts)])

    def value(self, node: ast.AST | None) -> object:
        """The value of an argument expression, or Unknown with the reason."""
        try:
            return self._value(node, 0)
        except RecursionError:
            return Unknown("the expression is too deeply nested")

    def _value(self, node: ast.AST | None, depth: int) -> object:
        if node is None:
            return None
        if depth > 30:
            return Unknown("the expression is too deeply nested")
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
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and type(node.operand.value) in (int, float):
            return -cast(float, node.operand.value)  # device=-1: pipeline's spelling of the cpu
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self._value(e, depth + 1) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                return Unknown("a dict built with ** is computed when the cell runs")
            return {self._hashable(self._value(k, depth + 1)): self._value(v, depth + 1)
                    for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Subscript):
            return self._subscript(node, depth)
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        if isinstance(node, ast.Lambda):
            return Symbol("<lambda>")
        return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")

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
            return Symbol(self.imports[name])
        if name in self.namespace:
            value = _from_object(self.namespace[name])
            if isinstance(value, Unknown) and odd_metaclass(self.namespace[name]) is not None:
                self.skipped.append(f"`{name}` was skipped: {odd_metaclass(self.namespace[name])}, so the "
                                    "preflight cannot inspect it")
            return value
        return Unknown(f"`{name}` is not defined yet (it is set when the cell runs)")

    def _attribute(self, node: ast.Attribute, depth: int) -> object:
        base = self._value(node.value, depth + 1)
        attr = node.attr
        if isinstance(base, Symbol):
            module = sys.modules.get(base.name)
            if module is not None:
                sub = sys.modules.get(f"{base.name}.{attr}")
                if sub is not None:
                    return Symbol(sub.__name__)
                # A module's own __dict__: never its __getattr__ (lazy modules import on access).
                found = module.__dict__.get(attr, _MISSING)
                if found is not _MISSING:
                    return _from_object(found)
            if base.name == "torch" and attr in _TORCH_DTYPES:
                return DtypeValue(float_dtype(attr))
            return Symbol(f"{base.name}.{attr}")
        if isinstance(base, Opaque):
            attrs = _instance_dict(base.obj)
            if attr in attrs:
                return _from_object(attrs[attr])
            return Unknown(f"`{shorten(ast.unparse(node))}` is not a plain attribute (a property or computed value)")
        if isinstance(base, Unknown):
            text = ast.unparse(node)
            if text.startswith("torch.") and attr in _TORCH_DTYPES:
                return DtypeValue(float_dtype(attr))
            return base
        if isinstance(base, Path) and attr in ("parent", "name", "stem"):
            return getattr(base, attr)
        return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")

    def _fstring(self, node: ast.JoinedStr, depth: int) -> object:
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
                continue
            if not isinstance(part, ast.FormattedValue) or part.format_spec is not None or part.conversion not in (-1, 115):
                return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")
            value = self._value(part.value, depth + 1)
            if isinstance(value, Unknown):
                return value
            if type(value) not in (str, int) and not isinstance(value, Path):
                return Unknown(f"`{shorten(ast.unparse(part.value))}` is not a plain value")
            out.append(str(value))
        return "".join(out)

    def _binop(self, node: ast.BinOp, depth: int) -> object:
        left, right = self._value(node.left, depth + 1), self._value(node.right, depth + 1)
        for side in (left, right):
            if isinstance(side, Unknown):
                return side
        if isinstance(node.op, ast.Add) and type(left) is str and type(right) is str:
            return left + right
        if isinstance(node.op, ast.Div) and isinstance(left, Path) and isinstance(right, (str, Path)):
            return left / right
        return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")

    def _subscript(self, node: ast.Subscript, depth: int) -> object:
        base = self._value(node.value, depth + 1)
        key = self._value(node.slice, depth + 1)
        if isinstance(base, Unknown):
            return base
        if isinstance(base, dict) and not isinstance(key, Unknown):
            try:
                if key in base:
                    return base[key]
            except TypeError:
                pass
        if isinstance(base, (list, tuple)) and type(key) is int and -len(base) <= key < len(base):
            return base[key]
        return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")

    def _call(self, node: ast.Call, depth: int) -> object:
        func = self.name(node.func) or ""
        last = func.rsplit(".", 1)[-1]
        args = [self._value(a, depth + 1) for a in node.args]
        kwargs = {k.arg: self._value(k.value, depth + 1) for k in node.keywords if k.arg}
        if any(isinstance(a, Unknown) for a in args):
            return next(a for a in args if isinstance(a, Unknown))
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
                return DeviceValue(args[0] if len(args) == 1 or type(args[1]) is not int else f"{args[0]}:{args[1]}")
            if args and type(args[0]) is int:
                return DeviceValue(f"cuda:{args[0]}")
        if last == "BitsAndBytesConfig":
            four, eight = kwargs.get("load_in_4bit") is True, kwargs.get("load_in_8bit") is True
            # transformers' default bnb_4bit_quant_type is "fp4" (same size as nf4)
            kind = ("nf4" if kwargs.get("bnb_4bit_quant_type") == "nf4" else "fp4") if four else "int8" if eight else None
            return QuantValue(kind, kwargs.get("bnb_4bit_use_double_quant") is True, last,
                          skip_modules_of(kwargs.get("llm_int8_skip_modules")))
        if last.endswith("Config") and ("Quant" in last or last.startswith(("GPTQ", "Awq", "Hqq", "Quanto"))):
            return QuantValue(None, False, last)
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
        return Unknown(f"`{shorten(ast.unparse(node))}` is computed when the cell runs")

