"""``sinklens analyze``: run every analyzer on a model and write a report (summary, JSON, figures)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sinklens.errors import SinklensError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="find a model's attention sinks and their causes",
        description="Run the sink, variance, massive-activation, super-neuron and mechanism analyzers in one "
        "streaming pass; print a summary table and write report.json plus PNG figures.",
    )
    parser.add_argument("--model", default="smollm2-135m", help="model spec for sinklens.load_model (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", nargs="+", metavar="T", help="one or more prompts")
    source.add_argument("--prompts", type=Path, metavar="FILE", help="a text file with one prompt per line")
    source.add_argument("--stdlib-text", type=int, metavar="N", help="N docstrings from the Python standard library")
    source.add_argument("--random-tokens", type=int, metavar="N", help="N uniformly random token sequences")
    parser.add_argument("--seq-len", type=int, default=64, help="length of random-token sequences (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=128, help="truncate prompts to this many tokens (default: %(default)s)")
    parser.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (it moves the sink)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--out", type=Path, default=Path("sinklens-report"), help="output folder (default: %(default)s)")
    parser.add_argument("--no-figures", action="store_true", help="write report.json only")
    parser.set_defaults(func=run)


def _inputs(args: argparse.Namespace, model) -> object:
    from sinklens.inputs import random_token_batches, stdlib_text_prompts

    prepend_bos = not args.no_bos
    if args.random_tokens:
        return random_token_batches(model, n_sequences=args.random_tokens, seq_len=args.seq_len,
                                    batch_size=args.batch_size, prepend_bos=prepend_bos)
    if args.text:
        return list(args.text)
    if args.prompts:
        if not args.prompts.exists():
            raise SinklensError(f"--prompts file {str(args.prompts)!r} does not exist.")
        lines = [line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            raise SinklensError(f"--prompts file {str(args.prompts)!r} has no non-empty lines.")
        return lines
    if args.stdlib_text:
        return stdlib_text_prompts(args.stdlib_text)
    return None  # the built-in prompt set


def run(args: argparse.Namespace) -> int:
    from sinklens.analysis.report import analyze
    from sinklens.loading import load_model
    from sinklens.options import RunOptions

    if args.batch_size < 1:
        raise SinklensError(f"--batch-size must be >= 1, got {args.batch_size}.")
    start = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr)
    model = load_model(args.model, device=args.device)
    report = analyze(
        model,
        _inputs(args, model),
        model_name=str(args.model),
        options=RunOptions(batch_size=args.batch_size, prepend_bos=not args.no_bos, max_length=args.max_length),
    )
    print(report.summary())
    written = report.save(args.out, figures=not args.no_figures)
    print(f"\nwrote {len(written)} files to {args.out}/ in {time.perf_counter() - start:.1f} s "
          f"(report.json{', figures' if not args.no_figures else ''})")
    return 0
