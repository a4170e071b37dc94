"""What the walk does with an object, decided once per type from the type's own layout.

``classify`` reads a class through ``type``'s descriptors and its MRO by identity, so no
metaclass code runs; the walk keys the answer by the type's id. Plain ints compared with ==:
the walk dispatches once per kind present in a slice, and ``compress(level, map(kind.__eq__,
kinds))`` selects each kind's objects in one C-level pass.
"""
from __future__ import annotations

import sys
import types

from .reads import deque_type, type_dict, type_mro

GENERIC = 0   # its gc.get_referents
DICT = 1      # its values (keys after everything else, when any is tracked)
FUNCTION = 2  # closure, defaults and __dict__ (never __globals__)
FRAME = 3     # its locals
NDARRAY = 4   # an object array's items
SKIP = 5      # never entered: modules, classes, code, builtins, descriptors
LATER = 6     # walked after every other object of its level is done (see later_types)
SEQ = 7       # an exact builtin list, tuple, set, frozenset or deque
ROW = 8       # a tuple subclass with no fields of its own (a namedtuple): its items
RECORD = 9    # an instance of a class defined in Python alone: its gc.get_referents less its class
TIE_ORDER = {DICT: 0, SEQ: 1, ROW: 2, FRAME: 3, FUNCTION: 4, NDARRAY: 5, RECORD: 6, GENERIC: 7, LATER: 8, SKIP: 9}
# A type's own layout, read through ``type``'s descriptors (no metaclass code runs).
_BASICSIZE = type.__dict__["__basicsize__"].__get__
DICT_OFFSET = type.__dict__["__dictoffset__"].__get__
_FLAGS = type.__dict__["__flags__"].__get__
# A class statement's class: a heap type (Py_TPFLAGS_HEAPTYPE) that is not immutable, as the C
# extensions' heap types are (Py_TPFLAGS_IMMUTABLETYPE: functools.partial, whose traversal visits its
# class first); its traversal (CPython's subtype_traverse) visits the class last.
_HEAPTYPE, _IMMUTABLE = 1 << 9, 1 << 8
DICT_ID = id(dict)

_SKIP_TYPES = (types.ModuleType, types.CodeType, types.BuiltinFunctionType, types.MethodWrapperType,
               types.WrapperDescriptorType, types.MethodDescriptorType, types.GetSetDescriptorType,
               types.MemberDescriptorType, types.ClassMethodDescriptorType, property, staticmethod,
               classmethod, types.MappingProxyType)


def classify(cls: type, ndarray: type | None, later: tuple[type, ...] = ()) -> int:
    """Which branch of the walk handles instances of ``cls``."""
    if cls is dict:
        return DICT
    if cls is list or cls is tuple or cls is set or cls is frozenset or cls is deque_type():
        return SEQ  # exact builtin containers: len() and iteration are their own C code
    if cls is types.FunctionType:
        return FUNCTION
    if cls is types.FrameType:
        return FRAME
    try:
        mro = type_mro(cls)
    except Exception:
        return SKIP
    for base in mro:
        if base is type or any(base is s for s in _SKIP_TYPES):
            return SKIP
    if ndarray is not None and any(k is ndarray for k in mro):
        return NDARRAY
    if any(k is dict for k in mro):
        return DICT
    if any(k is tuple for k in mro) and DICT_OFFSET(cls) == 0 and _BASICSIZE(cls) == _BASICSIZE(tuple) \
            and _no_hidden_fields(cls):
        return ROW  # gc.get_referents would add only its class, which is never entered
    if later and any(k is base for k in mro for base in later):
        return LATER
    if all(_FLAGS(k) & (_HEAPTYPE | _IMMUTABLE) == _HEAPTYPE for k in mro[:-1]) and mro[-1] is object:
        return RECORD
    return GENERIC


def _no_hidden_fields(cls: type) -> bool:
    """A struct sequence (os.stat_result) keeps fields past its length, which only its traversal reaches."""
    try:
        own = type_dict(cls)
        return own.get("n_fields", 0) == own.get("n_sequence_fields", 0)
    except Exception:
        return False


def later_types() -> tuple[type, ...]:
    """Holders whose paths a user recognises less than a model's: an optimizer holds the parameters too,
    and a bound method its object (a PEFT model keeps its base model's `prepare_inputs_for_generation`)."""
    optim = sys.modules.get("torch.optim")
    optimizer = getattr(optim, "Optimizer", None) if optim is not None else None
    return (types.MethodType, optimizer) if isinstance(optimizer, type) else (types.MethodType,)
