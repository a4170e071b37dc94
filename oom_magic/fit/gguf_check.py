"""`oom-magic fit FILE.gguf` and `org/name --file X.gguf`: a llama.cpp load's GPU share against a GPU's budget."""
from __future__ import annotations

from dataclasses import replace

from ..records.llama_cpp import LlamaCppLoad
from ..records.target import Target
from .llama_cpp import read_gguf, size_llama_cpp
from .preflight import _Budgets
from .targets import parse_target

__all__ = ["gguf_fit_check"]


def gguf_fit_check(path_or_repo: str, *, file: str | None = None, target: str | Target | None = None, n_ctx: int | None = None,
                   n_gpu_layers: int = -1, type_k: str = "f16", type_v: str = "f16", revision: str | None = None,
                   headroom: str | int | None = None, device: str = "cuda:0") -> LlamaCppLoad:
    """Check a llama.cpp load of a local .gguf file, or of `file` in hub repo `path_or_repo` (headers only),
    against a GPU's budget (`target`, else this machine's `device`) after headroom."""
    rehearsed = parse_target(target) if target is not None else None
    header, hub, label = read_gguf(path_or_repo, file, revision)
    sizes = size_llama_cpp(header, label, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, type_k=type_k, type_v=type_v,
                           hub=hub)
    if n_gpu_layers == 0:
        return replace(sizes, gpu_budget=0)  # nothing goes to the GPU: nothing to check there
    budgets = _Budgets(None, None, None, None, headroom, None, rehearsed)
    free, total, context, _ = budgets.device(device)
    if free is None:
        return replace(sizes, target=rehearsed)
    return replace(sizes, target=rehearsed, gpu_budget=free - context - budgets.headroom(total, free))
