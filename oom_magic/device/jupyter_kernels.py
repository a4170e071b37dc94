"""Name the notebook behind another process on the GPU when it is a Jupyter kernel of this user's own server.

For pids holding the device, ``find_jupyter_kernels`` reads this user's Jupyter runtime directory
(``jpserver-*.json`` / ``nbserver-*.json``: url, token, pid), asks each live server of this user
for its sessions on loopback with that server's own token, and matches a kernel's id to the
process whose command line names its connection file ``kernel-<id>.json``. The answer is the
notebook path and how to stop the kernel (the notebook's menu, or ``kill <pid>``); the token
never appears in it.

Privacy and safety: runtime files not owned by this user, unreadable ones and malformed ones are
skipped silently; other users' processes are never read beyond their owner; only loopback is
contacted (a server bound to a wildcard address is reached through loopback; any other host is
refused); the server's pid must be a live process of this user listening on the port, so a token
is never sent to a port someone else took over; no proxy, no redirects, a short timeout per
server (``urllib`` only). Unreachable, https, unix-socket and token-less servers give nothing.
Nothing here raises for any of those. POSIX only (user ids); elsewhere the answer is empty.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

from ..records.snapshot import KernelInfo  # re-exported: the record of one kernel

__all__ = ["KernelInfo", "find_jupyter_kernels"]

_RUNTIME_PATTERNS = ("jpserver-*.json", "nbserver-*.json")
_CONNECTION_FILE = re.compile(r"kernel-([A-Za-z0-9][A-Za-z0-9_.-]*)\.json")
_MAX_RESPONSE = 4 << 20  # a sessions list is kilobytes; never read more than this
# Bind addresses reached through loopback: wildcards (every interface) and the name localhost.
_LOOPBACK_FOR = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "localhost": "127.0.0.1"}


def _psutil() -> Any:
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def _is_mine(process: Any) -> bool:
    """Whether a process runs as this user (POSIX uids; elsewhere nothing is ours to query)."""
    return process.uids().real == os.getuid()


def _kernel_id_of(pid: int, psutil: Any) -> str | None:
    """The kernel id in a process's connection-file argument, for this user's processes only."""
    try:
        process = psutil.Process(pid)
        if not _is_mine(process):
            return None  # another user's process: its command line is not ours to read
        cmdline = process.cmdline()
    except Exception:
        return None
    for arg in cmdline or ():
        base = re.split(r"[/\\=]", arg)[-1]
        match = _CONNECTION_FILE.fullmatch(base)
        if match:
            return match.group(1)
    return None


def _runtime_dir(runtime_dir: str | os.PathLike[str] | None) -> Path | None:
    if runtime_dir is not None:
        return Path(runtime_dir)
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except Exception:
        return None
    try:
        return Path(jupyter_runtime_dir())
    except Exception:
        return None


def _server_infos(directory: Path) -> list[dict[str, Any]]:
    """This user's readable, well-formed server files in the runtime directory, newest first."""
    found: list[tuple[float, dict[str, Any]]] = []
    uid = os.getuid()
    for pattern in _RUNTIME_PATTERNS:
        try:
            paths = list(directory.glob(pattern))
        except OSError:
            return []
        for path in paths:
            try:
                info = path.lstat()
                if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                    continue  # another user's file, or a link: never read
                with open(path, encoding="utf-8") as handle:
                    data = json.load(handle)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                found.append((info.st_mtime, data))
    found.sort(key=lambda item: -item[0])
    return [data for _, data in found]


def _loopback_host(info: dict[str, Any]) -> str | None:
    """The loopback address to reach this server on, or None when it is bound elsewhere."""
    host = info.get("hostname")
    if not isinstance(host, str):
        host = urlsplit(str(info.get("url") or "")).hostname or ""
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_FOR:
        return _LOOPBACK_FOR[host]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a DNS name other than localhost: refuse rather than resolve
    return str(address) if address.is_loopback else None


def _listens(process: Any, port: int) -> bool | None:
    """Whether the process has a listening socket on ``port``; None when that cannot be read."""
    reader = getattr(process, "net_connections", None) or getattr(process, "connections", None)
    if reader is None:
        return None
    try:
        connections = reader(kind="inet")
    except Exception:
        return None
    return any(c.status == "LISTEN" and c.laddr and c.laddr.port == port for c in connections)


def _server_is_mine(info: dict[str, Any], port: int, psutil: Any) -> bool:
    pid = info.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if not _is_mine(process) or not process.is_running():
            return False
    except Exception:
        return False
    return _listens(process, port) is not False


