"""Hub models not in the cache, sized from config.json and safetensors headers over the network.

The real huggingface_hub client (in a child process, with HF_ENDPOINT set before it is imported)
talks to tests/hubserver.py: a real HTTP server on 127.0.0.1 serving Llama-2-7B's layout as real
headers over sparse files. The server counts the bytes it sends: no test may see a weight byte.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.hubserver import GOOD_TOKEN, LLAMA7B_PARAMETERS, HubServer, Repo, llama7b_repo, sparse_safetensors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("hub")
    with HubServer() as server:
        server.repos["org/llama7b"] = llama7b_repo(base / "llama7b")
        server.repos["org/gated7b"] = llama7b_repo(base / "gated7b", gated=True)
        bins = base / "binonly"
        bins.mkdir()
        (bins / "config.json").write_text("{}")
        (bins / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
        server.repos["org/binonly"] = Repo({"config.json": bins / "config.json",
                                            "pytorch_model.bin": bins / "pytorch_model.bin"})
        hostile = base / "hostile"
        hostile.mkdir()
        with open(hostile / "model.safetensors", "wb") as handle:  # a 50 MB header length, in a sparse file
            handle.write(struct.pack("<Q", 50_000_000))
            handle.truncate(2 << 30)
        server.repos["org/hostile"] = Repo({"model.safetensors": hostile / "model.safetensors"})
        huge = base / "hugeconfig"
        huge.mkdir()
        with open(huge / "config.json", "wb") as handle:  # 20 MB of config: over the bound, never fetched
            handle.truncate(20 << 20)
        sparse_safetensors(huge / "model.safetensors", {"w": ("F16", (4, 4))})
        server.repos["org/hugeconfig"] = Repo({"config.json": huge / "config.json",
                                               "model.safetensors": huge / "model.safetensors"})
        server.base = base  # type: ignore[attr-defined]
        yield server


def _env(hub: HubServer, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"),
               PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
    env.update(extra)
    return env


def _fit(hub: HubServer, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "oom_magic", "fit", *args], env=_env(hub, tmp_path, **env),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return done, time.monotonic() - started


@pytest.fixture(autouse=True)
def _counts_from_zero(request: pytest.FixtureRequest) -> None:
    """Each test counts the bytes it made the hub send: huggingface_hub's own header reader (the
    protocol test) reads past a header, which a later test in the same module must not see as its own."""
    if "hub" in request.fixturenames:
        request.getfixturevalue("hub").reset_counts()


def test_an_uncached_7b_fits_a_t4_from_its_headers_and_no_weight_byte_is_served(hub, tmp_path):
    before = hub.weight_bytes_sent()
    done, _ = _fit(hub, tmp_path, "org/llama7b", "--target", "T4")
    assert done.returncode == 0, done.stderr
    assert f"{LLAMA7B_PARAMETERS:,} parameters, 12.55 GiB as float16" in done.stdout
    assert "read 2 headers, " in done.stdout and "from the hub (org/llama7b at " in done.stdout
    assert "the download is 12.55 GiB" in done.stdout
    assert hub.weight_bytes_sent() == before == 0
    assert not (tmp_path / "cache" / "models--org--llama7b").exists()  # nothing was downloaded into the cache


def test_float32_will_not_fit_a_t4_exit_1(hub, tmp_path):
    done, _ = _fit(hub, tmp_path, "org/llama7b", "--target", "T4", "--dtype", "float32")
    assert done.returncode == 1, done.stderr
    assert "WILL NOT FIT on a T4: needs 25.10 GiB, " in done.stdout
    assert hub.weight_bytes_sent() == 0


def test_a_job_on_an_uncached_7b_is_sized_from_the_hubs_config_and_headers(hub, tmp_path):
    """issue 23 + 22: the job sizes apply to a hub id too: the KV cache from the config the hub sent."""
    done, _ = _fit(hub, tmp_path, "org/llama7b", "--target", "T4", "--dtype", "bfloat16", "--context", "4096",
                   "--json")
    assert done.returncode == 1, done.stderr  # 12.55 GiB of weights and a 2 GiB cache do not fit a T4
    check = json.loads(done.stdout)
    parts = check["checks"][0]["parts"] if "checks" in check else check["parts"]
    # Llama-2-7B: 32 layers x 2 (K, V) x 32 heads x 128 x 2 bytes = 512 KiB a token, 4,096 tokens
    assert parts["kv_cache"] == 32 * 2 * 32 * 128 * 2 * 4096
    assert parts["weights"] == 2 * LLAMA7B_PARAMETERS
    assert hub.weight_bytes_sent() == 0


def test_remote_estimate_equals_the_local_one_and_is_read_once_per_revision(hub, tmp_path):
    from oom_magic.checkpoints.estimate import estimate_checkpoint

    local = estimate_checkpoint(hub.base / "llama7b", dtype="bfloat16")  # type: ignore[attr-defined]
    script = textwrap.dedent("""
        import json
        from oom_magic import estimate_checkpoint
        first = estimate_checkpoint("org/llama7b", dtype="bfloat16")
        again = estimate_checkpoint("org/llama7b", dtype="bfloat16", revision=first.hub.revision)
        print(json.dumps([first.parameters, first.stored_bytes, first.bytes, first.format, list(first.files),
                          first.declared_dtype, first.hub.headers, first.hub.bytes_read, first.hub.download_bytes,
                          again is not None and again.hub is first.hub]))
        import sys
        assert "torch" not in sys.modules and "transformers" not in sys.modules  # the read imports neither
    """)
    requests_before = len(hub.requests)
    done = subprocess.run([sys.executable, "-c", script], env=_env(hub, tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    params, stored, loaded, fmt, files, declared, headers, read, download, same = json.loads(done.stdout)
    assert (params, stored, loaded) == (local.parameters, local.stored_bytes, local.bytes) == (
        LLAMA7B_PARAMETERS, 2 * LLAMA7B_PARAMETERS, 2 * LLAMA7B_PARAMETERS)
    assert fmt == "safetensors-sharded" and files == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]
    assert declared == "float16" and headers == 2 and same  # the second call was answered from the cache
    shard_sizes = sum(p.stat().st_size for p in (hub.base / "llama7b").glob("*.safetensors"))  # type: ignore[attr-defined]
    assert download == shard_sizes
    served = [r for r in hub.requests[requests_before:] if r[1].startswith("/org/llama7b/")]
    assert len([r for r in served if r[0] == "GET"]) == 2 + 2 * 2  # config, index; length + header per shard
    assert read < 100_000 and hub.weight_bytes_sent() == 0


def test_a_gated_repo_names_the_fix_and_a_token_opens_it(hub, tmp_path):
    done, elapsed = _fit(hub, tmp_path, "org/gated7b", "--target", "T4")
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and "org/gated7b is gated: accept its licence on " in line and "HF_TOKEN" in line
    opened, _ = _fit(hub, tmp_path, "org/gated7b", "--target", "T4", HF_TOKEN=GOOD_TOKEN)
    assert opened.returncode == 0, opened.stderr
    assert hub.weight_bytes_sent() == 0


@pytest.mark.parametrize(("args", "expected"), [
    (("org/nosuchmodel",), "no model org/nosuchmodel on the hub at "),
    (("org/llama7b", "--revision", "v9"), "org/llama7b has no revision 'v9' on the hub"),
    (("org/binonly",), "org/binonly has no model.safetensors or model.safetensors.index.json"),
    (("org/hostile",), "header of 50000000 bytes is over the 4194304 bytes oom-magic reads"),
    (("org/hugeconfig",), "config.json is 20971520 bytes, over the 16777216 oom-magic reads"),
])
def test_missing_or_hostile_repos_are_one_line_with_exit_2(hub, tmp_path, args, expected):
    done, _ = _fit(hub, tmp_path, *args, "--target", "T4")
    assert done.returncode == 2
    assert expected in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert hub.weight_bytes_sent() == 0


def test_a_stalling_hub_is_one_line_within_the_bound(hub, tmp_path):
    hub.stall = True
    try:
        done, elapsed = _fit(hub, tmp_path, "org/llama7b", "--target", "T4", "--hub-timeout", "2")
    finally:
        hub.stall = False
    assert done.returncode == 2
    assert "did not answer within 2 s" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert elapsed < 2 + 8  # the bound plus the child's start (imports), never the stall's 60 s


def test_no_network_and_offline_mode_are_one_line_with_exit_2(hub, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    done, _ = _fit(hub, tmp_path, "org/llama7b", "--target", "T4", HF_ENDPOINT=closed)
    assert done.returncode == 2 and "cannot reach the hub at " + closed in done.stderr, done.stderr
    before = len(hub.requests)
    offline, elapsed = _fit(hub, tmp_path, "org/llama7b", "--target", "T4", HF_HUB_OFFLINE="1")
    assert offline.returncode == 2
    assert "HF_HUB_OFFLINE=1 is set, so nothing was checked" in offline.stderr, offline.stderr
    assert len(hub.requests) == before  # not one request


def test_a_bad_hub_timeout_is_one_line(hub, tmp_path):
    done, _ = _fit(hub, tmp_path, "org/llama7b", "--hub-timeout", "0")
    assert done.returncode == 2 and "the hub timeout must be a positive number of seconds" in done.stderr


def _guarded_cell(hub: HubServer, tmp_path: Path, line: str, cell: str, setup: str = "") -> str:
    """Run one %%guardload cell in a real IPython shell in a child process pointed at the local hub."""
    script = "\n".join([
        "from IPython.testing.globalipapp import start_ipython",
        "ip = start_ipython()",
        "ip.run_line_magic('load_ext', 'oom_magic')",
        setup,
        f"r = ip.run_cell({('%%guardload ' + line + chr(10) + cell)!r})",
        "print('ERROR:', type(r.error_in_exec).__name__, r.error_in_exec)",
        "print('RAN:', ip.user_ns.get('ran'))",
    ])
    done = subprocess.run([sys.executable, "-c", script], env=_env(hub, tmp_path), capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_strict_refuses_a_too_big_uncached_model_before_a_weight_byte_is_fetched(hub, tmp_path):
    sent = dict(hub.sent)
    out = _guarded_cell(hub, tmp_path, "--target T4 --strict", "\n".join([
        "import torch",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained('org/llama7b', dtype=torch.float32)",
        "ran = True",
    ]))
    assert "read 2 headers, " in out and "the download is 12.55 GiB, " in out
    assert "ERROR: UsageError --strict: line 3 will not fit on a T4: needs 25.10 GiB, 11.78 GiB short" in out
    assert "RAN: None" in out
    assert hub.weight_bytes_sent() == 0
    new = {k: v - sent.get(k, 0) for k, v in hub.sent.items() if v != sent.get(k, 0)}
    assert sum(new.values()) < 100_000  # config, index and two headers: what the hub line says was read


def test_a_stalled_hub_leaves_the_cell_to_run_and_says_nothing_was_checked(hub, tmp_path):
    hub.stall = True
    try:
        started = time.monotonic()
        out = _guarded_cell(hub, tmp_path, "--strict", "\n".join([
            "ran = True",
            "if not ran:",
            "    model = AutoModelForCausalLM.from_pretrained('org/llama7b')",
        ]), setup="ip.run_line_magic('config', 'OomMagics.hub_timeout = 2')")
        elapsed = time.monotonic() - started
    finally:
        hub.stall = False
    assert "not checked: cannot size org/llama7b: the hub at " in out  # the id said once (issue 25.10)
    assert "did not answer within 2 s, so nothing was checked" in out
    assert "RAN: True" in out and "ERROR: NoneType None" in out
    assert elapsed < 2 + 15  # the bound plus the child's start, never the stall's 60 s


def test_a_download_larger_than_the_cache_disk_will_not_fit_and_strict_names_it(hub, tmp_path):
    script = "\n".join([
        "from oom_magic.fit.preflight import preflight_check",
        "from oom_magic.guard.printer import refusal_message",
        "from oom_magic.render.fit import verdict_line",
        "cell = \"model = AutoModelForCausalLM.from_pretrained('org/llama7b', dtype='float16')\"",
        "p = preflight_check(cell, {}, target='A100-80GB', disk_bytes=2 << 30)",  # the disk's free bytes, passed in
        "print('SHORT:', p.checks[0].download_short, p.checks[0].verdict, p.fits)",
        "print(verdict_line(p))",
        "print(refusal_message(p))",
        "print(p)",
    ])
    done = subprocess.run([sys.executable, "-c", script], env=_env(hub, tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    download = sum(p.stat().st_size for p in (hub.base / "llama7b").glob("*.safetensors"))  # type: ignore[attr-defined]
    assert f"SHORT: {download - (2 << 30)} fits False" in done.stdout  # fits the GPU, not the disk
    assert "WILL NOT FIT on disk: the download of org/llama7b is 12.55 GiB, 10.55 GiB more than is free" in done.stdout
    assert "--strict: line 1: the download of org/llama7b is 12.55 GiB" in done.stdout
    assert "set HF_HUB_CACHE to a larger disk" in done.stdout
    assert hub.weight_bytes_sent() == 0


def test_the_calls_own_token_opens_a_gated_repo_and_is_never_shown(hub, tmp_path):
    call = "model = AutoModelForCausalLM.from_pretrained('org/gated7b', token={!r})"
    script = "\n".join([
        "from oom_magic.fit.preflight import preflight_check",
        f"p = preflight_check({call.format(GOOD_TOKEN)!r}, {{}}, target='A100-80GB')",
        "print(p.checks[0].verdict, repr(p.checks[0].call))",
        "print(p)",
        f"print(preflight_check({call.format('hf_wrong')!r}, {{}}, target='T4'))",
    ])
    done = subprocess.run([sys.executable, "-c", script], env=_env(hub, tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("fits LoadRequest(") and GOOD_TOKEN not in done.stdout
    assert "not checked: cannot size org/gated7b is gated: accept its licence" in done.stdout  # the id said once


def test_the_local_hub_speaks_the_protocol_the_real_clients_use(hub, tmp_path):
    script = "\n".join([
        "import json",
        "from huggingface_hub import HfApi, get_safetensors_metadata, hf_hub_download",
        "import transformers",
        "api = HfApi()",
        "info = api.model_info('org/llama7b')",
        "tree = sorted(f.path for f in api.list_repo_tree('org/llama7b'))",
        "meta = get_safetensors_metadata('org/llama7b')",
        "config = transformers.AutoConfig.from_pretrained('org/llama7b')",
        "print(json.dumps([info.sha, sorted(s.rfilename for s in info.siblings), tree, sum(meta.parameter_count.values()),"
        " config.hidden_size, config.num_hidden_layers]))",
    ])
    done = subprocess.run([sys.executable, "-c", script], env=_env(hub, tmp_path), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    sha, siblings, tree, parameters, hidden, layers = json.loads(done.stdout.strip().splitlines()[-1])
    assert sha == hub.repos["org/llama7b"].commit and siblings == tree == sorted(hub.repos["org/llama7b"].files)
    assert parameters == LLAMA7B_PARAMETERS  # the hub's own header reader agrees with ours
    assert (hidden, layers) == (4096, 32)


def test_a_hub_timeout_that_cannot_work_is_refused_when_set(ip):
    from traitlets import TraitError

    magics = ip.magics_manager.registry["OomMagics"]
    with pytest.raises(TraitError, match=r"OomMagics.hub_timeout must be a positive number of seconds, not 0"):
        magics.hub_timeout = 0
    assert magics.hub_timeout == 10.0  # unchanged, the default
    magics.hub_timeout = 2.5
    try:
        assert magics.hub_timeout == 2.5
    finally:
        magics.hub_timeout = 10.0
