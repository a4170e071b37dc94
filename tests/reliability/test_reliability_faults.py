"""Fault injection: every magic and the after-cell hook complete, with one clear note, whatever breaks.

Real IPython shell (the ``ip`` fixture), real torch CPU tensors, real subprocesses. Fakes, each
labelled where used, stand in only for what this machine cannot produce: NVML (there is no GPU:
``tests/fakes/fake_pynvml.py``, with failures injected at each call site), psutil permission errors
(we run as root here, so AccessDenied cannot happen for real), and the absence of torch, NVML and
ipywidgets (a meta path finder in a subprocess that raises ImportError for them).

What is tried, by category:

- NVML raising at every call site the wrapper makes (18 sites, each reached, checked through
  ``fake.calls``), with three kinds of exception (an NVMLError, an OSError from the driver, an
  exception whose ``__str__`` itself raises): 54 cases; plus four whole-library failures (init
  refused, every call failing, every call raising OSError, a pynvml without the functions) driven
  through every magic and the hook.
- torch and NVML absent; ipywidgets absent (subprocesses).
- psutil AccessDenied (own and other processes, system memory) and vanished/zombie processes.
- hostile objects in the namespace whose ``__getattr__``, ``__getattribute__``, ``__class__``,
  ``__eq__``, ``__hash__``, ``__len__``, ``__iter__``, ``__repr__``, ``__str__``, ``__bool__``,
  ``__dict__`` raise (a flag proves the walk never called them), lazy proxies, hostile dict keys.
- tensor subclasses whose storage access, ``__torch_function__`` or ``.grad`` raise.
- ``%reset -f`` between cells.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from oom_magic.device.reading import read_device, resolve_device
from oom_magic.common.errors import OomMagicError
from oom_magic.device.nvml import Nvml
from oom_magic.render.html import snapshot_html
from oom_magic.render.text import snapshot_text
from oom_magic.heap.snapshot import Snapshot
from tests.fakes.fake_pynvml import FakeGpu, FakeMig, FakeNvml, GiB

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("fresh_heap")



# --------------------------------------------------------------------------- helpers


def magics(ip) -> Any:
    return ip.magics_manager.registry["OomMagics"]


def cell_watch(ip) -> Any:
    return magics(ip).cell_watch


def run(ip, source: str) -> Any:
    """Run a cell as the user would; warnings from the hook are recorded, not printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ip.run_cell(source, store_history=True)
    ours = [str(w.message) for w in caught if "oom-magic" in str(w.message)]
    assert not ours, ours  # the hook never had to turn itself off
    return result


