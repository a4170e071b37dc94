"""Bad input gets a clear answer: magics' flags, sizes, devices and names; the checkpoint estimator
and ``parse_oom_message`` fuzzed with hostile files and text.

Every estimator input must end in a ``CheckpointEstimate`` or a one-line ``OomMagicError`` — never
another exception, never more than 100 MB of memory (``tracemalloc`` peak per input), never a hang
(a SIGALRM watchdog raises a BaseException after 5 s: no timing is asserted, only a real hang
fails). Work is bounded structurally by the estimator (header bytes and JSON values counted before
parsing, pickle opcodes and symbolic objects counted while walking), which is what makes the
watchdog a backstop rather than a measurement. Pickle payloads that would run code (they open a
marker file when unpickled, which a control run in a subprocess proves) must never run.

Counts: tests/checkpoints/test_estimate.py already fuzzes 1,300 estimator inputs (mutated safetensors bytes,
random header JSON, mutated torch zips); this file adds 3,900 (header lengths up to 2**64-1,
offsets out of range or overlapping, non-UTF-8 headers, unknown dtypes, random pickle opcode
streams with code-running globals, zip structures and zip-bomb claims, deep and wide JSON, shard
indexes and configs) plus ~40 explicit bombs and refusals below, for 5,250+ in all.
tests/guard/test_oom_parse.py fuzzes 2,300 texts; this file adds 700 more (any object, str subclasses,
grammar-built messages with extreme figures) and eight pathological long texts.

The one fake: NVML (there is no GPU here), so that ``cuda:9`` on a one-GPU machine can be asked for.
"""
from __future__ import annotations

import array
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from oom_magic.guard import oom
from oom_magic.common.errors import OomMagicError
from oom_magic.common.dtypes import SAFETENSORS_DTYPES as _SAFETENSORS_DTYPES
from oom_magic.checkpoints.estimate import CheckpointEstimate, estimate_checkpoint
from oom_magic.device.nvml import Nvml
from oom_magic.guard.oom import OOMMessage, is_out_of_memory, parse_oom_message
from oom_magic.fit.preflight import preflight_check, read_checkpoint_keys
from oom_magic.common.sizes import parse_size
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

MB = 1 << 20
MEMORY_LIMIT = 100 * MB
WATCHDOG_SECONDS = 5
FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                  HealthCheck.data_too_large, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------- the harness


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so that no ``except Exception`` can swallow it."""


@contextmanager
def watchdog(seconds: float = WATCHDOG_SECONDS) -> Iterator[None]:
    """Fail with Hang if the block runs longer than ``seconds`` (a hard backstop, not a timing check)."""

    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def traced() -> Iterator[None]:
    """The fuzz tests measure memory with tracemalloc, started around each input only."""
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is already on (python -X tracemalloc): the per-input peaks would be wrong")
    yield


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability-input")


def bounded(call: Callable[[], Any], seconds: float = WATCHDOG_SECONDS) -> tuple[Any, int]:
    """Run ``call`` under the watchdog; return (result or the OomMagicError, peak bytes it allocated)."""
    tracemalloc.start()  # only around the call: tracing hypothesis itself would triple the run time
    try:
        with watchdog(seconds):
            try:
                result: Any = call()
            except OomMagicError as exc:
                result = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak


def check_estimate(path: Path | str, dtype: str | None = None, seconds: float = WATCHDOG_SECONDS) -> Any:
    """An estimate or a one-line OomMagicError, under 100 MB; any other exception fails the test."""
    result, peak = bounded(lambda: estimate_checkpoint(path, dtype=dtype), seconds)
    assert peak < MEMORY_LIMIT, f"{peak / MB:.1f} MB for one input"
    if isinstance(result, OomMagicError):
        message = str(result)
        assert message and "\n" not in message and "\r" not in message and len(message) < 2000, message
    else:
        assert isinstance(result, CheckpointEstimate)
        assert result.parameters >= 0 and result.stored_bytes >= 0
        assert sum(n for _, n in result.stored_dtypes) == result.parameters
        assert result.bytes_for("bfloat16") >= 0 and result.bytes_for("nf4") >= 0
        assert result.bytes_for("int8", double_quant=True) >= 0
    return result


def safetensors_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def valid_header() -> tuple[bytes, int]:
    header = {"a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b.bias": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]},
              "__metadata__": {"format": "pt"}}
    return json.dumps(header).encode(), 24


# --------------------------------------------------------------------------- magics: bad flags, sizes, devices, names


@pytest.fixture
def one_gpu(use_nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE NVML: this machine has one GPU (cuda:0), so cuda:9 is a device it does not have."""
    use_nvml(Nvml(FakeNvml([FakeGpu()]).module))
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


LINE_ERRORS = [
    ("gpumem", "--bogus", r"unrecognized arguments: --bogus"),
    ("gpumem", "--top x", r"argument --top/-n: invalid int value: 'x'"),
    ("gpumem", "--top -1", r"--top must be 0 or more, not -1"),
    ("gpumem", "--device cuda:9", r"unknown device 'cuda:9': this machine has cuda:0, cpu"),
    ("gpumem", "--device cuda:-1", r"unknown device 'cuda:-1': this machine has cuda:0, cpu"),
    ("gpumem", "--device tpu", r"unknown device 'tpu': this machine has cuda:0, cpu"),
    ("gpumem", "--device mps", r"unknown device 'mps': this machine has cuda:0, cpu"),
    ("gpumem", "--device cuda:99999999999999999999", r"unknown device 'cuda:99999999999999999999'"),
    ("gpumem", "--device <img/src=x/onerror=alert(1)>", r"unknown device '<img/src=x/onerror=alert\(1\)>'"),
    ("gpumem", "--device", r"argument --device/-d: expected one argument"),
    ("gpumem", "--auto sometimes", r"argument --auto: invalid choice: 'sometimes'"),
    ("gpumem", "--plot /nonexistent-dir/timeline.png", r"could not save the timeline .*give a path in a folder"),
    ("gpumem", "stray words", r"unrecognized arguments: stray words"),
    ("freeall", "--bogus", r"unrecognized arguments: --bogus"),
    ("freeall", "nosuch", r"no variable named 'nosuch': nothing was deleted \(check the spelling"),
    ("freeall", "kept nosuch", r"no variable named 'nosuch': nothing was deleted"),
    ("freeall", "--device cuda:9", r"unknown device 'cuda:9': this machine has cuda:0, cpu"),
    ("freeall", "In", r"'In': IPython's own name, not a variable of yours; nothing was deleted"),
    ("freeall", "get_ipython", r"'get_ipython': IPython's own name"),
    ("freeall", "_ kept", r"'_': IPython's own name"),
]


