"""Real-browser fixtures: JupyterLab on a loopback port, driven by Debian's Chromium through Playwright.

Nothing is downloaded: Playwright's bundled browsers are never used, only the system Chromium
(``/usr/bin/chromium``, installed by ``.ci/run`` when missing). Without it (or without the
playwright package) these tests skip, except under ``CI=true``, where that is a failure.
Every wait is bounded, and the server, its kernels and the browser are always torn down.
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
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "test-output" / "ui"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
SERVER_START_S = 90
SHUTDOWN_S = 15


def _missing(reason: str) -> None:
    """Skip with ``reason``, or fail under CI=true where the browser must be there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}: .ci/run installs chromium; `make test` installs playwright")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """The system Chromium's path (skips, or fails under CI=true, when there is none)."""
    for candidate in CHROMIUM_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    _missing("no Chromium at /usr/bin/chromium (apt-get install chromium)")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def sync_api():  # type: ignore[no-untyped-def]
    """playwright.sync_api (skips, or fails under CI=true, when playwright is not installed)."""
    try:
        from playwright import sync_api
    except ImportError:
        _missing("the playwright package is not installed (pip install -e '.[ui]')")
    return sync_api


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class JupyterLab:
    """A running JupyterLab server: where it listens, its token, its root and its log."""

    process: subprocess.Popen[bytes]
    port: int
    token: str
    root: Path
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """An authenticated URL under the server (``lab/tree/x.ipynb``)."""
        return f"{self.base_url}/{path}?token={self.token}"

    def api(self, path: str, method: str = "GET", timeout: float = 5) -> object:
        """Call the REST API; returns the decoded JSON (None for an empty body)."""
        request = urllib.request.Request(f"{self.base_url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, deterministic Lab: every cell in the DOM, no news, no update check."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, value in files.items():
        path = settings_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def start_lab(root: Path, state: Path, log: Path) -> JupyterLab:
    """Start ``jupyter lab`` on a free loopback port with a token; return once its API answers."""
    port, token = _free_port(), secrets.token_hex(24)
    settings, workspaces, runtime = state / "settings", state / "workspaces", state / "runtime"
    config, ipython = state / "config", state / "ipython"
    for folder in (settings, workspaces, runtime, config, ipython):
        folder.mkdir(parents=True, exist_ok=True)
    _lab_settings(settings)
    # The user's own Jupyter and IPython config and startup files stay out of the test.
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(config),
               IPYTHONDIR=str(ipython), PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI and containers run as root
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=root, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    lab = JupyterLab(process, port, token, root, log)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {process.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("status", timeout=2)
            return lab
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.3)
    stop_lab(lab)
    raise RuntimeError(f"jupyter lab did not answer within {SERVER_START_S} s:\n{lab.log_tail()}")


def stop_lab(lab: JupyterLab) -> None:
    """Shut the server and its kernels down; escalate to SIGTERM/SIGKILL of exactly those pids."""
    import psutil

    try:
        children = psutil.Process(lab.process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if lab.process.poll() is None:
        try:
            lab.api("shutdown", method="POST", timeout=5)  # shuts its kernels down too
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        try:
            lab.process.wait(SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            lab.process.send_signal(signal.SIGTERM)
            try:
                lab.process.wait(5)
            except subprocess.TimeoutExpired:
                lab.process.kill()
                lab.process.wait(5)
    # Kernels run in sessions of their own: end any the shutdown left, by pid.
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass


@pytest.fixture
def lab_root(tmp_path: Path) -> Path:
    """A temporary root for the server, holding a copy of notebooks/quickstart.ipynb."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "quickstart.ipynb", root / "quickstart.ipynb")
    return root


@pytest.fixture
def jupyter_lab(lab_root: Path, tmp_path: Path) -> Iterator[JupyterLab]:
    """JupyterLab serving ``lab_root``; always shut down, its log kept in test-output/ui/."""
    lab = start_lab(lab_root, tmp_path / "lab-state", OUTPUT / "jupyterlab.log")
    try:
        yield lab
    finally:
        stop_lab(lab)


@pytest.fixture
def browser_page(sync_api, chromium_path: str):  # type: ignore[no-untyped-def]
    """A page in headless system Chromium (never a downloaded browser); closed afterwards."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path, headless=True, timeout=60_000,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                  "--disable-extensions", "--disable-background-networking"],
        )
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
            context.set_default_timeout(30_000)
            page = context.new_page()
            yield page
        finally:
            browser.close()