class _BadStr(Exception):
    """An exception whose message cannot even be printed."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of the error raised too")


def _nvml_error(fake: FakeNvml) -> BaseException:
    return fake.module.NVMLError(999)  # NVML_ERROR_UNKNOWN


def _os_error(fake: FakeNvml) -> BaseException:
    return OSError(5, "Input/output error from the driver")


def _bad_str_error(fake: FakeNvml) -> BaseException:
    return _BadStr()


ERRORS: dict[str, Callable[[FakeNvml], BaseException]] = {
    "nvml-error": _nvml_error, "os-error": _os_error, "unprintable-error": _bad_str_error,
}


def break_call(fake: FakeNvml, name: str, make_error: Callable[[FakeNvml], BaseException],
               only_from: str | None = None) -> None:
    """FAKE fault: make ``pynvml.<name>`` raise (only when called from ``only_from``, if given)."""
    real = getattr(fake.module, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if only_from is not None:
            frame, callers = sys._getframe(1), []
            while frame is not None and len(callers) < 6:
                callers.append(frame.f_code.co_name)
                frame = frame.f_back
            if only_from not in callers:
                return real(*args, **kwargs)
        fake.calls.append(name)
        raise make_error(fake)

    setattr(fake.module, name, failing)


def mig_machine(*, missing: tuple[str, ...] = ()) -> FakeNvml:
    """FAKE NVML: one A100 in MIG mode (cuda:0 is its first instance) holding this process and another."""
    instances = [
        FakeMig("MIG-11111111-1111-1111-1111-111111111111", used=6 * GiB,
                processes=[(os.getpid(), 2 * GiB), (1, 4 * GiB)], gpu_instance_id=1, compute_instance_id=0),
        FakeMig("MIG-22222222-2222-2222-2222-222222222222", gpu_instance_id=2, compute_instance_id=0),
    ]
    return FakeNvml([FakeGpu(mig=instances, processes=[], used=6 * GiB)], missing=missing)


def plain_machine() -> FakeNvml:
    """FAKE NVML: one plain GPU holding this process (3 GiB)."""
    return FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3", used=3 * GiB, processes=[(os.getpid(), 3 * GiB)])])


# Each call site of oom_magic/nvml.py: (function, machine, caller that must be on the stack, note it leaves).
# note: a substring one note must hold; None where nothing the user sees goes missing (a probe whose
# failure is an expected answer, or the driver version nobody shows).
SITES: list[tuple[str, Callable[[], FakeNvml], str | None, str | None]] = [
    ("nvmlInit", mig_machine, None, "NVML unavailable: NVML failed to start"),
    ("nvmlSystemGetDriverVersion", mig_machine, None, None),
    ("nvmlDeviceGetCount", mig_machine, None, "nvmlDeviceGetCount"),
    ("nvmlDeviceGetHandleByIndex", mig_machine, None, "nvmlDeviceGetHandleByIndex"),
    ("nvmlDeviceGetMemoryInfo", mig_machine, None, "nvmlDeviceGetMemoryInfo"),
    ("nvmlDeviceGetUUID", mig_machine, None, "nvmlDeviceGetUUID"),
    ("nvmlDeviceGetName", mig_machine, None, "nvmlDeviceGetName"),
    ("nvmlDeviceGetPciInfo", mig_machine, None, "nvmlDeviceGetPciInfo"),
    ("nvmlDeviceGetMigMode", mig_machine, None, None),
    ("nvmlDeviceGetMaxMigDeviceCount", mig_machine, None, "nvmlDeviceGetMaxMigDeviceCount"),
    ("nvmlDeviceGetMigDeviceHandleByIndex", mig_machine, None, None),
    ("nvmlDeviceGetGpuInstanceId", mig_machine, None, "nvmlDeviceGetGpuInstanceId"),
    ("nvmlDeviceGetComputeInstanceId", mig_machine, None, "nvmlDeviceGetComputeInstanceId"),
    ("nvmlDeviceGetHandleByUUID", plain_machine, "_handle_for", "is no longer present"),
    ("nvmlDeviceGetComputeRunningProcesses", mig_machine, None, "NVML could not list processes (compute"),
    ("nvmlDeviceGetGraphicsRunningProcesses", plain_machine, None, "NVML could not list processes (graphics"),
    ("nvmlDeviceGetComputeRunningProcesses_v2",
     lambda: mig_machine(missing=("nvmlDeviceGetComputeRunningProcesses_v3",)), None,
     "NVML could not list processes (compute"),
    ("nvmlDeviceGetGraphicsRunningProcesses_v2",
     lambda: mig_machine(missing=("nvmlDeviceGetGraphicsRunningProcesses_v3",)), None,
     "NVML could not list processes (graphics"),
]


def _force_uuid_mismatch(fake: FakeNvml) -> None:
    """FAKE: the GPU's UUID reads differently when a handle is re-checked (the device was swapped)."""
    real = fake.module.nvmlDeviceGetUUID

    def swapped(handle: Any) -> Any:
        frame, callers = sys._getframe(1), []
        while frame is not None and len(callers) < 6:
            callers.append(frame.f_code.co_name)
            frame = frame.f_back
        return "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff" if "_handle_for" in callers else real(handle)

    fake.module.nvmlDeviceGetUUID = swapped