@pytest.mark.parametrize("magic, line, message", LINE_ERRORS, ids=[f"{m} {a}" for m, a, _ in LINE_ERRORS])
def test_bad_line_magic_input_is_a_one_line_usage_error(ip, one_gpu, magic: str, line: str, message: str) -> None:
    ip.run_cell("import torch\nkept = 1", store_history=True)
    namespace = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    with pytest.raises(UsageError, match=message) as caught:
        ip.run_line_magic(magic, line)
    assert "\n" not in str(caught.value)
    after = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    assert after == namespace  # a refused command changed nothing


CELL_ERRORS = [
    ("--headroom 10XB", r"cannot read headroom '10XB': write a size such as 512MiB or 2GiB, or a percentage"),
    ("--headroom 150%", r"cannot read headroom '150%': write a percentage from 0% to 99%"),
    ("--headroom nan%", r"cannot read headroom 'nan%'"),
    ("--headroom " + "9" * 400 + "TiB", r"cannot read headroom '9{40}"),
    ("--retry -1", r"--retry must be 0 or more, not -1"),
    ("--retry x", r"argument --retry: invalid int value: 'x'"),
    ("--device cuda:9", r"unknown device 'cuda:9': this machine has cuda:0, cpu"),
    ("--device tpu", r"unknown device 'tpu'"),
    ("--bogus", r"unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("line, message", CELL_ERRORS, ids=[c[0][:30] for c in CELL_ERRORS])
def test_bad_guardload_input_is_a_one_line_usage_error_and_the_cell_never_runs(ip, one_gpu, line: str,
                                                                                message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        ip.run_cell_magic("guardload", line, "ran = True\n")
    assert "\n" not in str(caught.value)
    assert "ran" not in ip.user_ns


def test_an_empty_guarded_cell_is_a_usage_error(ip) -> None:
    with pytest.raises(UsageError, match="needs a cell body"):
        ip.run_cell_magic("guardload", "", "   \n")


@pytest.mark.parametrize("magic", ["gpumem", "freeall", "guardload"])
def test_an_unclosed_quote_is_a_usage_error(ip, magic: str) -> None:
    """Finding 6 (fixed in magics.py): shlex's ValueError('No closing quotation') was a traceback."""
    with pytest.raises(UsageError, match="No closing quotation.*close the quote") as caught:
        if magic == "guardload":
            ip.run_cell_magic(magic, '--device "cuda', "ran = True\n")
        else:
            ip.run_line_magic(magic, '--device "cuda')
    assert "\n" not in str(caught.value) and "ran" not in ip.user_ns


@pytest.mark.parametrize("text, message", [
    ("9" * 400 + "TiB", r"is larger than any device \(16 EiB\)"),
    ("1" * 30 + "GiB", r"is larger than any device"),
    ("16XB", r"cannot read size '16XB'"),
    ("\u0661\u0662GiB", r"cannot read size"),  # Arabic-Indic digits are not a size
    ("", r"cannot read size ''"),
    ("x" * 10_000, r"cannot read size 'x{40}\.\.\.'"),  # quoted short, on one line
])
def test_parse_size_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(OomMagicError, match=message) as caught:
        parse_size(text)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_estimate_checkpoint_refuses_what_is_not_a_path(traced, scratch: Path) -> None:
    class BadPath:
        def __fspath__(self) -> str:
            raise RuntimeError("hostile __fspath__")

    for value in (123, None, 1.5, ["a"], BadPath(), "", "   ", "a" * 5000, "~no-such-user-xyz/m",
                  "bad\nname", "\x00", "/tmp/\udcff", b"\xff\xfe", str(scratch / "missing\r\nfile.safetensors")):
        result = check_estimate(value)  # type: ignore[arg-type]
        assert isinstance(result, OomMagicError), value
    for dtype in ("float17", "", "\x00", "torch.float33", "nf5"):
        folder = scratch / "dtype-checks"
        folder.mkdir(exist_ok=True)
        header, size = valid_header()
        safetensors_file(folder / "model.safetensors", header, bytes(size))
        result = check_estimate(folder, dtype=dtype)
        assert isinstance(result, OomMagicError) and "unknown dtype" in str(result)


# --------------------------------------------------------------------------- safetensors: header lengths


@settings(max_examples=600, **FUZZ)
@given(
    length=st.one_of(st.integers(0, 2**64 - 1), st.integers(-24, 24).map(lambda d: ("relative", d)),
                     st.sampled_from([0, 1, 2, 7, 8, 2**31, 2**32, 2**63, 2**64 - 1, 100_000_000, 100_000_001,
                                      4 * MB, 4 * MB + 1])),
    body=st.sampled_from(["valid", "empty", "array", "padded", "cut"]),
)
def test_fuzz_header_lengths_that_lie(traced, scratch: Path, length: Any, body: str) -> None:
    header, size = valid_header()
    data = bytes(size)
    if body == "empty":
        header, data = b"", b""
    elif body == "array":
        header = b"[1, 2, 3]"
    elif body == "padded":
        header = header + b" " * 64
    elif body == "cut":
        data = data[:5]
    if isinstance(length, tuple):
        length = max(len(header) + length[1], 0)
    path = safetensors_file(scratch / "lengths.safetensors", header, data, length)
    check_estimate(path)


# --------------------------------------------------------------------------- safetensors: offsets and entries

_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F4",
           "F6_E2M3", "C64", "U64"]
_odd_number = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                        st.none(), st.text(max_size=3))


@st.composite
def entries(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header whose entries tile, overlap, leave gaps, run past the end or carry odd values."""
    count = draw(st.integers(1, 6))
    items: list[tuple[str, object]] = []
    cursor = 0
    for i in range(count):
        name = draw(st.one_of(st.just(f"layer.{i}.weight"), st.text(max_size=12)))
        dtype = draw(st.one_of(st.sampled_from(_DTYPES), st.text(max_size=6)))
        shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=3),
                               st.lists(st.one_of(st.integers(-(2**40), 2**66), _odd_number), max_size=4),
                               _odd_number))
        elements = 1
        if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape):
            for d in shape:
                elements *= d
        nbytes = elements * 4 if elements < 2**20 else 4
        mode = draw(st.sampled_from(["tile", "tile", "overlap", "gap", "past-end", "reversed", "odd", "huge", "short"]))
        if mode == "tile":
            offsets: object = [cursor, cursor + nbytes]
        elif mode == "overlap":
            offsets = [max(cursor - draw(st.integers(1, 8)), 0), max(cursor - 1, 0) + nbytes]
        elif mode == "gap":
            offsets = [cursor + draw(st.integers(1, 8)), cursor + 8 + nbytes]
        elif mode == "past-end":
            offsets = [cursor, cursor + nbytes + draw(st.integers(1, 2**64))]
        elif mode == "reversed":
            offsets = [cursor + nbytes, cursor]
        elif mode == "huge":
            offsets = [draw(st.integers(2**63, 2**80)), draw(st.integers(2**63, 2**80))]
        elif mode == "short":
            offsets = draw(st.lists(st.integers(0, 64), max_size=3))
        else:
            offsets = draw(st.one_of(st.lists(_odd_number, max_size=3), _odd_number))
        if isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets):
            cursor = max(cursor, offsets[1] if offsets[1] < 2**40 else cursor)
        entry: dict[str, object] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if draw(st.booleans()) and draw(st.booleans()):
            entry = draw(st.one_of(st.just({}), st.dictionaries(st.text(max_size=4), _odd_number, max_size=3)))
        items.append((name, entry))
    if draw(st.booleans()):
        items.append(("__metadata__", draw(st.one_of(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
                                                     _odd_number, st.dictionaries(st.text(max_size=3), _odd_number,
                                                                                  max_size=2)))))
    if draw(st.booleans()) and items:
        items.append(draw(st.sampled_from(items)))  # a key named twice
    body = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in items) + "}"
    data = cursor + draw(st.integers(-4, 4))
    return body.encode(), max(data, 0)


@settings(max_examples=700, **FUZZ)
@given(header=entries())
def test_fuzz_offsets_out_of_range_or_overlapping(traced, scratch: Path, header: tuple[bytes, int]) -> None:
    body, data = header
    path = safetensors_file(scratch / "offsets.safetensors", body, bytes(min(data, 1 << 16)))
    check_estimate(path)


# --------------------------------------------------------------------------- safetensors: not UTF-8, unknown dtypes

_BAD_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc3",
             b"\xf8\x88\x80\x80\x80", b"\xf4\x90\x80\x80", b"\x00", b"\xef\xbb\xbf"]


@settings(max_examples=500, **FUZZ)
@given(
    inserts=st.lists(st.tuples(st.integers(0, 200), st.sampled_from(_BAD_UTF8)), min_size=1, max_size=4),
    raw=st.one_of(st.none(), st.binary(max_size=300)),
)
def test_fuzz_headers_that_are_not_utf8(traced, scratch: Path, inserts: list, raw: bytes | None) -> None:
    header, size = valid_header()
    body = bytearray(header if raw is None else raw)
    for at, bad in inserts:
        body[at % (len(body) + 1):at % (len(body) + 1)] = bad
    path = safetensors_file(scratch / "utf8.safetensors", bytes(body), bytes(size))
    result = check_estimate(path)
    try:
        bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(result, OomMagicError) and "not UTF-8" in str(result)


@settings(max_examples=250, **FUZZ)
@given(dtype=st.one_of(st.text(max_size=12),
                       st.sampled_from(["f32", "F33", "BF8", "F8_E4M3FN", "U128", "I4", "bool", "C128", " F32",
                                        "F32 ", "float32", "F16\x00", "\u004632"])))
def test_fuzz_unknown_safetensors_dtypes(traced, scratch: Path, dtype: str) -> None:
    header = json.dumps({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}).encode()
    result = check_estimate(safetensors_file(scratch / "dtype.safetensors", header, bytes(8)))
    if dtype not in _SAFETENSORS_DTYPES:
        assert isinstance(result, OomMagicError) and "unknown dtype" in str(result)


# --------------------------------------------------------------------------- torch.save zips and their pickles


def op(code: str, arg: object = None) -> bytes:
    """Encode one pickle opcode (protocol 2-5 forms) with its argument."""
    if code == "BININT":
        return b"J" + struct.pack("<i", arg)
    if code == "BININT1":
        return b"K" + bytes([arg])
    if code == "LONG1":
        raw = int(arg).to_bytes((int(arg).bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if code == "SHORT_BINUNICODE":
        raw = str(arg).encode("utf-8", "surrogatepass")[:255]
        return b"\x8c" + bytes([len(raw)]) + raw
    if code == "BINUNICODE":
        raw = str(arg).encode("utf-8", "surrogatepass")
        return b"X" + struct.pack("<I", len(raw)) + raw
    if code == "SHORT_BINBYTES":
        return b"C" + bytes([len(arg)]) + bytes(arg)
    if code == "GLOBAL":
        module, name = arg
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    if code == "INST":
        module, name = arg
        return b"i" + module.encode() + b"\n" + name.encode() + b"\n"
    if code == "BINPUT":
        return b"q" + bytes([arg])
    if code == "LONG_BINPUT":
        return b"r" + struct.pack("<I", arg)
    if code == "BINGET":
        return b"h" + bytes([arg])
    if code == "PERSID":
        return b"P" + str(arg).encode("ascii", "replace") + b"\n"
    if code == "PROTO":
        return b"\x80" + bytes([arg])
    if code == "FRAME":
        return b"\x95" + struct.pack("<Q", arg)
    if code == "EXT1":
        return b"\x82" + bytes([arg])
    if code == "BINFLOAT":
        return b"G" + struct.pack(">d", arg)
    simple = {"STACK_GLOBAL": b"\x93", "REDUCE": b"R", "BUILD": b"b", "NEWOBJ": b"\x81", "NEWOBJ_EX": b"\x92",
              "OBJ": b"o", "MARK": b"(", "TUPLE": b"t", "TUPLE1": b"\x85", "TUPLE2": b"\x86", "TUPLE3": b"\x87",
              "EMPTY_TUPLE": b")", "EMPTY_DICT": b"}", "EMPTY_LIST": b"]", "EMPTY_SET": b"\x8f", "APPEND": b"a",
              "APPENDS": b"e", "SETITEM": b"s", "SETITEMS": b"u", "ADDITEMS": b"\x90", "FROZENSET": b"\x91",
              "DICT": b"d", "LIST": b"l", "POP": b"0", "DUP": b"2", "POP_MARK": b"1", "MEMOIZE": b"\x94",
              "NONE": b"N", "NEWTRUE": b"\x88", "NEWFALSE": b"\x89", "BINPERSID": b"Q", "STOP": b"."}
    return simple[code]


def payload_ops(marker: Path) -> list[bytes]:
    """builtins.open(marker, 'w'): creates the marker file if anything ever unpickles it."""
    return [op("GLOBAL", ("builtins", "open")), op("SHORT_BINUNICODE", str(marker)), op("SHORT_BINUNICODE", "w"),
            op("TUPLE2"), op("REDUCE")]


def torch_like_pickle(tensors: list[tuple[str, str, str, int, tuple[int, ...], str | None]],
                      extra: list[bytes] = ()) -> bytes:
    """data.pkl as torch.save writes it: {name: _rebuild_tensor_v2/v3(storage, 0, shape, stride, ...)}.

    Each tensor: (name, storage class, storage key, numel, shape, v3 dtype or None).
    """
    out = [op("PROTO", 2), op("EMPTY_DICT"), op("MARK")]
    for name, storage_class, key, numel, shape, v3_dtype in tensors:
        rebuild = "_rebuild_tensor_v3" if v3_dtype else "_rebuild_tensor_v2"
        out += [op("SHORT_BINUNICODE", name), op("GLOBAL", ("torch._utils", rebuild)), op("MARK"),
                op("MARK"), op("SHORT_BINUNICODE", "storage"),
                op("GLOBAL", ("torch." + storage_class.rsplit(".", 1)[0] if "." in storage_class else "torch",
                              storage_class.rsplit(".", 1)[-1])),
                op("SHORT_BINUNICODE", key), op("SHORT_BINUNICODE", "cpu"), op("LONG1", numel), op("TUPLE"),
                op("BINPERSID"), op("BININT1", 0), op("MARK")]
        out += [op("LONG1", d) for d in shape] + [op("TUPLE"), op("MARK")]
        out += [op("BININT1", 1) for _ in shape] + [op("TUPLE"), op("NEWFALSE"),
                                                     op("GLOBAL", ("collections", "OrderedDict")),
                                                     op("EMPTY_TUPLE"), op("REDUCE")]
        if v3_dtype:
            out += [op("GLOBAL", ("torch", v3_dtype))]
        out += [op("TUPLE"), op("REDUCE")]
    out += [op("SETITEMS")] + list(extra) + [op("STOP")]
    return b"".join(out)


def torch_zip(path: Path, pickle_bytes: bytes, members: dict[str, bytes], *, compress: int = zipfile.ZIP_STORED,
              prefix: str = "archive") -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(zipfile.ZipInfo(f"{prefix}/data.pkl"), pickle_bytes, compress_type=compress)
        archive.writestr(f"{prefix}/byteorder", b"little")
        for key, data in members.items():
            archive.writestr(f"{prefix}/data/{key}", data)
        archive.writestr(f"{prefix}/version", b"3\n")
    return path


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("markers")


def test_the_payload_really_runs_code_when_unpickled(marker_dir: Path) -> None:
    """Control: the payload the fuzz embeds creates its marker when pickle.loads runs it."""
    control = marker_dir / "control-marker"
    data = b"".join([op("PROTO", 2)] + payload_ops(control) + [op("STOP")])
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                          input=data, check=False, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert control.exists()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_real_torch_save_with_a_code_running_object_is_sized_and_never_run(traced, scratch: Path,
                                                                          marker_dir: Path) -> None:
    import torch

    marker = marker_dir / "torch-save-marker"
    path = scratch / "evil.pt"
    torch.save({"w.weight": torch.zeros(8, 8), "evil": _Evil(marker)}, path)
    assert b"open" in zipfile.ZipFile(path).read("evil/data.pkl")  # the payload is in there
    result = check_estimate(path)
    assert isinstance(result, CheckpointEstimate) and result.parameters == 64 and result.stored_bytes == 256
    keys = read_checkpoint_keys(path)
    assert keys is not None and [k for k, _ in keys.keys] == ["w.weight", "evil"]
    check = preflight_check(f"import torch\nsd = torch.load({str(path)!r}, weights_only=False)\n", {})
    assert check.checks and check.checks[0].need is not None
    legacy = scratch / "legacy.bin"
    legacy.write_bytes(pickle.dumps(_Evil(marker), protocol=2))
    assert "legacy pickle" in str(check_estimate(legacy))
    assert not marker.exists()


_GLOBALS = st.sampled_from([("builtins", "open"), ("builtins", "eval"), ("builtins", "exec"), ("os", "system"),
                            ("posix", "system"), ("subprocess", "Popen"), ("torch._utils", "_rebuild_tensor_v2"),
                            ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
                            ("torch", "FloatStorage"), ("torch", "BFloat16Storage"), ("torch.storage", "UntypedStorage"),
                            ("collections", "OrderedDict"), ("torch", "bfloat16"), ("torch", "float8_e4m3fn"),
                            ("__main__", "Anything"), ("", ""), ("a b", "c\x00")])
_OPS = st.one_of(
    st.sampled_from(["STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX", "OBJ", "MARK", "TUPLE", "TUPLE1",
                     "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "APPEND", "APPENDS",
                     "SETITEM", "SETITEMS", "ADDITEMS", "FROZENSET", "DICT", "LIST", "POP", "DUP", "POP_MARK",
                     "MEMOIZE", "NONE", "NEWTRUE", "NEWFALSE", "BINPERSID"]).map(lambda c: op(c)),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: op("BININT", n)),
    st.integers(-(2**200), 2**200).map(lambda n: op("LONG1", n)),
    st.sampled_from(["storage", "0", "1", "cpu", "cuda:0", "w.weight", "x"]).map(lambda s: op("SHORT_BINUNICODE", s)),
    st.text(max_size=20).map(lambda s: op("SHORT_BINUNICODE", s)),
    _GLOBALS.map(lambda g: op("GLOBAL", g)),
    _GLOBALS.map(lambda g: op("INST", g)),
    st.integers(0, 255).map(lambda n: op("BINPUT", n)),
    st.integers(0, 255).map(lambda n: op("BINGET", n)),
    st.integers(0, 2**32 - 1).map(lambda n: op("LONG_BINPUT", n)),
    st.text(max_size=10).map(lambda s: op("PERSID", s)),
    st.integers(0, 255).map(lambda n: op("PROTO", n)),
    st.integers(0, 2**64 - 1).map(lambda n: op("FRAME", n)),
    st.integers(0, 255).map(lambda n: op("EXT1", n)),
    st.floats(allow_nan=True).map(lambda f: op("BINFLOAT", f)),
    st.binary(max_size=8).map(lambda b: op("SHORT_BINBYTES", b)),
    st.binary(min_size=1, max_size=4),  # raw garbage between opcodes
)


@settings(max_examples=700, **FUZZ)
@given(ops=st.lists(_OPS, max_size=40), wrap=st.sampled_from(["random", "inside-torch", "payload-first"]),
       members=st.lists(st.tuples(st.sampled_from(["0", "1", "x", "0/0"]), st.integers(0, 64)), max_size=3))
def test_fuzz_pickle_opcode_streams_are_walked_never_run(traced, scratch: Path, marker_dir: Path, ops: list,
                                                         wrap: str, members: list) -> None:
    marker = marker_dir / "fuzz-marker"
    body = b"".join(ops)
    if wrap == "inside-torch":
        data = torch_like_pickle([("w.weight", "FloatStorage", "0", 4, (2, 2), None)],
                                 extra=[body] + payload_ops(marker) + [op("POP")])
    elif wrap == "payload-first":
        data = b"".join([op("PROTO", 2)] + payload_ops(marker)) + body + op("STOP")
    else:
        data = op("PROTO", 2) + body + op("STOP")
    path = torch_zip(scratch / "fuzz.pt", data, {"0": bytes(16), **{k: bytes(n) for k, n in members}})
    check_estimate(path)
    result, peak = bounded(lambda: read_checkpoint_keys(path))  # stored data.pkl: preflight's walker too
    assert peak < MEMORY_LIMIT
    assert result is None or isinstance(result, OomMagicError) or hasattr(result, "keys")
    assert not marker.exists()


_STORAGES = ["FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "ByteStorage", "BoolStorage",
             "QInt8Storage", "ComplexFloatStorage", "storage.UntypedStorage", "NoSuchStorage", "Storage", ""]
_V3 = [None, "float32", "bfloat16", "float8_e4m3fn", "uint16", "float4_e2m1fn_x2", "no_such_dtype", "int1"]


@settings(max_examples=400, **FUZZ)
@given(tensors=st.lists(st.tuples(st.text(max_size=10), st.sampled_from(_STORAGES), st.sampled_from(["0", "1", "2"]),
                                  st.integers(0, 2**40), st.lists(st.integers(0, 2**33), max_size=3),
                                  st.sampled_from(_V3)), min_size=1, max_size=4),
       sizes=st.lists(st.integers(0, 64), min_size=3, max_size=3),
       dtype=st.sampled_from([None, "bfloat16", "nf4", "int8", "auto"]))
def test_fuzz_torch_zips_with_unknown_dtypes_and_lying_sizes(traced, scratch: Path, tensors: list, sizes: list,
                                                             dtype: str | None) -> None:
    members = {key: bytes(n) for key, n in zip(["0", "1", "2"], sizes)}
    path = torch_zip(scratch / "storages.pt", torch_like_pickle([tuple(t) for t in tensors]), members)
    check_estimate(path, dtype=dtype)


# --------------------------------------------------------------------------- zip structure and zip bombs


@st.composite
def zips(draw: st.DrawFn) -> bytes:
    """A zip with random member names and compression, then its directory patched to lie."""
    buffer = io.BytesIO()
    pkl = torch_like_pickle([("w.weight", "FloatStorage", "0", 4, (2, 2), None)])
    names = draw(st.lists(st.sampled_from(["archive/data.pkl", "other/data.pkl", "data.pkl", "a/b/data.pkl",
                                           "archive/data/0", "archive/data/1", "archive/data/0/x", "archive/version",
                                           "../archive/data/0", "/abs/data.pkl", "archive\\data\\0"]),
                          min_size=1, max_size=6))
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            method = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                                           zipfile.ZIP_LZMA]))
            data = pkl if name.endswith("data.pkl") else bytes(draw(st.sampled_from([0, 16, 100])))
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            archive.writestr(info, data)
    raw = bytearray(buffer.getvalue())
    for _ in range(draw(st.integers(0, 3))):
        patch = draw(st.sampled_from(["claim-size", "claim-count", "claim-dir", "zip64", "cut", "byte"]))
        central = raw.find(b"PK\x01\x02")
        end = raw.rfind(b"PK\x05\x06")
        if patch == "claim-size" and central >= 0:  # a zip-bomb claim: gigabytes uncompressed
            raw[central + 24:central + 28] = struct.pack("<I", draw(st.sampled_from([2**32 - 1, 2**31, 10**9])))
        elif patch == "claim-count" and end >= 0:
            count = draw(st.integers(0, 0xFFFF))
            raw[end + 8:end + 12] = struct.pack("<HH", count, count)
        elif patch == "claim-dir" and end >= 0:
            raw[end + 12:end + 20] = struct.pack("<II", draw(st.integers(0, 2**32 - 1)),
                                                 draw(st.integers(0, 2**32 - 1)))
        elif patch == "zip64" and end >= 0:
            locator = b"PK\x06\x07" + struct.pack("<IQI", 0, draw(st.integers(0, 2**64 - 1)), 1)
            raw[end:end] = locator
        elif patch == "cut":
            del raw[draw(st.integers(0, len(raw))):]
        elif raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


@settings(max_examples=400, **FUZZ)
@given(data=zips())
def test_fuzz_zip_structures(traced, scratch: Path, data: bytes) -> None:
    path = scratch / "zips.bin"
    path.write_bytes(data)
    check_estimate(path)


def test_zip_bombs_are_never_decompressed(traced, scratch: Path) -> None:
    # Storages that inflate to 4 GiB in all: sized from the directory, never inflated.
    path = scratch / "bomb.pt"
    zeros = bytes(8 * MB)
    pkl = torch_like_pickle([(f"w{i}.weight", "ByteStorage", str(i), 8 * MB, (8 * MB,), None) for i in range(64)])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.writestr(zipfile.ZipInfo("archive/data.pkl"), pkl)  # stored, as torch.save writes it
        for i in range(64):
            archive.writestr(f"archive/data/{i}", zeros)
    assert path.stat().st_size < 4 * MB  # 512 MiB of storages in a few MiB
    result = check_estimate(path)
    assert isinstance(result, CheckpointEstimate) and result.stored_bytes == 64 * 8 * MB
    # data.pkl itself deflated: inflated (bounded) and walked, as torch.load reads it.
    squeezed = torch_zip(scratch / "squeezed.pt", pkl, {}, compress=zipfile.ZIP_DEFLATED)
    assert "data.pkl names storage '0' but the zip has no data/0" in str(check_estimate(squeezed))
    # ... and one that claims to inflate past what is walked: sized from the directory, not inflated.
    swollen = torch_zip(scratch / "swollen.pt", pkl + bytes(60 * MB), {}, compress=zipfile.ZIP_DEFLATED)
    assert swollen.stat().st_size < MB
    assert isinstance(check_estimate(swollen), CheckpointEstimate)


def _damaged_compressed_pickle(path: Path, method: int) -> Path:
    """A zip whose data.pkl is compressed (torch.save never does that) and then damaged."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo("archive/data.pkl"),
                         torch_like_pickle([("w.weight", "FloatStorage", "0", 4, (2, 2), None)]), compress_type=method)
        archive.writestr("archive/data/0", bytes(16))
    raw = bytearray(buffer.getvalue())
    start = raw.find(b"archive/data.pkl") + len("archive/data.pkl")
    for at in range(start + 4, start + 40):
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))
    return path


