"""The command for the tests: run by its real ``main`` in this process (fit_here), or as its own process
(fit_process) where the process is what is checked (exit status, environment, ``ulimit -v``).

In this process its sizing children fork from the suite's warm interpreter (tests/zygote.py) and a
job sized once is not sized again, where a process of its own starts Python, and each child torch,
afresh (seconds a call).
"""
from __future__ import annotations

import contextlib
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

from oom_magic.cli import main

ROOT = Path(__file__).resolve().parents[2]


def fit_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``oom-magic fit ARGS`` as a finished process would report it: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["fit", *args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["oom-magic", "fit", *args], code, out.getvalue(), err.getvalue())


def fit_process(*args: str, hf_home: Path | None = None, limit: int | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m oom_magic fit ARGS` in a fresh interpreter, offline, with this checkout's package;
    ``hf_home``: its HF_HOME (the hub cache); ``limit``: its address-space limit in bytes, as ``ulimit -v``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if hf_home is not None:
        env.pop("HF_HUB_CACHE", None)
        env["HF_HOME"] = str(hf_home)

    def ulimit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    return subprocess.run([sys.executable, "-m", "oom_magic", "fit", *args], capture_output=True, text=True,
                          check=False, env=env, timeout=timeout, preexec_fn=ulimit if limit is not None else None)