# --------------------------------------------------------------------------- NVML, one call site at a time


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("site, machine, caller, note", SITES, ids=[s[0] for s in SITES])
def test_nvml_failing_at_one_call_site(site: str, machine: Callable[[], FakeNvml], caller: str | None,
                                       note: str | None, error: str) -> None:
    fake = machine()
    if site == "nvmlDeviceGetHandleByUUID":
        _force_uuid_mismatch(fake)
    if site == "nvmlInit":
        real_init = fake.module.nvmlInit

        def init() -> None:
            real_init()  # the fake's state stays consistent; the caller still sees the failure
            fake.calls.append("nvmlInit")
            raise ERRORS[error](fake)

        fake.module.nvmlInit = init
    else:
        break_call(fake, site, ERRORS[error], only_from=caller)
    nvml = Nvml(fake.module)

    try:
        device = resolve_device("cuda:0", nvml)
    except OomMagicError as exc:
        message = str(exc)
        assert "\n" not in message and message.startswith("unknown device 'cuda:0': this machine has cpu")
        if note is not None:
            assert "no CUDA device found: NVML" in message and (site in message or "NVML unavailable" in message)
        reading = read_device("cpu", nvml)
        assert reading.total is not None
    else:
        assert device == "cuda:0"
        reading = read_device("cuda:0", nvml)
        assert reading.device == "cuda:0"
        snap = Snapshot("cuda:0", reading, (), (), 0.0, 0, True)
        text, html = snapshot_text(snap), snapshot_html(snap)
        assert text.startswith("cuda:0") and html.startswith("<div class='oom-snapshot'>")
        if note is not None:
            explained = [n for n in reading.notes if note in n]
            assert len(explained) == 1, (reading.notes, note)
            healthy = read_device("cuda:0", Nvml(machine().module)).notes
            others = [n for n in reading.notes if n not in explained and n not in healthy]
            assert others == [], reading.notes  # one note, not one per figure
        if reading.total is None or reading.name is None:
            assert any("NVML" in n for n in reading.notes), reading.notes  # a missing figure is explained
    assert site in fake.calls  # the fault was really injected at a call the code made


# --------------------------------------------------------------------------- NVML, the whole library failing


def _init_refused() -> FakeNvml:
    """FAKE: NVML/RM version mismatch after a driver upgrade (nvmlInit raises code 18)."""
    return FakeNvml([FakeGpu(processes=[(os.getpid(), GiB)])], init_error=18)


def _every_call_fails() -> FakeNvml:
    """FAKE: nvmlInit works, every later call raises NVML_ERROR_UNKNOWN."""
    fake = FakeNvml([FakeGpu(processes=[(os.getpid(), GiB)])])
    for name in dir(fake.module):
        if name.startswith("nvml") and name not in ("nvmlInit", "nvmlShutdown"):
            break_call(fake, name, _nvml_error)
    return fake


def _every_call_oserror() -> FakeNvml:
    """FAKE: nvmlInit works, every later call raises OSError (the driver went away)."""
    fake = FakeNvml([FakeGpu(processes=[(os.getpid(), GiB)])])
    for name in dir(fake.module):
        if name.startswith("nvml") and name not in ("nvmlInit", "nvmlShutdown"):
            break_call(fake, name, _os_error)
    return fake


def _no_functions() -> FakeNvml:
    """FAKE: a pynvml that has nvmlInit and nothing else (a broken or foreign install)."""
    fake = FakeNvml([FakeGpu()])
    for name in [n for n in dir(fake.module) if n.startswith("nvml") and n != "nvmlInit"]:
        delattr(fake.module, name)
    return fake


WHOLE = {"init-refused": _init_refused, "every-call-fails": _every_call_fails,
         "every-call-oserror": _every_call_oserror, "no-functions": _no_functions}