def _keys_error(path: Path) -> str:
    """read_checkpoint_keys on ``path``: its one-line OomMagicError, within 100 MB (fails otherwise)."""
    result, peak = bounded(lambda: read_checkpoint_keys(path))
    assert peak < MEMORY_LIMIT, f"{peak / MB:.1f} MB"
    assert isinstance(result, OomMagicError), result
    message = str(result)
    assert message.startswith(path.name + ": ") and "\n" not in message and len(message) < 400, message
    return message


def _lying_deflated_pickle(path: Path, claim: int) -> Path:
    """A zip whose deflated data.pkl inflates to 60 MiB while its directory claims ``claim`` bytes."""
    pkl = torch_like_pickle([("w.weight", "FloatStorage", "0", 4, (2, 2), None)])
    raw = bytearray(torch_zip(path, pkl + bytes(60 * MB), {"0": bytes(16)}, compress=zipfile.ZIP_DEFLATED).read_bytes())
    central = raw.find(b"PK\x01\x02")
    assert raw[central + 46:central + 62] == b"archive/data.pkl"
    raw[central + 24:central + 28] = struct.pack("<I", claim)  # uncompressed size, as zipfile reads it
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_LZMA, zipfile.ZIP_BZIP2],
                         ids=["deflate", "lzma", "bzip2"])
