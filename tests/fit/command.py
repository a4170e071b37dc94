"""The command run by its real ``main`` in this process, for tests that read many of its figures.

Its sizing children then fork from the suite's warm interpreter (tests/zygote.py) and a job sized
once is not sized again, where a process of its own starts Python, and each child torch, afresh
(seconds a call). tests/fit/test_cli.py and one job test run the command as its own process.
"""
from __future__ import annotations

import contextlib
import io
import subprocess

from oom_magic.cli import main


def fit_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``oom-magic fit ARGS`` as a finished process would report it: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["fit", *args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["oom-magic", "fit", *args], code, out.getvalue(), err.getvalue())