@pytest.fixture
def clean_alloc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """%%guardload may set PYTORCH_CUDA_ALLOC_CONF for this process: restore it afterwards."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("broken", sorted(WHOLE))
def test_every_magic_and_the_hook_complete_when_nvml_fails(use_nvml, ip, monkeypatch, clean_alloc_env, broken: str) -> None:
    fake = WHOLE[broken]()
    use_nvml(Nvml(fake.module))
    run(ip, "import torch")
    ip.run_line_magic("gpumem", "-o --auto always")

    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("gpumem", "-o --device cuda:0")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("unknown device 'cuda:0': this machine has cpu (no CUDA")
    assert "NVML" in message  # says why: the one clear note about what is missing
    with pytest.raises(UsageError, match=r"no CUDA device found: NVML"):
        ip.run_line_magic("freeall", "--device cuda:0")
    with pytest.raises(UsageError, match=r"no CUDA device found: NVML"):
        ip.run_cell_magic("guardload", "--device cuda:0", "w = torch.ones(8)\n")
    assert "w" not in ip.user_ns  # refused before the cell ran

    snap = ip.run_line_magic("gpumem", "-o")
    assert snap.device == "cpu" and snap.reading.total is not None and snap.reading.total > 0
    report = ip.run_line_magic("freeall", "")
    assert report.device == "cpu" and report.freed_bytes == 0
    guard = ip.run_cell_magic("guardload", "--quiet", "g = torch.ones(1024)\n")
    assert guard.outcome == "ok" and torch.equal(ip.user_ns["g"], torch.ones(1024))
    shown = len(cell_watch(ip).live)
    result = run(ip, "h = torch.zeros(256)")
    assert result.success and cell_watch(ip).enabled
    assert len(cell_watch(ip).live) == min(shown + 1, magics(ip).live_widgets)
    assert cell_watch(ip).live[-1].report.snapshot.held_by("h") == 256 * 4


# --------------------------------------------------------------------------- torch, NVML, ipywidgets absent

_BLOCKED_SESSION = r"""
import json, sys, warnings
BLOCK = set(sys.argv[1].split(","))

