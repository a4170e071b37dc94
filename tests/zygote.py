"""Sizing children forked from one warm interpreter: the suite's stand-in for a fresh ``python -c``.

Each sizing child (config_size.run_child: config-only sizing, transformers' quantization rules, the
job probe) spends about 4 s importing torch and transformers before its first line of work, and
the suite starts dozens. Here one interpreter per xdist worker imports them once, with the same
environment run_child gives its children, and forks a child per request. The child then runs the
very script run_child passes, with its arguments, writing its answer to the same file, and the
parent bounds it in time and memory exactly as before (it is a real process: psutil reads it,
SIGKILL stops it). What differs from a fresh interpreter is only that the imports are done.

Linux only (``/proc``); a request whose environment is not the zygote's (a test hiding torch from
the child) starts a fresh interpreter as the product does.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The zygote: import what the children import, then fork one child per request line.
_ZYGOTE = r"""
import json, os, signal, sys
import torch, transformers
for name in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel", "LlamaForCausalLM",
             "MistralForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel", "MixtralForCausalLM",
             "T5ForConditionalGeneration", "MambaForCausalLM", "JambaForCausalLM"):
    getattr(transformers, name, None)  # transformers imports a model's module on first access
import transformers.quantizers.base, transformers.quantizers.quantizers_utils
try:
    import peft
except ImportError:
    pass
import oom_magic.checkpoints.hf_rules
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; their status goes to a file
requests = sys.stdin
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid:
        sys.stdout.write(f"{pid}\n"); sys.stdout.flush()
        continue
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0); os.dup2(null, 2)
        os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
        sys.stdin = open(os.devnull)
        sys.argv = ["-c", *request["args"]]
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
            status = 0
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        sys.stdout.flush()
    finally:
        with open(request["status"], "w") as f:
            f.write(str(status))
        os._exit(status)
"""


class ForkedChild:
    """What run_child needs of a Popen, for a child of the zygote (not of this process)."""

    def __init__(self, pid: int, status_file: str) -> None:
        self.pid = pid
        self._status_file = status_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _running(self.pid):
            try:
                self.returncode = int(Path(self._status_file).read_text() or -9)
            except (OSError, ValueError):
                self.returncode = -signal.SIGKILL  # killed before it could say
            Path(self._status_file).unlink(missing_ok=True)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


def _settings(env: dict[str, str]) -> dict[str, str]:
    """The environment less pytest's own note of the running test, which changes with every test."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Zygote:
    """One warm interpreter that forks sizing children; started on the first request."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._env: dict[str, str] | None = None
        self._unavailable = False

    def start_child(self, code: str, args: list[str], env: dict[str, str], answer_file: Any) -> Any:
        from oom_magic.checkpoints import config_size

        if (not sys.platform.startswith("linux") or self._unavailable
                or (self._env is not None and _settings(env) != _settings(self._env))):
            return config_size._popen(code, args, env, answer_file)
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._start(env)
            except RuntimeError:  # no torch or transformers here (make test-pythons): fresh children
                self._unavailable = True
                return config_size._popen(code, args, env, answer_file)
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        fd, status_file = tempfile.mkstemp(prefix="oom-magic-child-")
        os.close(fd)
        Path(status_file).write_text("")
        # the answer file is unnamed (TemporaryFile): the child opens it through this process's fd
        request = {"code": code, "args": list(args), "stdout": f"/proc/{os.getpid()}/fd/{answer_file.fileno()}",
                   "status": status_file}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return ForkedChild(int(self._proc.stdout.readline()), status_file)

    def _start(self, env: dict[str, str]) -> None:
        self._env = dict(env)
        self._proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=env)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the sizing zygote did not start")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