def test_preflight_reads_keys_of_damaged_or_swollen_zips_safely(traced, scratch: Path, method: int) -> None:
    """Finding 8 (fixed in checkpoints.py): a compressed data.pkl is inflated a chunk at a time up to 8 MiB
    (deflate, which torch.load reads) or refused (LZMA, bzip2); a damaged stream is a one-line error."""
    damaged = _damaged_compressed_pickle(scratch / f"damaged-{method}.pt", method)
    assert isinstance(check_estimate(damaged), OomMagicError)  # the estimator refuses it
    pkl = torch_like_pickle([("w.weight", "FloatStorage", "0", 4, (2, 2), None)])
    swollen = torch_zip(scratch / f"swollen-keys-{method}.pt", pkl + bytes(60 * MB), {}, compress=method)
    assert swollen.stat().st_size < MB
    if method == zipfile.ZIP_DEFLATED:
        assert "damaged zip archive (" in _keys_error(damaged)  # zlib.error or a bad CRC, never escaping
        assert "data.pkl is compressed past 8 MiB" in _keys_error(swollen)
        for claim in (1000, 8 * MB):  # the directory lies: never more than it claims is inflated
            assert "damaged zip archive (" in _keys_error(_lying_deflated_pickle(scratch / f"lying-{claim}.pt", claim))
    else:
        name = "LZMA" if method == zipfile.ZIP_LZMA else "bzip2"
        for path in (damaged, swollen):
            assert f"data.pkl is compressed with {name}, which torch.load cannot read" in _keys_error(path)