class Absent:
    '''Makes the named packages look uninstalled: importing them raises ImportError.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"No module named {name!r} (blocked for this test)")
        return None

sys.meta_path.insert(0, Absent())
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

ip = start_ipython()
ip.run_line_magic("load_ext", "oom_magic")
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = ip.run_cell("import torch\nx = torch.ones(16 << 20)" if "torch" not in BLOCK else "x = bytearray(64 << 20)",
                        store_history=True)
    ip.run_cell("y = [0] * 1000", store_history=True)
out["hook_warnings"] = [str(w.message) for w in caught if "oom-magic" in str(w.message)]
out["first_cell_ok"] = first.success
watch = ip.magics_manager.registry["OomMagics"].cell_watch
out["hook_enabled"] = watch.enabled
out["widgets"] = len(watch.live)
out["history"] = len(watch.watcher.history)
snap = ip.run_line_magic("gpumem", "-o")
out["gpumem"] = {"device": snap.device, "notes": list(snap.notes), "reading_notes": list(snap.reading.notes),
                 "user_bytes": snap.user_bytes, "html": snap._repr_html_() is not None, "text": str(snap)}
try:
    ip.run_line_magic("gpumem", "-o --device cuda")
    out["gpumem_cuda"] = "no error"
except UsageError as exc:
    out["gpumem_cuda"] = str(exc)
try:
    ip.run_line_magic("gpumem", "-o --pin")
    out["pin"] = "ok"
except UsageError as exc:
    out["pin"] = "UsageError: " + str(exc)
except Exception as exc:
    out["pin"] = f"{type(exc).__name__}: {exc}"
free = ip.run_line_magic("freeall", "")
out["freeall"] = {"device": free.device, "notes": list(free.notes), "text": str(free)}
guard = ip.run_cell_magic("guardload", "--quiet", "z = [1] * 100\n")
out["guardload"] = {"outcome": guard.outcome, "device": guard.device, "z": ip.user_ns.get("z") == [1] * 100}
out["modules"] = {name: name in sys.modules for name in ("torch", "pynvml", "ipywidgets")}
print("RESULT " + json.dumps(out))
"""


def blocked_session(tmp_path: Path, blocked: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IPYTHONDIR": str(tmp_path), "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", _BLOCKED_SESSION, blocked], check=False, capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_without_torch_and_nvml_everything_completes_and_says_why(tmp_path: Path) -> None:
    out = blocked_session(tmp_path, "torch,pynvml")
    assert out["modules"]["torch"] is False and out["modules"]["pynvml"] is False
    assert out["hook_warnings"] == [] and out["hook_enabled"] and out["history"] == 0
    assert out["gpumem"]["device"] == "cpu" and out["gpumem"]["user_bytes"] == 0
    assert out["gpumem"]["notes"] == ["torch is not imported in this process: no tensors to attribute"]
    assert "note: torch is not imported" in out["gpumem"]["text"]
    assert out["gpumem_cuda"] == ("unknown device 'cuda': this machine has cpu "
                                  "(no CUDA device found: NVML unavailable: nvidia-ml-py not installed)")
    assert out["freeall"]["notes"] == ["torch is not imported in this process: there are no tensors to free"]
    assert out["guardload"] == {"outcome": "ok", "device": "cpu", "z": True}


@pytest.fixture(scope="module")
def without_ipywidgets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return blocked_session(tmp_path_factory.mktemp("no-ipywidgets"), "ipywidgets")


def test_without_ipywidgets_every_magic_completes(without_ipywidgets: dict[str, Any]) -> None:
    out = without_ipywidgets
    assert out["modules"]["ipywidgets"] is False and out["modules"]["torch"] is True
    assert out["first_cell_ok"]
    assert out["gpumem"]["device"] == "cpu" and out["gpumem"]["user_bytes"] == 64 << 20
    assert out["freeall"]["device"] == "cpu"
    assert out["guardload"] == {"outcome": "ok", "device": "cpu", "z": True}


def test_without_ipywidgets_the_hook_shows_a_static_view_and_says_so(without_ipywidgets: dict[str, Any]) -> None:
    out = without_ipywidgets
    assert out["hook_enabled"] is True
    assert len(out["hook_warnings"]) <= 1 and all("ipywidgets" in w for w in out["hook_warnings"])
    assert out["pin"].startswith("UsageError: ") and "ipywidgets" in out["pin"]


# --------------------------------------------------------------------------- psutil


def test_psutil_access_denied_and_vanished_processes(use_nvml, ip, monkeypatch) -> None:
    import psutil

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a real process that has exited: NVML may still list its pid for a moment
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    zombie_pid = zombie.pid
    os.waitid(os.P_PID, zombie_pid, os.WEXITED | os.WNOWAIT)  # a real zombie: exited, not reaped
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real_username = psutil.Process.username

        def username(self: Any) -> str:
            """FAKE: the sleeper belongs to a user whose processes we may not inspect."""
            if self.pid == sleeper.pid:
                raise psutil.AccessDenied(self.pid)
            return real_username(self)

        def memory_info(self: Any) -> Any:
            """FAKE: even our own process's memory is refused (a hardened /proc)."""
            raise psutil.AccessDenied(self.pid)

        def virtual_memory() -> Any:
            """FAKE: system memory cannot be read (a sandbox without /proc/meminfo)."""
            raise psutil.AccessDenied()

        monkeypatch.setattr(psutil.Process, "username", username)
        monkeypatch.setattr(psutil.Process, "memory_info", memory_info)
        monkeypatch.setattr(psutil, "virtual_memory", virtual_memory)
        gpu = FakeGpu(used=10 * GiB, processes=[(os.getpid(), GiB), (gone.pid, 2 * GiB),
                                                (zombie_pid, 3 * GiB), (sleeper.pid, 4 * GiB)])
        use_nvml(Nvml(FakeNvml([gpu]).module))
        run(ip, "import torch\nt = torch.ones(1000)")

        snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
        others = {p.pid: p for p in snap.reading.processes}
        assert set(others) == {gone.pid, zombie_pid, sleeper.pid}
        assert (others[gone.pid].note, others[gone.pid].name, others[gone.pid].used_bytes) == (
            "process has exited", None, 2 * GiB)
        assert (others[zombie_pid].note, others[zombie_pid].name) == ("process has exited", None)
        assert (others[sleeper.pid].note, others[sleeper.pid].name, others[sleeper.pid].used_bytes) == (
            "access denied", None, 4 * GiB)
        assert snap.reading.process_used == GiB
        html, text = snap._repr_html_(), str(snap)
        assert "access denied" in text and "process has exited" in text and str(sleeper.pid) in html

        cpu = ip.run_line_magic("gpumem", "-o")
        assert cpu.reading.total is None and cpu.reading.process_used is None
        said = [n.split(":")[0] for n in cpu.reading.notes if n.startswith("psutil could not read")]
        assert said == ["psutil could not read system memory", "psutil could not read this process's memory"]
        assert cpu.held_by("t") == 4000 and "n/a" in str(cpu)
        assert ip.run_line_magic("freeall", "").device == "cpu"
        assert ip.run_cell_magic("guardload", "--quiet", "u = torch.ones(10)\n").outcome == "ok"
        ip.run_line_magic("gpumem", "-o --auto always")
        result = run(ip, "v = torch.ones(10)")
        assert result.success and cell_watch(ip).enabled and cell_watch(ip).live
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


# --------------------------------------------------------------------------- hostile objects

HOSTILE_SETUP = '''
import torch
CALLED = []
ARMED = [False]