def _display_url(info: dict[str, Any], host: str, port: int, base_url: str) -> str:
    url = info.get("url")
    if isinstance(url, str) and url:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]  # drop any user:password@
        return urlunsplit((parts.scheme, netloc, parts.path or "/", "", ""))
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{base_url}"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect: it would carry the token to wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _get_json(url: str, token: str, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}", "Accept": "application/json"})
    with _OPENER.open(request, timeout=timeout) as response:
        body = response.read(_MAX_RESPONSE + 1)
    if len(body) > _MAX_RESPONSE:
        return None
    return json.loads(body.decode("utf-8"))


def _stop_hint(notebook_path: str | None, server_url: str, pid: int) -> str:
    if notebook_path:
        return f"Kernel → Shut Down Kernel in {notebook_path} (Jupyter at {server_url}), or `kill {pid}`"
    return f"shut it down in the Running Terminals and Kernels panel of Jupyter at {server_url}, or `kill {pid}`"


def _query_server(info: dict[str, Any], wanted: dict[str, int], psutil: Any, timeout: float) -> dict[int, KernelInfo]:
    """Ask one server about the wanted kernel ids; {} on any problem."""
    token = info.get("token")
    port = info.get("port")
    if not isinstance(token, str) or not token or isinstance(port, bool) or not isinstance(port, int):
        return {}
    if info.get("sock") or info.get("secure"):
        return {}  # unix-socket and https servers are not contacted
    host = _loopback_host(info)
    if host is None or not _server_is_mine(info, port, psutil):
        return {}
    base_url = str(info.get("base_url") or "/")
    base_url = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"
    shown = f"[{host}]" if ":" in host else host
    api = f"http://{shown}:{port}{base_url}api/"
    server_url = _display_url(info, host, port, base_url)
    deadline = time.monotonic() + timeout
    found: dict[int, KernelInfo] = {}
    try:
        sessions = _get_json(api + "sessions", token, timeout)
    except Exception:
        return {}
    for session in sessions if isinstance(sessions, list) else ():
        if not isinstance(session, dict) or not isinstance(session.get("kernel"), dict):
            continue
        kernel_id = session["kernel"].get("id")
        if kernel_id not in wanted:
            continue
        path = session.get("path")
        if not isinstance(path, str) and isinstance(session.get("notebook"), dict):
            path = session["notebook"].get("path")  # notebook < 5 sessions API
        path = path if isinstance(path, str) and path else None
        pid = wanted[kernel_id]
        found[pid] = KernelInfo(path, kernel_id, server_url, _stop_hint(path, server_url, pid))
    missing = {k: p for k, p in wanted.items() if p not in found}
    remaining = deadline - time.monotonic()
    if missing and remaining > 0.05:
        try:
            kernels = _get_json(api + "kernels", token, remaining)
        except Exception:
            kernels = None
        for kernel in kernels if isinstance(kernels, list) else ():
            kernel_id = kernel.get("id") if isinstance(kernel, dict) else None
            if kernel_id in missing:
                pid = missing[kernel_id]
                found[pid] = KernelInfo(None, kernel_id, server_url, _stop_hint(None, server_url, pid))
    return found


def find_jupyter_kernels(
    pids: Iterable[int],
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
    timeout: float = 1.0,
) -> dict[int, KernelInfo]:
    """For those ``pids`` that are kernels of this user's Jupyter servers: ``{pid: KernelInfo}``.

    ``runtime_dir`` defaults to ``jupyter_core.paths.jupyter_runtime_dir()``; ``timeout`` (seconds,
    at most 1) bounds each server. Servers are asked only when a pid's command line names a
    kernel connection file, and only until every such kernel is named. Never raises.
    """
    try:
        psutil = _psutil()
        if psutil is None:
            return {}
        timeout = min(max(float(timeout), 0.05), 1.0)
        wanted: dict[str, int] = {}
        for pid in pids:
            kernel_id = _kernel_id_of(int(pid), psutil)
            if kernel_id is not None:
                wanted.setdefault(kernel_id, int(pid))
        if not wanted:
            return {}
        directory = _runtime_dir(runtime_dir)
        if directory is None:
            return {}
        found: dict[int, KernelInfo] = {}
        for info in _server_infos(directory):
            pending = {k: p for k, p in wanted.items() if p not in found}
            if not pending:
                break
            found.update(_query_server(info, pending, psutil, timeout))
        return found
    except Exception:
        return {}