# --------------------------------------------------------------------------- JSON: deep, wide, huge


@settings(max_examples=100, **FUZZ)
@given(depth=st.integers(1, 50_000), kind=st.sampled_from(["[", "{\"a\":"]), width=st.integers(0, 20_000),
       filler=st.sampled_from([b"0", b"{}", b"[]", b'"x"', b"1e999", b"-0.0", b"null"]))
def test_fuzz_deep_and_wide_json(traced, scratch: Path, depth: int, kind: str, width: int, filler: bytes) -> None:
    closer = "]" if kind == "[" else "}"
    deep = (kind * depth + "0" + closer * depth).encode()
    wide = b"[" + b",".join([filler] * width) + b"]"
    body = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"deep":' + deep + b',"wide":' + wide + b"}}"
    result = check_estimate(safetensors_file(scratch / "json.safetensors", body, bytes(4)))
    assert isinstance(result, OomMagicError)  # __metadata__ must map strings to strings


def _huge_headers() -> dict[str, bytes]:
    entry = '"model.layers.{i}.mlp.up_proj.weight":{{"dtype":"BF16","shape":[1],"data_offsets":[{a},{b}]}}'
    many = "{" + ",".join(entry.format(i=i, a=2 * i, b=2 * i + 2) for i in range(30_000)) + "}"
    return {
        "deep-arrays": b"[" * 200_000 + b"]" * 200_000,
        "deep-objects": b'{"a":' * 100_000 + b"0" + b"}" * 100_000,
        "empty-dicts-3MiB": b"[" + b",".join([b"{}"] * (1 << 20)) + b"]",
        "empty-lists-4MiB": b"[" + b",".join([b"[]"] * 1_390_000) + b"]",
        "one-string-60MiB": b'{"__metadata__":{"k":"' + b"x" * (60 * MB) + b'"}}',
        "digits": b'{"w":{"dtype":"F32","shape":[' + b"9" * 4000 + b'],"data_offsets":[0,4]}}',
        "too-many-digits": b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}',
        "30k-tensors": many.encode(),
        "keys-named-twice": b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},' * 1 + b'"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    }


