"""find_jupyter_kernels against a real Jupyter server on loopback with real kernels.

The module fixture starts ``jupyter server`` on a free loopback port with its own runtime
directory, opens two notebooks' sessions and one bare kernel through the REST API, and finds
each kernel's real pid with psutil. Servers that must never be contacted point at a small
recording HTTP server in this process, so a test can prove no request was made.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from oom_magic.device.jupyter_kernels import KernelInfo, _loopback_host, find_jupyter_kernels

# A real Jupyter server and kernels: the "jupyter" xdist group runs them on one worker, one after another.
pytestmark = pytest.mark.xdist_group("jupyter")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user (uid 65534) needs root")

_NO_EXTENSIONS = ("{'jupyterlab': False, 'jupyter_lsp': False, 'jupyter_server_terminals': False, "
                  "'notebook_shim': False, 'notebook': False}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(port: int, token: str, method: str, path: str, body: dict | None = None, timeout: float = 20.0):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/{path}", data=data, method=method,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text else None


def _pid_of_kernel(kernel_id: str, deadline: float) -> int:
    needle = f"kernel-{kernel_id}.json"
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["pid", "cmdline"]):
            if any(needle in arg for arg in process.info["cmdline"] or ()):
                return process.info["pid"]
        time.sleep(0.1)
    raise AssertionError(f"no process runs kernel {kernel_id}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("jupyter")
    root, runtime, config = base / "root", base / "runtime", base / "config"
    for folder in (root / "sub", runtime, config):
        folder.mkdir(parents=True)
    for name in ("a.ipynb", "sub/b.ipynb"):
        # An empty nbformat-4 notebook, written by hand (importing nbformat costs seconds).
        (root / name).write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(config))
    command = [sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               "--ServerApp.port_retries=0", f"--ServerApp.jpserver_extensions={_NO_EXTENSIONS}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = open(base / "server.log", "wb")  # noqa: SIM115 (the server writes it until the fixture ends; closed there)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    kernel_pids: list[int] = []
    sessions: list[str] = []
    try:
        deadline = time.monotonic() + 25
        info_file = runtime / f"jpserver-{process.pid}.json"
        while not info_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("jupyter server did not start:\n" + (base / "server.log").read_text())
            time.sleep(0.1)
        while True:  # the info file can appear just before the port accepts connections
            try:
                _api(port, token, "GET", "status", timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        a = _api(port, token, "POST", "sessions",
                 {"path": "a.ipynb", "name": "a.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
        b = _api(port, token, "POST", "sessions",
                 {"path": "sub/b.ipynb", "name": "b.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
        bare = _api(port, token, "POST", "kernels", {"name": "python3"})
        sessions += [a["id"], b["id"]]
        kernels = {"a": a["kernel"]["id"], "b": b["kernel"]["id"], "bare": bare["id"]}
        pids = {key: _pid_of_kernel(kid, deadline) for key, kid in kernels.items()}
        kernel_pids += list(pids.values())
        yield SimpleNamespace(port=port, token=token, runtime=runtime, info_file=info_file,
                              server_pid=process.pid, kernels=kernels, pids=pids)
    finally:
        for session_id in sessions:
            try:
                _api(port, token, "DELETE", f"sessions/{session_id}", timeout=5)
            except Exception:
                pass
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for pid in kernel_pids:  # kernels this server started, if its shutdown left any
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        log.close()


class _Recorder:
    """A loopback HTTP server in this process that answers [] and records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorder.requests.append((self.path, self.headers.get("Authorization")))
                body = b"[]"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def recorder():
    rec = _Recorder()
    yield rec
    rec.close()


def _server_file(directory: Path, name: str, **fields) -> Path:
    info = {"base_url": "/", "hostname": "127.0.0.1", "password": False, "pid": os.getpid(),
            "root_dir": "/nowhere", "secure": False, "sock": "", "version": "2.21.1"}
    info.update(fields)
    info.setdefault("url", f"http://{info['hostname']}:{info.get('port')}/")
    path = directory / name
    path.write_text(json.dumps(info))
    return path


# -- the real server ------------------------------------------------------------------------------

