"""GGUF files sized from their headers: local files written by the gguf package's GGUFWriter with mixed
ggml types (checked against its GGUFReader), llama.cpp's KV cache and GPU/CPU split, and a remote file
read from the local hub (tests/hubserver.py) by growing range reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from oom_magic.checkpoints.gguf import read_gguf_header  # noqa: E402
from oom_magic.fit.gguf_check import gguf_fit_check  # noqa: E402
from oom_magic.fit.llama_cpp import size_llama_cpp  # noqa: E402
from tests.hubserver import HubServer, Repo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def write_sparse_gguf(path: Path, layers: int, embd: int, ffn: int, vocab: int, heads: int, heads_kv: int,
                      ctx: int, tokens: int = 0) -> None:
    """A llama-shaped GGUF as a Q4_K_M file mixes its types: real header, the tensor data a sparse hole."""
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(embd)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads_kv)
    if tokens:
        writer.add_token_list([f"token{i}" for i in range(tokens)])
    head = embd // heads

    def info(name: str, shape: tuple[int, ...], kind: T) -> None:
        block, nbytes = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape))
        byte_shape = (*shape[:-1], shape[-1] // block * nbytes)  # numpy order: the fastest dimension last
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8) if kind not in (T.F32, T.F16) else
                               np.dtype(np.float32 if kind == T.F32 else np.float16),
                               elements // block * nbytes, raw_dtype=kind)

    info("token_embd.weight", (vocab, embd), T.Q4_K)
    for i in range(layers):
        info(f"blk.{i}.attn_norm.weight", (embd,), T.F32)
        info(f"blk.{i}.attn_q.weight", (embd, embd), T.Q4_K)
        info(f"blk.{i}.attn_k.weight", (heads_kv * head, embd), T.Q4_K)
        info(f"blk.{i}.attn_v.weight", (heads_kv * head, embd), T.Q6_K)
        info(f"blk.{i}.attn_output.weight", (embd, embd), T.Q4_K)
        info(f"blk.{i}.ffn_norm.weight", (embd,), T.F32)
        info(f"blk.{i}.ffn_gate.weight", (ffn, embd), T.Q4_K)
        info(f"blk.{i}.ffn_up.weight", (ffn, embd), T.Q4_K)
        info(f"blk.{i}.ffn_down.weight", (embd, ffn), T.Q6_K)
    info("output_norm.weight", (embd,), T.F32)
    info("output.weight", (vocab, embd), T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    reader_end = path.stat().st_size
    total = sum(ti.nbytes for ti in writer.tensors[0].values())
    align = 32
    data_start = -(-reader_end // align) * align
    tail = 0
    for ti in writer.tensors[0].values():
        tail += -(-ti.nbytes // align) * align
    with open(path, "r+b") as handle:
        handle.truncate(data_start + tail)
    assert total <= tail


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf"
    write_sparse_gguf(path, layers=4, embd=256, ffn=512, vocab=1024, heads=8, heads_kv=2, ctx=2048, tokens=300)
    return path


def test_tensor_bytes_equal_the_gguf_readers_by_block_size(small):
    header = read_gguf_header(small)
    reader = gguf.GGUFReader(small)
    theirs = {t.name: (t.tensor_type.name, int(t.n_elements), int(t.n_bytes)) for t in reader.tensors}
    ours = {t.name: (t.ggml_type, t.elements, t.nbytes) for t in header.tensors}
    assert ours == theirs
    assert {t.ggml_type for t in header.tensors} == {"Q4_K", "Q6_K", "F32"}
    assert header.metadata["tokenizer.ggml.tokens"] == ("array", 300)


def test_kv_cache_and_the_gpu_split_follow_llama_cpp(small):
    header = read_gguf_header(small)
    by_name = {t.name: t.nbytes for t in header.tensors}
    full = size_llama_cpp(header, small.name, n_ctx=1024)
    # 4 layers x (K + V) x n_ctx x head_dim 32 x 2 KV heads x 2 bytes (f16)
    assert full.kv_cache_bytes == 4 * 2 * 1024 * 32 * 2 * 2 == 1_048_576
    assert full.gpu_bytes + full.cpu_bytes == full.weights_bytes + full.kv_cache_bytes
    assert full.cpu_bytes == by_name["token_embd.weight"]  # llama.cpp keeps the input layer on the CPU
    two = size_llama_cpp(header, small.name, n_ctx=1024, n_gpu_layers=2)
    layer = lambda i: sum(b for n, b in by_name.items() if n.startswith(f"blk.{i}."))  # noqa: E731
    assert two.gpu_bytes == layer(2) + layer(3) + 2 * 2 * 1024 * 32 * 2 * 2  # the last two blocks and their KV
    q8 = size_llama_cpp(header, small.name, n_ctx=1024, type_k="q8_0", type_v="q8_0")
    assert q8.kv_cache_bytes == 4 * 2 * 1024 * (64 // 32 * 34)  # q8_0: 34 bytes per block of 32
    assert size_llama_cpp(header, small.name).n_ctx == 2048  # the model's context_length by default


def test_the_command_checks_a_local_gguf_against_a_target(small, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "oom_magic", "fit", str(small), "--target", "T4"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "llama.cpp load of tiny-Q4_K_M.gguf" in done.stdout and "fits on a T4" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "oom_magic", "fit", str(tmp_path / "none.gguf"), "--target", "T4"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such GGUF file" in bad.stderr


def test_a_gguf_jobs_context_is_llama_cpps_n_ctx(small):
    # The job flags apply to a GGUF file as llama.cpp runs it: one cache of n_ctx tokens.
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def fit(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "oom_magic", "fit", str(small), "--target", "T4", "--json", *args],
                              env=env, capture_output=True, text=True, timeout=60)

    as_job, as_n_ctx = fit("--context", "1024"), fit("--n-ctx", "1024")
    assert as_job.returncode == 0, as_job.stderr
    assert json.loads(as_job.stdout) == json.loads(as_n_ctx.stdout)
    assert json.loads(as_job.stdout)["kv_cache_bytes"] == 4 * 2 * 1024 * 64 * 2  # 4 layers, K and V, f16
    for args, said in ((("--context", "1024", "--train", "lora"), "--train needs a transformers checkpoint"),
                       (("--context", "1024", "--batch", "4"), "shared by all sequences"),
                       (("--context", "1024", "--n-ctx", "2048"), "give one")):
        refused = fit(*args)
        assert refused.returncode == 2 and said in refused.stdout + refused.stderr, (args, refused)


def test_a_7b_q4_k_m_too_big_for_a_t4_at_long_context(tmp_path):
    path = tmp_path / "llama7b-Q4_K_M.gguf"
    write_sparse_gguf(path, layers=32, embd=4096, ffn=11008, vocab=32000, heads=32, heads_kv=32, ctx=32768)
    load = gguf_fit_check(str(path), target="T4")
    assert load.kv_cache_bytes == 32 * 2 * 32768 * 4096 * 2  # 16 GiB of f16 KV cache at 32k context
    assert load.fits is False
    assert gguf_fit_check(str(path), target="T4", n_ctx=4096).fits is True


def test_a_remote_gguf_is_read_by_growing_range_reads(tmp_path):
    path = tmp_path / "llama7b-Q4_K_M.gguf"
    write_sparse_gguf(path, layers=32, embd=4096, ffn=11008, vocab=32000, heads=32, heads_kv=32, ctx=4096,
                      tokens=32000)
    local = read_gguf_header(path)
    with HubServer() as hub:
        hub.repos["org/llama7b-gguf"] = Repo({"llama7b-Q4_K_M.gguf": path})
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "oom_magic", "fit", "org/llama7b-gguf", "--file",
                               "llama7b-Q4_K_M.gguf", "--target", "T4", "--json"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        import json

        data = json.loads(done.stdout)
        assert data["weights_bytes"] == sum(t.nbytes for t in local.tensors)
        assert data["parameters"] == sum(t.elements for t in local.tensors)
        sent = hub.sent["org/llama7b-gguf/llama7b-Q4_K_M.gguf"]
        assert local.header_bytes <= sent < 4 * local.header_bytes + 64 * 1024  # the header, never the weights
        assert data["hub"]["bytes_read"] == sent and data["hub"]["download_bytes"] == path.stat().st_size
        missing = subprocess.run([sys.executable, "-m", "oom_magic", "fit", "org/llama7b-gguf", "--file", "x.gguf"],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2 and "org/llama7b-gguf has no file x.gguf" in missing.stderr


@pytest.fixture(scope="module")
def llama7b_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf7b") / "llama7b-Q4_K_M.gguf"
    write_sparse_gguf(path, layers=32, embd=4096, ffn=11008, vocab=32000, heads=32, heads_kv=32, ctx=32768)
    return path


def test_the_preflight_reads_llama_cpp_and_gguf_file_loads(llama7b_gguf):
    from oom_magic.fit.preflight import preflight_check

    header = read_gguf_header(llama7b_gguf)
    weights = sum(t.nbytes for t in header.tensors)
    cell = f"from llama_cpp import Llama\nllm = Llama(model_path={str(llama7b_gguf)!r}, n_gpu_layers=-1, n_ctx=32768)"
    (check,) = preflight_check(cell, {}, target="T4").checks
    assert check.call.kind == "llama_cpp" and check.call.n_gpu_layers == -1 and check.call.n_ctx == 32768
    assert check.need == weights + 32 * 2 * 32768 * 4096 * 2 - header.tensors[0].nbytes  # token_embd stays on the CPU
    assert check.verdict == "will-not-fit"
    cell = f"import llama_cpp\nllm = llama_cpp.Llama({str(llama7b_gguf)!r}, n_gpu_layers=20, n_ctx=4096)"
    (check,) = preflight_check(cell, {}, target="T4").checks
    assert check.verdict == "fits" and check.need == check.estimate.gpu_bytes
    cell = (f"model = AutoModelForCausalLM.from_pretrained({str(llama7b_gguf.parent)!r}, "
            f"gguf_file={llama7b_gguf.name!r}, dtype=torch.bfloat16)")
    (check,) = preflight_check(cell, {}, target="A100-80GB").checks
    assert check.call.gguf_file == llama7b_gguf.name
    assert check.need == sum(t.elements for t in header.tensors) * 2  # transformers dequantizes to the dtype
    assert check.verdict == "fits"


def test_guardload_strict_refuses_a_llama_cpp_load_that_will_not_fit(ip, llama7b_gguf):
    from IPython.core.error import UsageError

    cell = (f"from llama_cpp import Llama\nllm = Llama(model_path={str(llama7b_gguf)!r}, n_gpu_layers=-1, "
            "n_ctx=32768)\nran = True\n")
    with pytest.raises(UsageError, match=r"--strict: line 2 will not fit on a T4: needs 19.97 GiB, 6.65 GiB short"):
        ip.run_cell_magic("guardload", "--target T4 --strict", cell)
    assert "ran" not in ip.user_ns  # refused before the cell (llama_cpp need not even be installed)


def test_llama_from_pretrained_reads_the_remote_header(tmp_path, llama7b_gguf):
    with HubServer() as hub:
        hub.repos["org/llama7b-gguf"] = Repo({"llama7b-Q4_K_M.gguf": llama7b_gguf})
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
        script = "\n".join([
            "from oom_magic.fit.preflight import preflight_check",
            "cell = \"llm = Llama.from_pretrained('org/llama7b-gguf', 'llama7b-Q4_K_M.gguf', n_gpu_layers=-1, "
            "n_ctx=4096)\"",
            "print(preflight_check('from llama_cpp import Llama\\n' + cell, {}, target='T4'))",
        ])
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "read 1 header, " in done.stdout and "from the hub (org/llama7b-gguf at " in done.stdout
        assert "n_gpu_layers=all puts 5.97 GiB on the GPU" in done.stdout and "→ fits" in done.stdout
        assert hub.sent["org/llama7b-gguf/llama7b-Q4_K_M.gguf"] < 256 * 1024  # the header, not 4 GiB of weights