@pytest.mark.parametrize("name", list(_huge_headers()))
def test_huge_and_deep_headers_stay_within_memory(traced, scratch: Path, name: str) -> None:
    body = _huge_headers()[name]
    data = 60_000 if name == "30k-tensors" else 4
    result = check_estimate(safetensors_file(scratch / f"{name}.safetensors", body, bytes(data)), seconds=30)
    if name == "30k-tensors":
        assert isinstance(result, CheckpointEstimate) and result.parameters == 30_000
    elif name == "digits":
        assert isinstance(result, OomMagicError) and "over 2**64 elements" in str(result)
    else:
        assert isinstance(result, OomMagicError)


def long_binputs(count: int) -> bytes:
    """``op("LONG_BINPUT", i) for i in range(count)``, joined: the same bytes without a Python call per
    opcode (a bomb holds millions; building them one op() at a time cost seconds of every run)."""
    index = array.array("I", range(count))  # 4-byte unsigned, as "<I" packs it
    if sys.byteorder == "big":
        index.byteswap()
    raw, out = index.tobytes(), bytearray(5 * count)
    out[0::5] = b"r" * count
    for byte in range(4):
        out[1 + byte::5] = raw[byte::4]
    return bytes(out)


def numbered_strings(count: int) -> bytes:
    """``op("SHORT_BINUNICODE", f"{i:04}") for i in range(count)``, joined: the same bytes, built one digit
    width at a time (4 digits below 10,000, then the number itself) without a Python call per opcode."""
    parts, width, start = [], 4, 0
    while start < count:
        end = min(count, 10**width)
        head = "\x8c" + chr(width)
        numbers = map("{:04}".format, range(start, end)) if width == 4 else map(str, range(start, end))
        parts.append(head + head.join(numbers))
        start, width = end, width + 1
    return "".join(parts).encode("latin-1")  # digits and two bytes below 256: one byte per character


def test_the_bomb_builders_write_what_op_writes() -> None:
    """The fast builders above are byte for byte the op() sequences they stand for (across digit widths)."""
    count = 100_003
    assert numbered_strings(count) == b"".join(op("SHORT_BINUNICODE", f"{i:04}") for i in range(count))
    assert long_binputs(count) == b"".join(op("LONG_BINPUT", i) for i in range(count))