class Hostile:
    """Every protocol method raises once armed; each call is recorded first."""

    def _hit(self, name):
        if ARMED[0]:
            CALLED.append(name)
            raise RuntimeError(f"hostile {name}")

    def __getattr__(self, name):
        Hostile._hit(self, "__getattr__:" + name)
        raise AttributeError(name)

    def __getattribute__(self, name):
        if name in ("_hit", "__dict__") or not ARMED[0]:
            return object.__getattribute__(self, name)
        Hostile._hit(self, "__getattribute__:" + name)

    @property
    def __class__(self):
        Hostile._hit(self, "__class__")
        return Hostile

    def __eq__(self, other):
        Hostile._hit(self, "__eq__")
        return self is other

    def __hash__(self):
        Hostile._hit(self, "__hash__")
        return 7

    def __len__(self):
        Hostile._hit(self, "__len__")
        return 1

    def __iter__(self):
        Hostile._hit(self, "__iter__")
        return iter(())

    def __repr__(self):
        Hostile._hit(self, "__repr__")
        return "Hostile()"

    __str__ = __repr__

    def __bool__(self):
        Hostile._hit(self, "__bool__")
        return True

    def __sizeof__(self):
        Hostile._hit(self, "__sizeof__")
        return 0

    def __dir__(self):
        Hostile._hit(self, "__dir__")
        return []


class Lazy:
    """A lazy proxy: every attribute is another proxy (a walk that follows attributes never ends)."""

    def __getattr__(self, name):
        CALLED.append("Lazy." + name)
        return Lazy()


class HostileModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.friend = Hostile()

    def __getattr__(self, name):
        if ARMED[0]:
            CALLED.append("HostileModule.__getattr__:" + name)
            raise RuntimeError("hostile module attribute")
        return torch.nn.Module.__getattr__(self, name)


h = Hostile()
h.weights = torch.ones(1024)
key = Hostile()
by_key = {key: torch.ones(2048)}
in_list = [Hostile(), torch.ones(512), (Hostile(), {"k": Hostile()})]
in_set = {Hostile()}
lazy = Lazy()
net = HostileModule()

def make_closure(held):
    def inner():
        return held
    return inner

