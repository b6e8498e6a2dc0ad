"""Run the sink, variance, massive-activation, super-neuron and mechanism analyzers in one pass;
print a summary table and write report.json, summary.txt and PNG figures to --out.

Examples:
    sinklens analyze                                   # SmolLM2-135M on the built-in prompts
    sinklens analyze --model gpt2 --prompts prompts.txt --out gpt2-report
    sinklens analyze --model runs/hw --random-tokens 32 --seq-len 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sinklens.commands import (
    add_bos_flag, add_command, add_model_flags, add_overwrite_flag, check_model_flags, outside_run_internals,
    random_token_inputs, result_folder,
)
from sinklens.errors import InvalidArgumentError
from sinklens.options import SEQ_LEN

#: Text prompts are cut to this many tokens unless --max-length says otherwise (at most the model's context).
_DEFAULT_MAX_LENGTH = 128


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "analyze", __doc__, help="find a model's attention sinks and their causes")
    parser.add_argument("--model", default="smollm2-135m", metavar="SPEC",
                        help="name, folder, .gguf, Hub id (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", action="extend", nargs="+", metavar="T", help="one or more prompts (repeatable)")
    source.add_argument("--prompts", metavar="FILE", help="a text file with one prompt per line")
    source.add_argument("--stdlib-text", type=int, metavar="N", help="N docstrings from the Python standard library")
    source.add_argument("--random-tokens", type=int, metavar="N", help="N uniformly random token sequences")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help=f"tokens per random sequence (default: {SEQ_LEN}, at most n_ctx)")
    parser.add_argument("--max-length", type=int, default=None, metavar="N",
                        help=f"cut text prompts to N tokens (default: {_DEFAULT_MAX_LENGTH}, at most n_ctx)")
    add_bos_flag(parser)
    add_model_flags(parser)
    parser.add_argument("--out", default="sinklens-report", metavar="DIR", help="output folder (default: %(default)s)")
    add_overwrite_flag(parser, "the analysis already in --out")
    parser.add_argument("--no-figures", action="store_true", help="write report.json and summary.txt only")
    parser.add_argument("--verify", action="store_true",
                        help="zero each massive dimension's top writers (direct, total effect) and writing blocks "
                        "at the sink and report how much of it and of the sink's attention disappears")
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    """Check every flag, and create and check ``--out`` for writing, before the model loads."""
    from sinklens.validate import no_finished_output, optional_positive_int, text_lines, writable_dir

    if not str(args.model).strip():
        raise InvalidArgumentError(f"--model is empty ({args.model!r}); give a model name, a path or a Hub id.")
    check_model_flags(args)
    for flag, minimum in (("seq_len", 2), ("max_length", 2), ("random_tokens", 1), ("stdlib_text", 1)):  # 2: sink + one
        optional_positive_int(getattr(args, flag), what="--" + flag.replace("_", "-"), minimum=minimum)
    if args.random_tokens is not None and args.max_length is not None:
        raise InvalidArgumentError(f"--max-length {args.max_length} truncates text prompts; --random-tokens sequences "
                                   "are --seq-len tokens long.")
    if (text_flag := _text_flag(args)) is not None and args.seq_len is not None:
        raise InvalidArgumentError(f"--seq-len {args.seq_len} sets the length of --random-tokens sequences; "
                                   f"{text_flag} prompts are cut with --max-length.")
    if empty := [i for i, t in enumerate(args.text or []) if not t.strip()]:
        raise InvalidArgumentError(f"--text prompt {empty[0] + 1} of {len(args.text)} is empty; give non-empty text.")
    if args.prompts is not None:
        text_lines(args.prompts, what="--prompts")
    outside_run_internals(Path(args.out), what="--out", file=False)
    args.out = writable_dir(args.out, what="--out")
    no_finished_output([args.out / "report.json", args.out / "summary.txt"], overwrite=args.overwrite, flag="--out")


def _text_flag(args: argparse.Namespace) -> str | None:
    return "--text" if args.text else "--prompts" if args.prompts else "--stdlib-text" if args.stdlib_text else None


def _inputs(args: argparse.Namespace, model: Any) -> object:
    """The analysis inputs the flags ask for (``None``: the built-in prompts; random tokens without a tokenizer)."""
    from sinklens.prompts import stdlib_text_prompts
    from sinklens.validate import text_lines

    if getattr(model, "tokenizer", None) is None and args.max_length is not None:
        raise InvalidArgumentError(f"--max-length {args.max_length} truncates text prompts, and the model "
                                   f"{str(args.model)!r} has no tokenizer; set the random sequences' length with --seq-len.")
    batches = random_token_inputs(model, args, command="analyze", text_flag=_text_flag(args))
    if batches is not None:
        return batches
    if args.prompts is not None:
        return text_lines(args.prompts, what="--prompts")
    if args.stdlib_text is not None:
        return stdlib_text_prompts(args.stdlib_text, what="--stdlib-text")
    return list(args.text) if args.text else None  # None: the built-in prompt set


def run(args: argparse.Namespace) -> int:
    """Under ``torchrun --nproc_per_node N`` every process loads the model and streams its share of the
    batches (:mod:`sinklens.distributed`); only rank 0 prints and writes the report."""
    from sinklens import distributed
    from sinklens.analysis.report import analyze
    from sinklens.hooks import model_dims
    from sinklens.loading import load_model
    from sinklens.options import RunOptions
    from sinklens.plotting.report import save_report  # matplotlib: not for --help
    from sinklens.validate import seq_len_within_context

    out_existed = Path(args.out).expanduser().exists()
    _check_args(args)
    with (result_folder(args.out, ["report.json", "summary.txt"], overwrite=args.overwrite, existed=out_existed),
          distributed.session(args.device) as device):
        start = time.perf_counter()
        if distributed.is_main():
            print(f"loading {args.model} ...", file=sys.stderr)
        model = load_model(args.model, device=device, dtype=args.dtype)
        inputs = _inputs(args, model)
        text = inputs is None or isinstance(inputs[0], str)  # random-token batches keep their --seq-len
        n_ctx = model_dims(model).n_ctx
        # the default cut is capped at the model's context; an explicit --max-length beyond it is refused by name
        seq_len_within_context(args.max_length, n_ctx, what="--max-length")
        max_length = args.max_length or min(_DEFAULT_MAX_LENGTH, n_ctx)
        report = analyze(model, inputs, model_name=str(args.model), verify=args.verify,
                         options=RunOptions(batch_size=args.batch_size, prepend_bos=args.bos,
                                            max_length=max_length if text else None))
        if not distributed.is_main():
            return 0
        written = save_report(report, args.out, figures=not args.no_figures)  # first: a closed stdout must not lose it
        print(report.summary())
        print(f"\nwrote {len(written)} files to {args.out}/ in {time.perf_counter() - start:.1f} s "
              f"(report.json{', figures' if not args.no_figures else ''})")
    return 0