def test_each_kernel_maps_to_its_notebook(server):
    pids = server.pids
    found = find_jupyter_kernels([pids["a"], pids["b"], os.getpid(), server.server_pid, 999_999_999],
                                 runtime_dir=server.runtime)
    url = f"http://localhost:{server.port}/"
    assert found == {
        pids["a"]: KernelInfo("a.ipynb", server.kernels["a"], url,
                              f"Kernel → Shut Down Kernel in a.ipynb (Jupyter at {url}), or `kill {pids['a']}`"),
        pids["b"]: KernelInfo("sub/b.ipynb", server.kernels["b"], url,
                              f"Kernel → Shut Down Kernel in sub/b.ipynb (Jupyter at {url}), or `kill {pids['b']}`"),
    }
    assert server.token not in repr(found)


def test_a_kernel_without_a_notebook_is_named_by_its_server(server):
    pid = server.pids["bare"]
    found = find_jupyter_kernels([pid], runtime_dir=server.runtime)
    url = f"http://localhost:{server.port}/"
    assert found == {pid: KernelInfo(None, server.kernels["bare"], url,
                                     f"shut it down in the Running Terminals and Kernels panel of Jupyter at "
                                     f"{url}, or `kill {pid}`")}


def test_the_users_runtime_dir_is_the_default(server, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(server.runtime))
    found = find_jupyter_kernels([server.pids["a"]])
    assert found[server.pids["a"]].notebook_path == "a.ipynb"


# -- servers and processes that are never queried -------------------------------------------------

@needs_root
def test_another_users_runtime_file_is_skipped_silently(server, recorder, tmp_path):
    """A runtime file owned by uid 65534 (and mode 000) is neither read nor its server contacted."""
    shutil.copy(server.info_file, tmp_path / server.info_file.name)  # this user's real server
    other = _server_file(tmp_path, "jpserver-4242.json", port=recorder.port, token="their-token")
    os.chown(other, 65534, 65534)
    other.chmod(0o000)
    found = find_jupyter_kernels([server.pids["a"], server.pids["b"]], runtime_dir=tmp_path)
    assert {info.notebook_path for info in found.values()} == {"a.ipynb", "sub/b.ipynb"}
    assert recorder.requests == []
    # The same file, owned by this user, is read and its server is asked (with its own token).
    os.chown(other, os.getuid(), os.getgid())
    other.chmod(0o600)
    (tmp_path / server.info_file.name).unlink()
    assert find_jupyter_kernels([server.pids["a"]], runtime_dir=tmp_path) == {}
    assert recorder.requests == [("/api/sessions", "token their-token"), ("/api/kernels", "token their-token")]


@needs_root
def test_another_users_process_is_not_read(server, tmp_path):
    """Its command line names a real kernel's connection file, but it is not this user's process."""
    shutil.copy(server.info_file, tmp_path / server.info_file.name)
    impostor = subprocess.Popen(["/bin/sh", "-c", "sleep 30", f"kernel-{server.kernels['a']}.json"],
                                user=65534, group=65534, cwd="/")
    try:
        deadline = time.monotonic() + 5
        while impostor.pid not in psutil.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(impostor.pid).uids().real == 65534
        assert find_jupyter_kernels([impostor.pid], runtime_dir=tmp_path) == {}
    finally:
        impostor.kill()
        impostor.wait(timeout=5)


def test_servers_that_give_nothing(server, recorder, tmp_path):
    pid = server.pids["a"]
    _server_file(tmp_path, "jpserver-1.json", port=recorder.port, token="")                 # token-less
    _server_file(tmp_path, "jpserver-2.json", port=recorder.port, token="t", pid=999_999_999)  # stale
    _server_file(tmp_path, "jpserver-3.json", port=recorder.port, token="t", hostname="192.0.2.10")
    _server_file(tmp_path, "jpserver-4.json", port=recorder.port, token="t", hostname="example.com")
    _server_file(tmp_path, "jpserver-5.json", port=recorder.port, token="t", secure=True)
    _server_file(tmp_path, "jpserver-6.json", port=recorder.port, token="t", sock="/tmp/jupyter.sock")
    _server_file(tmp_path, "jpserver-7.json", port=_free_port(), token="t")  # this process does not listen there
    (tmp_path / "jpserver-8.json").write_text("{not json")
    (tmp_path / "nbserver-9.json").write_text("[1, 2]")
    os.symlink(server.info_file, tmp_path / "jpserver-10.json")  # a link is never followed
    assert find_jupyter_kernels([pid], runtime_dir=tmp_path) == {}
    assert recorder.requests == []


