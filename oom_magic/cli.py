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
from typing import NoReturn
from collections.abc import Sequence

from .fit.check import DTYPES, QUANTIZATIONS

FITS, WILL_NOT_FIT, BAD_INPUT = 0, 1, 2
_MISSING_FIX = "; pass a checkpoint folder, a .safetensors/.bin/.pt file or shard index, or a hub id (org/name)"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the fix, with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .common.errors import OomMagicError
    from .fit.check import fit_check

    if args.file is not None or str(args.checkpoint).endswith(".gguf"):
        return _gguf(args)
    try:
        preflight = fit_check(args.checkpoint, device=args.device, target=args.target, dtype=args.dtype,
                              quantization=args.quantization, headroom=args.headroom, revision=args.revision,
                              hub_timeout=args.hub_timeout)
    except OomMagicError as exc:
        fix = _MISSING_FIX if str(exc).startswith(("no such file", "cannot find checkpoint")) else ""
        print(f"oom-magic fit: {exc}{fix}", file=sys.stderr)
        return BAD_INPUT
    from .render.fit import fit_dict, fit_text, verdict_line

    try:
        print(json.dumps(fit_dict(preflight), indent=2) if args.json else fit_text(preflight), flush=True)
    except BrokenPipeError:  # `oom-magic fit ... | head`: the reader left; the exit status still tells
        sys.stdout = None  # no second error when Python flushes at exit
    if preflight.fits is None:
        fix = ""
        if not args.target and any((c.reason or "").startswith("this machine has no") for c in preflight.checks):
            fix = "; pass --target GPU (T4, 16GiB, ...) to check against a GPU this machine does not have"
        print(f"oom-magic fit: {verdict_line(preflight)}{fix}", file=sys.stderr)
        return BAD_INPUT
    return FITS if preflight.fits else WILL_NOT_FIT


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
        print(f"oom-magic fit: {exc}", file=sys.stderr)
        return BAD_INPUT
    print(json.dumps(record_dict(load), indent=2) if args.json else llama_cpp_text(load), flush=True)
    if load.fits is None:
        print("oom-magic fit: not checked: no GPU budget here; pass --target GPU (T4, 16GiB, ...)", file=sys.stderr)
        return BAD_INPUT
    return FITS if load.fits else WILL_NOT_FIT


if __name__ == "__main__":  # pragma: no cover - python -m oom_magic.cli
    sys.exit(main())