_BOMBS = {
    "memoize": lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + op("MEMOIZE") * (15 * MB) + op("STOP"),
    "binput": lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + long_binputs(3 * MB) + op("STOP"),
    "empty-lists": lambda: op("PROTO", 2) + op("EMPTY_LIST") * (15 * MB) + op("STOP"),
    "nested-tuples": lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + op("TUPLE1") * (15 * MB) + op("STOP"),
    "strings": lambda: op("PROTO", 2) + numbered_strings(1_800_000) + op("STOP"),
}
_MEASURE_BOMBS = r"""
import json, sys
from oom_magic.checkpoints.estimate import estimate_checkpoint
from oom_magic.common.errors import OomMagicError
from oom_magic.fit.preflight import read_checkpoint_keys

def status(field):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))

out = {}
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # reset the resident high-water mark (VmHWM): the imports' peak is not ours
base = status("VmRSS")
for path in sys.argv[2:]:
    if sys.argv[1] == "keys":
        try:
            keys = read_checkpoint_keys(path)
            out[path] = None if keys is None else [list(k) for k in keys.keys]
        except OomMagicError as exc:
            out[path] = "error: " + str(exc)
    else:
        est = estimate_checkpoint(path)
        out[path] = [est.stored_bytes, est.parameters]
out["peak"] = status("VmHWM") - base
print("RESULT " + json.dumps(out))
"""


def _measure(mode: str, paths: list[Path]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", _MEASURE_BOMBS, mode, *map(str, paths)],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def bombs(scratch: Path) -> dict[str, Any]:
    """Pickle bombs (up to 15 MiB of data.pkl) sized in a fresh process; its peak resident memory read.

    Measured by the process's peak RSS (Linux VmHWM, reset first) rather than tracemalloc: tracing 250,000 opcodes' objects
    per bomb would cost seconds each, and a peak RSS bound is the stricter (it counts everything).
    """
    paths = [torch_zip(scratch / f"bomb-{name}.pt", make(), {"0": bytes(16)}) for name, make in _BOMBS.items()]
    result = _measure("estimate", paths)
    result["paths"] = [str(p) for p in paths]
    return result


def test_pickle_bombs_are_sized_within_memory(bombs: dict[str, Any]) -> None:
    for path in bombs["paths"]:
        # Too big to walk: the sizes from the zip directory stay exact, the dtype is unknown.
        assert bombs[path] == [16, 4], path
    assert bombs["peak"] < MEMORY_LIMIT


def _shared_list_under_every_key(items: int, keys: int) -> bytes:
    """A dict whose every value is one memoized list: walking each key's objects anew is quadratic."""
    shared = op("EMPTY_LIST") + op("BINPUT", 0) + op("MARK") + op("EMPTY_TUPLE") * items + op("APPENDS") + op("POP")
    pairs = b"".join(op("SHORT_BINUNICODE", f"k{i}") + op("BINGET", 0) for i in range(keys))
    return op("PROTO", 2) + shared + op("EMPTY_DICT") + op("MARK") + pairs + op("SETITEMS") + op("STOP")


_KEYS_BOMBS = {  # name: (data.pkl, what read_checkpoint_keys says); built when a test asks, not at collection
    "empty-lists": (lambda: op("PROTO", 2) + op("EMPTY_LIST") * 800_000 + op("STOP"), "holds over 600,000 pickle opcodes"),
    "dups": (lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + op("DUP") * 2_000_000 + op("STOP"),
             "holds over 600,000 pickle opcodes"),
    "memoize": (lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + op("MEMOIZE") * 1_000_000 + op("STOP"), "builds over 48 MiB"),
    "binput": (lambda: op("PROTO", 2) + op("EMPTY_TUPLE") + long_binputs(1_000_000) + op("STOP"), "builds over 48 MiB"),
    "shared-list": (lambda: _shared_list_under_every_key(200_000, 300), "links over 2,000,000 objects under its keys"),
    "strings-15MiB": (_BOMBS["strings"], "data.pkl is over 8 MiB, past what oom-magic reads"),
    "memoize-15MiB": (_BOMBS["memoize"], "data.pkl is over 8 MiB, past what oom-magic reads"),
}


def test_preflight_reads_keys_of_a_pickle_bomb_within_memory(scratch: Path) -> None:
    """Finding 7 (fixed in checkpoints.py): the walk of data.pkl stops at fixed counts (600,000 opcodes,
    48 MiB of estimated objects, 2,000,000 links followed under the keys, 8 MiB of data.pkl), so every
    bomb is a one-line error within 100 MB; the message names the count that stopped it.

    Measured by peak RSS in a fresh process, as test_pickle_bombs_are_sized_within_memory does.
    """
    paths = {name: torch_zip(scratch / f"keys-bomb-{name}.pt", make(), {"0": bytes(16)})
             for name, (make, _) in _KEYS_BOMBS.items()}
    # Two 2 MiB memoized strings joined by STACK_GLOBAL 100,000 times: never copied, so it walks.
    names = op("BINUNICODE", "m" * (2 * MB)) + op("BINPUT", 0) + op("BINUNICODE", "q" * (2 * MB)) + op("BINPUT", 1)
    joins = (op("BINGET", 0) + op("BINGET", 1) + op("STACK_GLOBAL") + op("POP")) * 100_000
    joined = torch_zip(scratch / "keys-bomb-joined.pt", op("PROTO", 2) + names + joins + op("EMPTY_DICT") + op("STOP"),
                       {"0": bytes(16)})
    result = _measure("keys", [*paths.values(), joined])
    for name, path in paths.items():
        message = result[str(path)]
        assert message.startswith(f"error: {path.name}: ") and _KEYS_BOMBS[name][1] in message, message
        assert "\n" not in message
    assert result[str(joined)] == []  # a dict with no keys, read
    assert result["peak"] < MEMORY_LIMIT


def test_preflight_reads_keys_of_a_memo_bomb_within_traced_memory(traced, scratch: Path) -> None:
    """Finding 7 (fixed in checkpoints.py): the costliest objects per opcode (memo entries) stop at the 48 MiB
    estimate, measured here by tracemalloc's peak in this process."""
    bomb = torch_zip(scratch / "keys-memo-bomb.pt", _KEYS_BOMBS["memoize"][0](), {"0": bytes(16)})
    result, peak = bounded(lambda: read_checkpoint_keys(bomb), seconds=60)  # tracing slows the walk ~5x
    assert isinstance(result, OomMagicError) and "builds over 48 MiB of objects" in str(result)
    assert peak < MEMORY_LIMIT, f"{peak / MB:.1f} MB"


# --------------------------------------------------------------------------- shard indexes and configs

_SHARD_NAMES = st.one_of(st.sampled_from(["model-1.safetensors", "model-2.safetensors", "../model-1.safetensors",
                                          "/etc/passwd", "C:\\model.safetensors", "sub/../../x", "", ".", "..",
                                          "model-1.safetensors\x00", "\\\\server\\share"]),
                         st.text(max_size=12), _odd_number)


@settings(max_examples=300, **FUZZ)
@given(weight_map=st.one_of(st.dictionaries(st.text(max_size=6), _SHARD_NAMES, max_size=4), _odd_number,
                            st.lists(st.text(max_size=3), max_size=2)),
       extra=st.dictionaries(st.text(max_size=4), _odd_number, max_size=2),
       config=st.one_of(st.none(), st.binary(max_size=40),
                        st.dictionaries(st.sampled_from(["dtype", "torch_dtype", "model_type"]),
                                        st.one_of(st.sampled_from(["bfloat16", "torch.float16", "float8_e4m3fn",
                                                                   "no_such"]), _odd_number), max_size=3)))
def test_fuzz_shard_indexes_and_configs(traced, scratch: Path, weight_map: object, extra: dict,
                                        config: object) -> None:
    folder = scratch / "sharded"
    folder.mkdir(exist_ok=True)
    for stale in folder.iterdir():
        stale.unlink()
    header, size = valid_header()
    safetensors_file(folder / "model-1.safetensors", header, bytes(size))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map, **extra}))
    if isinstance(config, bytes):
        (folder / "config.json").write_bytes(config)
    elif config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    check_estimate(folder, dtype="auto")