def test_an_unresponsive_server_times_out_quietly(server, tmp_path):
    """A socket of this process that accepts connections but never answers."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        _server_file(tmp_path, "jpserver-1.json", port=silent.getsockname()[1], token="t")
        started = time.monotonic()
        assert find_jupyter_kernels([server.pids["a"]], runtime_dir=tmp_path, timeout=0.3) == {}
        assert time.monotonic() - started < 5  # bounded by the timeout, not hanging
    finally:
        silent.close()


def test_no_kernel_pids_no_requests(recorder, tmp_path):
    _server_file(tmp_path, "jpserver-1.json", port=recorder.port, token="t")
    assert find_jupyter_kernels([os.getpid(), 999_999_999], runtime_dir=tmp_path) == {}
    assert recorder.requests == []


def test_missing_runtime_dir(server, tmp_path):
    assert find_jupyter_kernels([server.pids["a"]], runtime_dir=tmp_path / "absent") == {}


@pytest.mark.parametrize("info, host", [
    ({"hostname": "localhost"}, "127.0.0.1"),
    ({"hostname": "127.0.0.1"}, "127.0.0.1"),
    ({"hostname": "127.0.1.1"}, "127.0.1.1"),
    ({"hostname": "::1"}, "::1"),
    ({"hostname": "[::1]"}, "::1"),
    ({"hostname": "0.0.0.0"}, "127.0.0.1"),   # bound everywhere: reached through loopback
    ({"hostname": "::"}, "::1"),
    ({"hostname": ""}, "127.0.0.1"),
    ({"url": "http://localhost:8888/"}, "127.0.0.1"),
    ({"hostname": "192.168.1.5"}, None),
    ({"hostname": "10.0.0.1"}, None),
    ({"hostname": "example.com"}, None),
    ({"url": "http://gpu-box.internal:8888/"}, None),
])
def test_only_loopback_is_contacted(info, host):
    assert _loopback_host(info) == host


# -- %gpumem's process table, against the real server ---------------------------------------------

def test_gpumem_names_the_notebook_of_another_kernel_on_the_gpu(use_nvml, server, ip, monkeypatch):
    """FAKE NVML (no GPU here) lists two real kernels of the real server beside this process."""
    from oom_magic.device.nvml import Nvml
    from oom_magic.render.html import snapshot_html
    from oom_magic.render.text import snapshot_text
    from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, GiB

    a, bare = server.pids["a"], server.pids["bare"]
    gpu = FakeGpu(used=6 * GiB, processes=[(a, 3 * GiB), (bare, 2 * GiB), (os.getpid(), 1 * GiB)])
    use_nvml(Nvml(FakeNvml([gpu]).module))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(server.runtime))
    ip.run_cell("import torch", store_history=True)
    snap = ip.run_line_magic("gpumem", "-o --device cuda:0")
    text, html = snapshot_text(snap), snapshot_html(snap)
    url = f"http://localhost:{server.port}/"
    row = next(line for line in text.splitlines() if f"pid {a}" in line)
    assert "Jupyter kernel of a.ipynb" in row and row.endswith("3.00 GiB")
    assert f"  to stop pid {a}: Kernel → Shut Down Kernel in a.ipynb (Jupyter at {url}), or `kill {a}`" in text
    assert (f"  to stop pid {bare}: shut it down in the Running Terminals and Kernels panel of Jupyter at {url}, "
            f"or `kill {bare}`") in text
    assert "<td style='text-align:left'>a.ipynb</td>" in html and f"or `kill {a}`</td>" in html
    assert server.token not in text and server.token not in html
