"""The job a cell loads its model for, read from its AST without running it: generation or a fine-tune.

``load_calls.scan_cell`` hands each statement's calls to a ``JobReader`` in the cell's order; the job
goes on the load it is for (``LoadRequest.job``). The rules:

- ``X.generate(ids, max_new_tokens=N)`` (or ``max_length=L``; a pipeline variable called with
  ``max_new_tokens=``): inference. The cache transformers keeps holds every token but the last one
  generated, so the context is ``prompt + N - 1`` (``L - 1`` with ``max_length``). The prompt is known
  only when the input is a literal list of token ids (``torch.tensor([[1, 2, 3]])``). Otherwise (a
  tokenizer's output, a tensor from an earlier cell) its length exists only when the cell runs: the
  job is sized at ``N`` tokens, the cache of a one-token prompt, and a note says so (``--context``
  sizes the whole). The batch is the literal input's rows (else 1) times ``num_beams`` or
  ``num_return_sequences``.
- ``TrainingArguments(...)`` / trl's ``SFTConfig(...)``, or a ``Trainer`` / ``SFTTrainer`` with
  transformers' defaults: a fine-tune at ``per_device_train_batch_size`` (default 8) with the
  optimizer ``optim`` names (default AdamW), gradient checkpointing, bf16/fp16 mixed precision, and
  SFTConfig's ``max_length`` as the context (else the dataset's, unknown: 1 token and a note).
- ``get_peft_model(model, LoraConfig(r=..., target_modules=[...]))`` or ``SFTTrainer(peft_config=...)``:
  LoRA (QLoRA on a 4-bit load), at peft's default rank 8 when ``r`` is not given.

Only literals and names holding exact ints, strs and bools are read (``cell_values.Resolver``).
``job_overrides`` checks ``%%guardload``'s ``--context/--batch/--prompt/--train/--lora-r`` and
``with_overrides`` puts them on the cell's job.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Mapping, Sequence

from ..common.errors import OomMagicError
from ..records.job import Job, TrainKind
from ..records.request import LoadRequest
from ..sizing.parts import check_job
from .cell_values import Resolver

__all__ = ["JobReader", "job_overrides", "with_overrides"]

# TrainingArguments(optim=...) → the optimizer the sizing knows. transformers' default is AdamW
# ("adamw_torch_fused" with torch >= 2.8, "adamw_torch" before); paged optimizers keep the same state.
_OPTIMIZERS: dict[str, TrainKind] = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_torch_xla": "adamw",
    "adamw_torch_npu_fused": "adamw", "adamw_apex_fused": "adamw", "paged_adamw_32bit": "adamw",
    "adamw_8bit": "adamw8bit", "adamw_bnb_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit", "sgd": "sgd",
}
_TRAINING_ARGS = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig")
_TRAINERS = ("Trainer", "Seq2SeqTrainer", "SFTTrainer")
_TRAIN_BATCH = 8  # TrainingArguments.per_device_train_batch_size's default
_LORA_R = 8  # peft.LoraConfig.r's default
_HF_LOADS = ("from_pretrained", "pipeline")


def _keyword(call: ast.Call, *names: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg in names), None)


def _positional(call: ast.Call, index: int) -> ast.AST | None:
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return None


@dataclass(frozen=True)
class _Generate:
    model: str | None  # the variable generate is called on
    context: int
    prompt: int | None
    batch: int
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Training:
    batch: int
    optim: str
    gradient_checkpointing: bool
    mixed_precision: str | None
    context: int | None


class JobReader:
    """Collect, statement by statement, what a cell says about the job its model is loaded for."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.generate: _Generate | None = None
        self.training: _Training | None = None
        self.trainer = False  # a Trainer / SFTTrainer is built (transformers' defaults when no arguments are)
        self.lora: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None  # (r, targets, notes) of the last LoraConfig
        self.lora_model: str | None = None  # the variable get_peft_model wraps; "" when a trainer adds LoRA
        self.checkpointing = False  # model.gradient_checkpointing_enable() in the cell

    def see(self, calls: Sequence[ast.Call], loads: Sequence[LoadRequest]) -> None:
        """Read one statement's calls (in source order); ``loads`` are the cell's loads found so far."""
        pipelines = {r.variable for r in loads if r.kind == "pipeline" and r.variable}
        for call in calls:
            func = call.func
            last = (self.resolver.name(func) or "").rsplit(".", 1)[-1]
            if isinstance(func, ast.Attribute) and func.attr == "generate":
                self.generate = self._generate(call, func.value.id if isinstance(func.value, ast.Name) else None)
            elif isinstance(func, ast.Name) and func.id in pipelines and _keyword(call, "max_new_tokens", "max_length"):
                self.generate = self._generate(call, func.id)
            elif last == "LoraConfig":
                self.lora = self._lora(call)
            elif last in _TRAINING_ARGS:
                self.training = self._training(call, sft=last == "SFTConfig")
            elif last == "get_peft_model":
                model = _positional(call, 0) or _keyword(call, "model")
                self.lora_model = model.id if isinstance(model, ast.Name) else ""
            elif last in _TRAINERS:
                self.trainer = True
                if _keyword(call, "peft_config") is not None and self.lora_model is None:
                    self.lora_model = ""
            elif isinstance(func, ast.Attribute) and func.attr == "gradient_checkpointing_enable":
                self.checkpointing = True

    def _int(self, node: ast.AST | None) -> int | None:
        value = self.resolver.value(node) if node is not None else None
        return value if type(value) is int and value >= 1 else None

    def _generate(self, call: ast.Call, model: str | None) -> _Generate:
        new = self._int(_keyword(call, "max_new_tokens"))
        total = self._int(_keyword(call, "max_length"))
        rows, prompt = _literal_ids(self.resolver, _positional(call, 0) or _keyword(call, "input_ids", "inputs"))
        widen = max(self._int(_keyword(call, "num_beams")) or 1, self._int(_keyword(call, "num_return_sequences")) or 1)
        batch = (rows or 1) * widen
        notes: list[str] = []
        if new is not None:  # max_new_tokens wins over max_length, as in transformers
            context = (prompt or 1) + new - 1
            if prompt is None:
                notes.append(f"job: the prompt's length is known only when the cell runs: sized for max_new_tokens={new} "
                             "after a one-token prompt; --context PROMPT+NEW sizes the whole")
        elif total is not None:
            context = max(total - 1, 1)
        else:
            context = prompt or 1
            notes.append("job: generate() without max_new_tokens or max_length: its generation_config decides the "
                         "length when the cell runs; --context N sizes it")
        if rows is None:
            notes.append(f"job: the input's batch is known only when the cell runs: sized at {batch}; --batch B sizes yours")
        return _Generate(model, context, prompt, batch, tuple(notes))

    def _lora(self, call: ast.Call) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
        r = self._int(_keyword(call, "r")) or _LORA_R
        wanted = self.resolver.value(_keyword(call, "target_modules"))
        notes: tuple[str, ...] = ()
        if isinstance(wanted, (list, tuple)) and wanted and all(type(t) is str for t in wanted):
            targets: tuple[str, ...] = tuple(wanted)
        elif wanted == "all-linear":
            targets = ("all-linear",)
        else:
            targets = ()
            if wanted is not None:
                notes = ("job: LoraConfig's target_modules cannot be read before the cell runs: sized with peft's "
                         "default modules for this model",)
        return r, targets, notes

    def _training(self, call: ast.Call, *, sft: bool) -> _Training:
        optim = self.resolver.value(_keyword(call, "optim"))
        optim_name = optim.strip().lower() if isinstance(optim, str) else "adamw_torch"
        checkpointing = self.resolver.value(_keyword(call, "gradient_checkpointing", "activation_checkpointing"))
        precision = next((name for name in ("bf16", "fp16") if self.resolver.value(_keyword(call, name)) is True), None)
        context = self._int(_keyword(call, "max_length", "max_seq_length")) if sft else None
        return _Training(self._int(_keyword(call, "per_device_train_batch_size")) or _TRAIN_BATCH, optim_name,
                         checkpointing is True, precision, context)

    def job_for(self, request: LoadRequest) -> tuple[Job | None, tuple[str, ...]]:
        """The job the cell runs on this load's model, and what could not be read (one line each)."""
        if self.training is not None or self.trainer or self.lora_model is not None:
            return self._fine_tune(request)
        if self.generate is not None:
            g = self.generate
            return Job(context=g.context, batch=g.batch, prompt=g.prompt), g.notes
        return None, ()

    def _fine_tune(self, request: LoadRequest) -> tuple[Job | None, tuple[str, ...]]:
        t = self.training or _Training(_TRAIN_BATCH, "adamw_torch", False, None, None)
        notes: list[str] = []
        kind: TrainKind | None = _OPTIMIZERS.get(t.optim)
        r: int = _LORA_R
        targets: tuple[str, ...] = ()
        if self.lora_model is not None:
            r, targets, lora_notes = self.lora or (_LORA_R, (), ())
            notes += lora_notes
            if request.quantization in ("nf4", "fp4"):
                kind = "qlora"
            elif request.quantization is not None:
                return None, (f"job: LoRA on a {request.quantization} load is not sized (--train qlora sizes a "
                              "4-bit base)",)
            else:
                kind = "lora"
        elif kind is None:
            return None, (f"job: optim={t.optim!r} is not an optimizer the fit check sizes (AdamW, 8-bit AdamW, "
                          "SGD): the fine-tune is not sized; --train KIND sizes it as one of them",)
        elif request.quantization is not None:
            return None, ("job: a full fine-tune of a quantized load is not sized (--train qlora sizes LoRA on a "
                          "4-bit base)",)
        if t.context is None:
            notes.append("job: the training sequence length is the dataset's, known only when the cell runs: sized "
                         "at 1 token; --context N sizes it")
        job = Job(context=t.context or 1, batch=t.batch, train=kind, lora_r=r, lora_targets=targets,
                  gradient_checkpointing=t.gradient_checkpointing or self.checkpointing,
                  mixed_precision=t.mixed_precision)
        return job, tuple(notes)

    def model_variable(self) -> str | None:
        """The variable the job runs on, when the cell names one (generate's receiver, get_peft_model's model)."""
        if self.lora_model:
            return self.lora_model
        return self.generate.model if self.generate is not None else None


