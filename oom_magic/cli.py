"""``oom-magic fit CHECKPOINT``: the %%guardload fit check as a command for scripts and CI pipelines.

Reads checkpoint headers only (no torch import, no CUDA context, no download of weights: a hub id
not in the local cache is sized from its config and headers read over the network) and exits 0 when
the load fits, 1 when it will not, 2 on bad input or when nothing could be checked, with one line
on stderr that says how to fix it.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, NoReturn, cast
from collections.abc import Sequence

from .fit.check import DTYPES, QUANTIZATIONS
from .records.job import TRAIN_KINDS
from .sizing.parts import MIXED_PRECISIONS

if TYPE_CHECKING:
    from .records.preflight import Preflight

FITS, WILL_NOT_FIT, BAD_INPUT = 0, 1, 2
_MISSING_FIX = "; pass a checkpoint folder, a .safetensors/.bin/.pt file or shard index, or a hub id (org/name)"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the fix, with exit status 2 (as JSON under --json)."""

    json_errors = False  # set by main when --json is on the command line: a pipeline parses stdout

    def error(self, message: str) -> NoReturn:
        text = f"{message} (see {self.prog} --help)"
        if self.json_errors:
            _print_json({"verdict": "error", "error": text})
            self.exit(BAD_INPUT)
        self.exit(BAD_INPUT, f"{self.prog}: {text}\n")


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2), flush=True)