closure = make_closure((Hostile(), torch.ones(256)))
err = ValueError(Hostile(), torch.ones(128))
'''


@pytest.fixture
def hostile(ip):
    """The namespace full of hostile objects, armed; disarmed before the fixture resets the shell."""
    assert run(ip, HOSTILE_SETUP).success
    ns = ip.user_ns
    ns["ARMED"][0] = True
    yield ns
    ns["ARMED"][0] = False


def test_hostile_objects_are_never_called_by_any_magic_or_the_hook(ip, hostile, clean_alloc_env) -> None:
    called = hostile["CALLED"]
    ip.run_line_magic("gpumem", "-o --auto always")
    result = run(ip, "extra = torch.ones(4096)")
    assert result.success and cell_watch(ip).enabled and called == []
    widget = cell_watch(ip).live[-1]
    assert widget.report.snapshot.held_by("extra") == 4096 * 4

    snap = ip.run_line_magic("gpumem", "-o --all")
    paths = {g.path for g in snap.holders("user")}
    # A dict key that a variable also holds is shown by that variable (`key`), never by its repr;
    # a closure cell's contents by the attribute a user would type.
    assert {"h.weights", "by_key[key]", "in_list[1]", "extra", "closure.__closure__[0].cell_contents[1]",
            "err.args[1]"} <= paths
    assert "net.fc.weight" in paths and "net.fc.bias" in paths
    assert snap.held_by("h") == 4096 and snap.held_by("by_key") == 8192
    str(snap), snap._repr_html_(), snap.to_json_text()
    assert called == []

    assert ip.run_line_magic("freeall", "--dry-run").dry_run
    freed = ip.run_line_magic("freeall", "")
    assert freed.device == "cpu" and called == []
    deleted = ip.run_line_magic("freeall", "in_list")
    assert deleted.deleted == ("in_list",) and "in_list" not in ip.user_ns and "h" in ip.user_ns
    report = ip.run_cell_magic("guardload", "--quiet", "loaded = torch.zeros(64)\n")
    assert report.outcome == "ok" and report.variable("loaded") is not None
    report._repr_html_(), str(report)
    assert called == []
    assert hostile["h"].__dict__["weights"].sum().item() == 1024  # still there, untouched


def test_a_guarded_cell_naming_a_hostile_object_does_not_call_it(ip, hostile, clean_alloc_env) -> None:
    """Finding 2 (fixed in preflight.py): the fit check read a named object's __class__ via isinstance()."""
    # The preflight resolves torch.load's argument `h`; the cell itself never touches it.
    with capture_output() as shown:
        result = ip.run_cell("%%guardload\nloaded = torch.load(h) if False else None\n", store_history=True)
    assert hostile["CALLED"] == []
    assert result.success and result.error_in_exec is None and ip.user_ns["loaded"] is None
    assert "torch.load(h)" in shown.stdout  # the preflight saw the call, and said what it could not size


def test_a_dict_property_is_never_called(ip) -> None:
    """Finding 3 (fixed in holders.py): object.__getattribute__(o, "__dict__") ran a class-level property."""
    run(ip, textwrap.dedent('''
        import torch
        DICT_CALLS = []
        class NoDict:
            @property
            def __dict__(self):
                DICT_CALLS.append(1)
                raise RuntimeError("hostile __dict__")
        odd = NoDict()
        t = torch.ones(10)
    '''))
    snap = ip.run_line_magic("gpumem", "-o")
    assert snap.held_by("t") == 40
    assert ip.user_ns["DICT_CALLS"] == []


def test_a_library_dict_keyed_by_a_hostile_object_does_not_break_gpumem(ip) -> None:
    run(ip, textwrap.dedent('''
        import torch
        REPRS = []
        class BadKey:
            def __hash__(self):
                return 1
            def __repr__(self):
                REPRS.append(1)
                raise RuntimeError("hostile __repr__")
        class Registry:  # a cell's class: its attributes are the user's (issue 24), keyed by a hostile key
            cache = {BadKey(): torch.ones(1000)}
        del BadKey
    '''))
    snap = ip.run_line_magic("gpumem", "-o")
    held = {r.holder_path for r in snap.storages if r.holder_kind == "user"}  # the key never by its repr:
    assert "Registry.cache[<BadKey key>]" in held, held
    assert ip.user_ns["REPRS"] == []


# --------------------------------------------------------------------------- tensor subclasses that raise

SUBCLASS_SETUP = '''
import torch

class NoStorage(torch.Tensor):
    """Storage access raises (a wrapper subclass gone wrong)."""
    def untyped_storage(self):
        raise RuntimeError("no storage for you")

class Explodes(torch.Tensor):
    """Every torch operation on it raises, attribute reads included."""
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"hostile __torch_function__ ({getattr(func, '__name__', func)})")

class BadGrad(torch.Tensor):
    @property
    def grad(self):
        raise RuntimeError("hostile .grad")