def _literal_ids(resolver: Resolver, node: ast.AST | None) -> tuple[int | None, int | None]:
    """(rows, tokens) of a literal 2-D list of token ids, bare or in torch.tensor(...); (None, None) otherwise."""
    if isinstance(node, ast.Call) and node.args and (resolver.name(node.func) or "") in (
            "torch.tensor", "torch.LongTensor", "torch.as_tensor"):
        node = node.args[0]
    if not isinstance(node, ast.List):
        return None, None
    try:
        rows = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None, None
    if not rows or not all(isinstance(row, list) and row and all(type(t) is int for t in row) for row in rows):
        return None, None
    lengths = {len(row) for row in rows}
    return (len(rows), lengths.pop()) if len(lengths) == 1 else (None, None)


def attach_job(requests: Sequence[LoadRequest], reader: JobReader) -> tuple[LoadRequest, ...]:
    """The requests with the cell's job on the load it is for: the one its model variable names, else the
    cell's first transformers load."""
    loads = [i for i, r in enumerate(requests) if r.kind in _HF_LOADS]
    if not loads:
        return tuple(requests)
    named = reader.model_variable()
    index = next((i for i in loads if named and requests[i].variable == named), loads[0])
    job, notes = reader.job_for(requests[index])
    if job is None and not notes:
        return tuple(requests)
    out = list(requests)
    out[index] = replace(requests[index], job=job, notes=requests[index].notes + notes)
    return tuple(out)


