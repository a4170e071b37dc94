"""What a load asks for, whichever front door it came through: a cell, the command or ``fit_check()``.

One frozen record per load. Sizing and the verdict (``fit.preflight``) read only this record, so a
front door never writes code for another to parse. Every field has a default: a new kind of
request (a job, a remote checkpoint) adds a field without touching the front doors that do not know it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .job import Job
from .target import Target

__all__ = ["LoadKind", "LoadRequest", "Origin"]

# "pipeline": transformers.pipeline(task, model=...), a from_pretrained underneath; "vllm": vllm.LLM(model=...)
LoadKind = Literal["from_pretrained", "torch.load", "load_file", "llama_cpp", "pipeline", "vllm"]
Origin = Literal["cell", "checkpoint"]  # a load written in a cell, or a checkpoint named to the command / fit_check()


@dataclass(frozen=True)
class LoadRequest:
    """One model or checkpoint load: which checkpoint, how it is loaded, where its weights go."""

    kind: LoadKind  # the loader: from_pretrained for a folder or hub id, torch.load, safetensors' load_file
    checkpoint: str | None  # local path or hub id; None when it cannot be known before the cell runs
    unresolved: str | None = None  # why the checkpoint is unknown
    origin: Origin = "cell"
    dtype: str | None = None  # requested load dtype ('bfloat16', 'float32', 'auto'); None = not given
    quantization: str | None = None  # 'int8' | 'nf4' | 'fp4' | another config's name
    double_quant: bool = False
    skip_modules: tuple[str, ...] | None = None  # BitsAndBytesConfig(llm_int8_skip_modules=[...])
    device: str | None = None  # where the weights land: 'cuda:0', 'cuda', 'cpu', 'mps', 'auto', 'mixed'; None = default
    max_memory: tuple[tuple[int | str, int], ...] | None = None
    offload_folder: str | None = None
    target: Target | None = None  # the deployment GPU it is checked against instead of this machine's devices
    # with a target: whether the load also runs on this machine (a cell does; the command with --target alone does not)
    runs_here: bool = True
    line: int | None = None  # the cell line it was written on; None for a checkpoint named outside a cell
    source: str | None = None  # the call as written in the cell, whole; None outside a cell
    variable: str | None = None  # the variable the cell assigns the result to
    map_location_given: bool = False
    weights_only: bool | None = None  # None: not given; False: explicitly off
    mmap: bool = False
    moved_to: str | None = None  # .to(device) / .cuda() applied to the result
    cast_to: str | None = None  # .to(dtype) / .half() / .bfloat16() applied to the result
    notes: tuple[str, ...] = ()
    revision: str | None = None  # from_pretrained's revision= (a hub branch, tag or commit)
    gguf_file: str | None = None  # a GGUF file in the repo: transformers' gguf_file=, Llama.from_pretrained's filename
    n_gpu_layers: int | None = None  # llama_cpp.Llama's n_gpu_layers= (None: not given, llama-cpp-python's 0)
    n_ctx: int | None = None  # llama_cpp.Llama's n_ctx= (None: not given, llama-cpp-python's 512)
    # from_pretrained's token= (a hub token) for reading an uncached model's headers; never shown
    token: str | None = field(default=None, repr=False, compare=False)
    # vllm.LLM: the share of each GPU it reserves up front, the context one sequence may reach
    # (None: config.json's max_position_embeddings), and how many GPUs split the weights and the KV cache
    memory_utilization: float | None = None
    max_model_len: int | None = None
    tensor_parallel: int = 1
    # the job the cell loads the model for (generate's lengths, a fine-tune's settings) or the flags' job;
    # None: the weights alone are checked
    job: Job | None = None