def _show(as_json: bool, report: object) -> None:
    """The report on stdout: under --json a dict as JSON, else its text."""
    if as_json:
        _print_json(report)
    else:
        print(report, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``oom-magic fit CHECKPOINT [options]``."""
    parser = _Parser(prog="oom-magic", description="Fit checks for model loads, from checkpoint headers only.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    fit = commands.add_parser(
        "fit", help="Check whether a checkpoint fits a device or a target GPU (exit 0 fits, 1 does not, 2 bad input).",
        description="Check whether a checkpoint fits a device or a target GPU, as %%guardload's preflight does. "
                    "Exit status: 0 fits, 1 will not fit, 2 bad input or nothing could be checked.")
    fit.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="A checkpoint folder, a sharded index (*.index.json), a .safetensors, .bin or .pt file, or a "
                          "hub id (org/name): from the local Hugging Face cache, else its config.json and "
                          "safetensors headers are read from the hub (never the weights).")
    where = fit.add_mutually_exclusive_group()
    where.add_argument("--device", "-d", default=None,
                       help="Where the weights go: cuda, cuda:N, cpu, mps, or auto for device_map=\"auto\" "
                            "(default: the current CUDA device, else cpu).")
    where.add_argument("--target", default=None, metavar="GPU",
                       help="Check against the GPU it will be deployed on instead of this machine: a known GPU "
                            "(T4, L4, A10G, A100-80GB, H100-80GB, ...) or the card's total such as 16GiB.")
    fit.add_argument("--dtype", default=None, help=f"Load dtype: {', '.join(DTYPES)} (default: as from_pretrained "
                                                   "picks it for this checkpoint).")
    fit.add_argument("--quantization", "-q", default=None,
                     help=f"bitsandbytes load: {', '.join(QUANTIZATIONS)} (folders and hub ids).")
    fit.add_argument("--headroom", default=None, metavar="SIZE",
                     help="Memory to keep free: a size such as 2GiB or a percentage of the device such as 5%% "
                          "(default 5%%).")
    fit.add_argument("--revision", default=None, metavar="REV",
                     help="For a hub id not in the local cache: the branch, tag or commit to read (default main).")
    fit.add_argument("--hub-timeout", type=float, default=None, metavar="SECONDS",
                     help="For a hub id not in the local cache: give up reading its config and headers after this "
                          "many seconds (default 10); HF_TOKEN or the saved login authenticates.")
    gguf = fit.add_argument_group("GGUF files (llama.cpp)")
    gguf.add_argument("--file", default=None, metavar="X.gguf",
                      help="With a hub id: the .gguf file in that repo to size (its header is read, never its weights).")
    gguf.add_argument("--n-ctx", type=int, default=None, metavar="N",
                      help="llama.cpp's context length for the KV cache (default: the model's context_length).")
    gguf.add_argument("--n-gpu-layers", type=int, default=-1, metavar="N",
                      help="Layers llama.cpp offloads to the GPU (default -1: all).")
    gguf.add_argument("--type-k", default="f16", help="KV cache type of K (f16, q8_0, q4_0, ...; default f16).")
    gguf.add_argument("--type-v", default="f16", help="KV cache type of V (default f16).")
    fit.add_argument("--json", action="store_true", help="Print the check as JSON (int bytes) instead of text.")
    job = fit.add_argument_group("the job (needs --target; a count such as 2xA10G splits it over that many)")
    job.add_argument("--context", type=int, default=None, metavar="N",
                     help="Size the job, not just the load: tokens the KV cache holds (prompt + generated).")
    job.add_argument("--prompt", type=int, default=None, metavar="N",
                     help="Tokens of the prompt's forward (default: the whole context, the worst case).")
    job.add_argument("--batch", type=int, default=1, metavar="B", help="Sequences at once (default 1).")
    job.add_argument("--train", default=None, choices=TRAIN_KINDS,
                     help="A fine-tune instead of inference: the optimizer (adamw, sgd, adamw8bit) or LoRA/QLoRA.")
    job.add_argument("--lora-r", type=int, default=16, metavar="R", help="The LoRA rank (default 16).")
    job.add_argument("--gradient-checkpointing", action="store_true",
                     help="With --train: transformers' gradient checkpointing (each layer's activations recomputed "
                          "in the backward).")
    job.add_argument("--mixed-precision", default=None, choices=MIXED_PRECISIONS,
                     help="With --train: float32 weights, gradients and AdamW state, computed in bf16 or fp16 under "
                          "torch.autocast.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args_given = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in args_given
    args = build_parser().parse_args(args_given)
    from .common.errors import OomMagicError
    from .fit.check import fit_check

    if (args.gradient_checkpointing or args.mixed_precision) and args.train is None:
        return _fail(args.json, "--gradient-checkpointing and --mixed-precision size a fine-tune's step: add --train "
                                f"{'|'.join(TRAIN_KINDS)}")
    gguf = args.file is not None or str(args.checkpoint).endswith(".gguf")
    if gguf and (args.context is not None or args.train is not None):
        problem = _as_llama_cpp_job(args)
        if problem is not None:
            return _fail(args.json, problem)
    if args.context is not None or args.train is not None:
        return _job(args)
    if gguf:
        return _gguf(args)
    try:
        checked = fit_check(args.checkpoint, device=args.device, target=args.target, dtype=args.dtype,
                            quantization=args.quantization, headroom=args.headroom, revision=args.revision,
                            hub_timeout=args.hub_timeout)
        preflight = cast("Preflight", checked)  # no job given: the load's check
    except OomMagicError as exc:
        fix = _MISSING_FIX if str(exc).startswith(("no such file", "cannot find checkpoint")) else ""
        return _fail(args.json, f"{exc}{fix}")
    from .render.fit import fit_dict, fit_text

    try:
        if args.json:
            _print_json(fit_dict(preflight))
        else:
            print(fit_text(preflight), flush=True)
    except BrokenPipeError:  # `oom-magic fit ... | head`: the reader left; the exit status still tells
        sys.stdout = None  # no second error when Python flushes at exit
    if preflight.fits is None:
        if not args.json:  # the reason is in the report above; this line says what to do (JSON holds it already)
            print(f"oom-magic fit: nothing was checked; {_unchecked_fix(preflight, args.target)}", file=sys.stderr)
        return BAD_INPUT
    return FITS if preflight.fits else WILL_NOT_FIT


def _as_llama_cpp_job(args: argparse.Namespace) -> str | None:
    """A GGUF file's job is llama.cpp's context: ``--context`` becomes ``--n-ctx`` (one cache, shared by
    every sequence); what llama.cpp's load does not take is a one-line problem."""
    if args.train is not None:
        return "a GGUF file runs in llama.cpp, which oom-magic does not size a fine-tune for: --train needs a " \
               "transformers checkpoint (a folder or hub id with config.json)"
    if args.batch != 1 or args.prompt is not None:
        return "llama.cpp's cache holds --n-ctx tokens shared by all sequences: give the total as --context, " \
               "without --batch or --prompt"
    if args.n_ctx is not None and args.n_ctx != args.context:
        return f"--context {args.context} and --n-ctx {args.n_ctx} are the same setting for a GGUF file: give one"
    args.n_ctx, args.context = args.context, None
    return None


def _job(args: argparse.Namespace) -> int:
    """``--context`` / ``--train``: size the job and check it against the target GPUs."""
    from .checkpoints.hub import hub_options
    from .common.errors import OomMagicError
    from .fit.job_fit import job_fit
    from .records.job import Job
    from .render.job import job_fit_dict, job_fit_text

    try:
        if args.target is None:
            raise OomMagicError("sizing a job needs --target GPU (T4, A10G, 2xA10G, 24GiB, ...)")
        job = Job(context=1 if args.context is None else args.context, batch=args.batch, prompt=args.prompt, train=args.train,
                  lora_r=args.lora_r, gradient_checkpointing=args.gradient_checkpointing,
                  mixed_precision=args.mixed_precision)
        with hub_options(timeout=args.hub_timeout):  # an uncached hub id: its config and headers, bounded
            fit = job_fit(args.checkpoint, job, args.target, dtype=args.dtype, quantization=args.quantization)
    except OomMagicError as exc:
        return _fail(args.json, str(exc))
    _show(args.json, job_fit_dict(fit) if args.json else job_fit_text(fit))
    return FITS if fit.fits else WILL_NOT_FIT


def _gguf(args: argparse.Namespace) -> int:
    """`oom-magic fit FILE.gguf` / `org/name --file X.gguf`: a llama.cpp load's GPU share against the budget."""
    from .checkpoints.hub import hub_options
    from .common.errors import OomMagicError
    from .fit.gguf_check import gguf_fit_check
    from .render.fit import llama_cpp_text
    from .render.json import record_dict

    try:
        with hub_options(timeout=args.hub_timeout):
            load = gguf_fit_check(args.checkpoint, file=args.file, target=args.target, n_ctx=args.n_ctx,
                                  n_gpu_layers=args.n_gpu_layers, type_k=args.type_k, type_v=args.type_v,
                                  revision=args.revision, headroom=args.headroom,
                                  device=args.device if args.device and args.device.startswith("cuda") else "cuda:0")
    except OomMagicError as exc:
        return _fail(args.json, str(exc))
    _show(args.json, record_dict(load) if args.json else llama_cpp_text(load))
    if load.fits is None:
        print("oom-magic fit: not checked: no GPU budget here; pass --target GPU (T4, 16GiB, ...)", file=sys.stderr)
        return BAD_INPUT
    return FITS if load.fits else WILL_NOT_FIT


def _fail(as_json: bool, message: str) -> int:
    """Bad input: one line on stderr, or under --json the error as JSON on stdout; exit 2."""
    if as_json:
        _print_json({"verdict": "error", "error": message})
    else:
        print(f"oom-magic fit: {message}", file=sys.stderr)
    return BAD_INPUT


def _unchecked_fix(preflight: Preflight, target: str | None) -> str:
    """What to do when no load could be sized, from why it could not."""
    if not preflight.checks:  # code that holds no load call: its note is the whole answer
        return next((n for n in preflight.notes if n.startswith("no load call found")), "no load to check")
    reasons = [c.reason or "" for c in preflight.checks]
    if not target and any(r.startswith("this machine has no") for r in reasons):
        return "pass --target GPU (T4, 16GiB, ...) to check against a GPU this machine does not have"
    if any("download is incomplete" in r for r in reasons):
        return "download the checkpoint again (its shard index names files that are not there)"
    return "see the reason above"


if __name__ == "__main__":  # pragma: no cover - python -m oom_magic.cli
    sys.exit(main())