# --------------------------------------------------------------------------- parse_oom_message


def check_parse(text: object) -> OOMMessage | None:
    """None or a sane record, never an exception, under 100 MB."""
    got, peak = bounded(lambda: parse_oom_message(text))  # type: ignore[arg-type]
    assert peak < MEMORY_LIMIT
    if got is not None:
        assert got.backend in {"cuda", "hip", "xpu", "mps", "cpu"}
        for name in ("device_index", "requested", "total", "free", "allocated", "reserved_unallocated",
                     "reserved_total", "this_process", "other_allocations"):
            value = getattr(got, name)
            assert value is None or (type(value) is int and 0 <= value <= 1 << 60), (name, value)
        assert isinstance(got.text, str) and 0 < len(got.text) <= 64 * 1024
    return got


@settings(max_examples=300, **FUZZ)
@given(st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=50), st.lists(st.text(max_size=5)),
                 st.dictionaries(st.text(max_size=3), st.text(max_size=3)), st.text(max_size=50)))
def test_fuzz_parse_takes_any_object(traced, value: object) -> None:
    check_parse(value)


class _SneakyStr(str):
    """A str whose methods raise (a str subclass from a library gone wrong)."""

    def __getitem__(self, index: Any) -> str:
        raise RuntimeError("hostile __getitem__")

    def split(self, *args: Any, **kwargs: Any) -> list[str]:
        raise RuntimeError("hostile split")

    def __len__(self) -> int:
        raise RuntimeError("hostile __len__")


@st.composite
def oom_messages(draw: st.DrawFn) -> str:
    """PyTorch's CUDA message grammar with extreme figures, units and repetitions."""
    number = st.one_of(st.integers(0, 10**6).map(str), st.text("0123456789", min_size=1, max_size=60),
                       st.builds(lambda a, b: f"{a}.{b}", st.integers(0, 10**30), st.text("0123456789", min_size=1,
                                                                                           max_size=50)),
                       st.sampled_from(["1e308", "inf", "nan", "-1.00", ".5", "١٢"]))
    unit = st.sampled_from(["bytes", "B", "KiB", "MiB", "GiB", "TiB", "EiB", "KB", "MB", "GB", "Gib", "GIB", ""])
    size = st.builds(lambda n, u: f"{n} {u}", number, unit)
    backend = draw(st.sampled_from(["CUDA", "HIP", "XPU", "MPS backend", "CUDA error:", "CUBLAS_STATUS_ALLOC_FAILED"]))
    parts = [f"{backend} out of memory. Tried to allocate {draw(size)}. "
             f"GPU {draw(number)} has a total capacity of {draw(size)} of which {draw(size)} is free. "]
    for _ in range(draw(st.integers(0, 30))):
        parts.append(f"Process {draw(number)} has {draw(size)} memory in use. ")
    parts.append(f"Including non-PyTorch memory, this process has {draw(size)} memory in use. "
                 f"Of the allocated memory {draw(size)} is allocated by PyTorch, and {draw(size)} is reserved by "
                 f"PyTorch but unallocated.")
    text = "".join(parts)
    if draw(st.booleans()):
        text = text.replace(" ", draw(st.sampled_from(["\n", "  ", "\x1b[0m ", "\t", " \udcff "])))
    return draw(st.text(max_size=30)) + text * draw(st.integers(1, 3)) + draw(st.text(max_size=30))


@settings(max_examples=400, **FUZZ)
@given(oom_messages(), st.booleans())
def test_fuzz_parse_grammar_with_extreme_figures(traced, text: str, sneaky: bool) -> None:
    check_parse(_SneakyStr(text) if sneaky else text)
    try:
        oom._parse(text)  # the unguarded parser: an exception here is a bug the guard would hide
    except RecursionError:
        pytest.fail("recursion in the parser")


@pytest.mark.parametrize("name", ["repeated-heads", "process-lines", "digits", "ansi", "brackets", "surrogates",
                                  "nul", "markers-only"])
def test_pathological_long_texts(traced, name: str) -> None:
    head = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.00 GiB is free. "
    texts = {
        "repeated-heads": head * 100_000,
        "process-lines": head + "Process 1 has 1.00 GiB memory in use. " * 300_000,
        "digits": head.replace("2.00", "9" * 2_000_000),
        "ansi": "\x1b[" * 1_000_000 + "\x1b[0m" + head,
        "brackets": "(" * 2_000_000 + head + ")" * 2_000_000,
        "surrogates": "\udcff" * 1_000_000 + head,
        "nul": "\x00" * 3_000_000 + head,
        "markers-only": "out of memory " * 500_000,
    }
    got = check_parse(texts[name])
    if name in ("repeated-heads", "ansi", "surrogates", "nul"):  # the message sits in the last MiB read
        assert got is not None and got.backend == "cuda" and got.total == 84_943_715_697  # 79.11 GiB
    else:
        assert got is None


def test_is_out_of_memory_never_raises() -> None:
    class BadStr(RuntimeError):
        def __str__(self) -> str:
            raise RuntimeError("hostile __str__")

    class BadClass(RuntimeError):
        @property
        def __class__(self) -> type:
            raise RuntimeError("hostile __class__")

    class Named(Exception):
        pass

    Named.__name__ = "OutOfMemoryError"
    assert is_out_of_memory(BadStr("CUDA out of memory.")) is False
    assert is_out_of_memory(BadClass("CUDA out of memory. Tried to allocate 2.00 GiB")) is True  # __class__ unread
    assert is_out_of_memory(Named()) is True
    assert is_out_of_memory(MemoryError()) is True
    assert is_out_of_memory(KeyboardInterrupt()) is False
    assert is_out_of_memory("CUDA out of memory.") is False  # type: ignore[arg-type]
    assert parse_oom_message(_SneakyStr("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