def job_overrides(*, context: Any = None, batch: Any = None, prompt: Any = None, train: Any = None,
                  lora_r: Any = None) -> dict[str, Any]:
    """The job flags that were given, checked as the command checks them (OomMagicError with the fix)."""
    given = {name: value for name, value in (("context", context), ("batch", batch), ("prompt", prompt),
                                             ("train", train), ("lora_r", lora_r)) if value is not None}
    check_job(Job(**{"context": 1, **given}))
    return given


def with_overrides(requests: Sequence[LoadRequest], overrides: Mapping[str, Any]) -> tuple[tuple[LoadRequest, ...],
                                                                                          str | None]:
    """Put the flags on the cell's job (or make one from them); a note when the cell has no load to size it on."""
    if not overrides:
        return tuple(requests), None
    loads = [i for i, r in enumerate(requests) if r.kind in _HF_LOADS]
    index = next((i for i in loads if requests[i].job is not None), loads[0] if loads else None)
    if index is None:
        flags = " ".join(f"--{name.replace('_', '-')}" for name in overrides)
        return tuple(requests), f"{flags}: no from_pretrained or pipeline load in the cell to size a job for"
    request = requests[index]
    job = replace(request.job or Job(context=1), **overrides)
    if job.train not in ("lora", "qlora"):
        job = replace(job, lora_targets=())
    try:
        check_job(job)
    except OomMagicError as exc:  # a flag against the cell's own figures (--prompt past its context is fine)
        return tuple(requests), f"the job flags do not make a job: {exc}"
    given = {f"--{name.replace('_', '-')}" for name in overrides}
    notes = tuple(n for n in request.notes if not any(flag in n for flag in given))
    if request.job is None and "context" not in overrides:
        notes += ("job: sized at 1 token of context; --context N sizes it",)
    out = list(requests)
    out[index] = replace(request, job=job, notes=notes)
    return tuple(out), None
