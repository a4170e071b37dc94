"""Shared fixtures: a real IPython shell with the extension loaded, fresh per test."""
from __future__ import annotations

import gc
import subprocess
from contextlib import ExitStack, contextmanager
from typing import Any
from collections.abc import Callable, Iterator

import pytest

from oom_magic.heap import user_code

# This suite's own modules (tests.*, benchmarks) hold the shells they drive: they are not a notebook's
# modules, whose globals would otherwise name every tensor of a test's shell as a user holder.
user_code.HARNESS_PREFIXES = ("tests", "benchmarks", "conftest")


@pytest.fixture(scope="session")
def _global_ip():
    from IPython.testing.globalipapp import start_ipython

    return start_ipython()


def pytest_configure(config: pytest.Config) -> None:
    """Under --dist loadgroup, stop where the xdist_group marks would not take effect.

    pytest 9.2 with pytest-xdist 3.8 drops them silently (pytest-xdist#1386): the real kernels and
    the browser would run side by side, and each module fixture would be built on both workers."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    def release(name: str) -> tuple[int, ...]:
        return tuple(int(p) for p in version(name).split(".")[:2] if p.isdigit())

    if release("pytest") >= (9, 2) and release("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} ignores "
                                "xdist_group under --dist loadgroup (pytest-xdist#1386): install 'pytest<9.2' "
                                "(make test does)")


@pytest.fixture(scope="session", autouse=True)
def _sizing_children_start_warm() -> Iterator[None]:
    """Sizing children (config_size.run_child) fork from one interpreter that has imported torch and
    transformers already (tests/zygote.py): the same script, bounds and answer file, seconds less each."""
    import os

    from oom_magic.checkpoints import config_size
    from tests.zygote import Zygote

    if os.environ.get("OOM_MAGIC_TEST_FRESH_CHILDREN"):  # each child a fresh interpreter, as the product starts them
        yield
        return
    zygote = Zygote()
    config_size.start_child = zygote.start_child
    try:
        yield
    finally:
        config_size.start_child = config_size._popen
        zygote.close()


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Each test leaves os.environ as it found it. %%guardload on a (FAKE) cuda device sets
    PYTORCH_CUDA_ALLOC_CONF for the process, as it should for a user; left set, it followed every
    later test of the worker into its sizing children, and the warm zygote (tests/zygote.py), started
    with another environment, served none of them: each imported torch afresh."""
    import os

    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


_tests_started = 0  # in this process (an xdist worker)
_collected_after = -1  # the test whose teardown ended with a collection of its garbage


class _TestGarbage:
    """Frees what the tests before left unreachable, without a full collection each time where it can.

    A full collection walks every object torch, transformers and IPython made at import (0.2-0.4 s
    here), and the shell fixtures ran one per test. What a test makes stays in generations 0 and 1
    until a collection of generation 1 or 2 moves the survivors on, and many tests end before the
    collector's own thresholds run one: then ``gc.collect(1)`` frees all of their garbage. A full
    collection runs instead when that does not hold: a collection of an older generation ran since
    the last full one (the collector's own, the product's gc.collect(), a test's, IPython's), or
    the test module changed (module fixtures, torn down, can leave cycles in generation 2), or it
    never ran in this process. The collector's thresholds stay as a kernel has them."""

    def __init__(self) -> None:
        self.clean_module: str | None = None  # the module at the last full collection, while none older ran
        self.module: str | None = None  # the module of the test running
        self.ours = False

    def watch(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] >= 1 and not self.ours:
            self.clean_module = None  # survivors went to generation 2: the next collection is full

    def collect(self) -> None:
        self.ours = True
        try:
            if self.clean_module is not None and self.clean_module == self.module:
                gc.collect(1)
            else:
                gc.collect()
                self.clean_module = self.module
        finally:
            self.ours = False


_garbage = _TestGarbage()


@pytest.fixture(scope="session", autouse=True)
def _young_test_garbage() -> Iterator[None]:
    """Watch for collections of the older generations for the session; see _TestGarbage."""
    gc.callbacks.append(_garbage.watch)
    try:
        yield
    finally:
        gc.callbacks.remove(_garbage.watch)


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test is set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _tests_started
    _tests_started += 1
    _garbage.module = item.nodeid.split("::", 1)[0]


@pytest.fixture
def ip(_global_ip):
    """The real IPython shell, extension loaded, user namespace and history reset afterwards.

    It starts with no garbage of earlier tests: under xdist a test follows any other, and a
    reference cycle one left behind would show in this test's scans as stale. When the test just
    before was one of these, its teardown already freed its garbage."""
    global _collected_after
    shell = _global_ip
    if _collected_after != _tests_started - 1:
        _garbage.collect()
    shell.run_line_magic("load_ext", "oom_magic")
    yield shell
    # %reset runs two full collections of its own (IPython's displayhook.flush), each up to a second
    # with torch and transformers on the heap; the one collection below frees the same cycles (the
    # output cache, the test's namespace) at once.
    collect, gc.collect = gc.collect, lambda generation=2: 0
    try:
        shell.run_line_magic("reset", "-f")
        shell.run_line_magic("unload_ext", "oom_magic")
    finally:
        gc.collect = collect
    import sys

    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, attr):
            delattr(sys, attr)
    shell.last_execution_result = None
    _garbage.collect()
    _collected_after = _tests_started


@pytest.fixture
def fresh_heap():
    """Freeze what earlier test modules left alive out of the collector's view (gc.freeze) for one
    test, as in a fresh kernel: a tensor another module's fixture still holds would otherwise make
    every scan here name its holder, and every exact count see it."""
    _garbage.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def ready_process(args: list[str]) -> Iterator[subprocess.Popen]:
    """A real child process that prints 'ready' once it is set up; killed and reaped afterwards."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def use_nvml() -> Iterator[Callable[[Any], Any]]:
    """Put an Nvml (over a FAKE pynvml, tests/fakes/fake_pynvml.py) in place of this machine's for
    one test, through ``nvml.use``; returns the installer, and the machine's comes back afterwards."""
    from oom_magic.device import nvml

    with ExitStack() as stack:
        yield lambda reader: stack.enter_context(nvml.use(reader))


@pytest.fixture
def reset_high_water() -> None:
    """Reset this process's resident high-water mark (VmHWM and ru_maxrss) to what is resident now,
    as the guard does, so a test's peak does not depend on what earlier tests peaked at."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError as exc:
        pytest.skip(f"the high-water mark cannot be reset here ({exc}): this cell's peak is unknowable "
                    "below an earlier test's")