good = torch.ones(1000)
no_storage = torch.ones(2000).as_subclass(NoStorage)
explodes = torch.ones(3000).as_subclass(Explodes)
bad_grad = torch.ones(4000).as_subclass(BadGrad)

class Wrapper(torch.Tensor):
    """A wrapper subclass: its storage has no data of its own (the inner tensor holds the bytes)."""
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
    def __init__(self, inner):
        self.inner = inner
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("hostile __torch_dispatch__")

wrapped = Wrapper(torch.ones(500))
'''


def test_tensor_subclasses_that_raise_do_not_break_anything(ip, clean_alloc_env) -> None:
    assert run(ip, SUBCLASS_SETUP).success
    ip.run_line_magic("gpumem", "-o --auto always")
    assert run(ip, "more = torch.ones(10)").success and cell_watch(ip).enabled

    snap = ip.run_line_magic("gpumem", "-o --all")
    assert snap.held_by("good") == 4000 and snap.held_by("more") == 40
    # The engine reads tensors through TensorBase with subclass __torch_function__ off: overrides
    # never run, so the real bytes behind a raising untyped_storage() or __torch_function__ count.
    assert snap.held_by("no_storage") == 8000 and snap.held_by("explodes") == 12000
    assert snap.held_by("bad_grad") == 16000  # a raising .grad does not hide the tensor itself
    assert snap.held_by("wrapped.inner") == 2000 and snap.held_by("wrapped") == 2000  # the wrapper holds none
    assert any("not counted" in n for n in snap.notes)  # and the snapshot says something was left out
    str(snap), snap._repr_html_(), snap.to_json_text()
    freed = ip.run_line_magic("freeall", "")
    assert freed.freed_bytes == 0 and {"good", "no_storage", "explodes", "bad_grad"} <= set(ip.user_ns)
    deleted = ip.run_line_magic("freeall", "explodes")
    assert deleted.deleted == ("explodes",) and "explodes" not in ip.user_ns
    report = ip.run_cell_magic("guardload", "--quiet", "loaded = torch.ones(8)\n")
    assert report.outcome == "ok"


def test_an_unreadable_tensor_is_named_as_such(ip) -> None:
    """Finding 5 (fixed in tracker.py): it was counted among the 'meta/fake tensors' in the note."""
    assert run(ip, SUBCLASS_SETUP).success
    snap = ip.run_line_magic("gpumem", "-o")
    # The wrapper subclass's storage has no data (its overrides no longer matter: none is called)
    assert any(n.startswith("1 tensors' storage could not be read") for n in snap.notes), snap.notes
    assert not any("meta/fake" in n for n in snap.notes), snap.notes


# --------------------------------------------------------------------------- %reset -f between cells


def test_reset_between_cells(ip, clean_alloc_env) -> None:
    ip.run_line_magic("gpumem", "-o --auto always")
    run(ip, "import torch\nbig = torch.ones(8 << 20)")
    run(ip, "torch.ones(4 << 20) * 2")  # only the output cache holds this one
    watch = cell_watch(ip)
    old = watch.live[-1]
    assert old.report.snapshot.stale_bytes == 16 << 20
    run(ip, "%reset -f")
    assert "big" not in ip.user_ns
    result = run(ip, "import torch\nafter = torch.ones(8 << 20)")
    assert result.success and watch.enabled
    assert watch.live[-1].report.snapshot.held_by("after") == 32 << 20
    assert watch.live[-1].report.snapshot.held_by("big") == 0
    run(ip, "%reset -f")
    snap = ip.run_line_magic("gpumem", "-o")
    assert snap.user_bytes == 0
    old.button.click()  # a widget from before the reset still works
    assert old.report.freed is not None and "could not" not in old.status.value
    assert ip.run_line_magic("freeall", "").device == "cpu"
    report = ip.run_cell_magic("guardload", "--quiet", "import torch\nnew = torch.ones(4)\n")
    assert report.outcome == "ok" and report.variable("new").bytes == 16
    run(ip, "%reset -f")
    result = run(ip, "x = 1")
    assert result.success and watch.enabled
