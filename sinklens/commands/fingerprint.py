"""``sinklens fingerprint A B``: the SeedPrint test — do two models share their random initialization?

Examples::

    sinklens fingerprint runs/a@init runs/a            # same lineage expected (p < 0.01)
    sinklens fingerprint runs/a runs/b --json fp.json
    sinklens fingerprint smollm2-135m runs/ft --samples 500 --seq-len 128

A and B are any ``--model`` spec (embedded name, HF directory, .gguf, run directory, ``SPEC@init:S``).
They may have different hidden sizes with ``--input token`` (the default; ``--identity-mode coset`` compares the
identity dims both share, as the authors' ``run_test`` does); ``--input embedding`` needs equal hidden sizes and
is refused otherwise (exit 2, the message names both sizes).
See :mod:`sinklens.origins.fingerprint` for the algorithm, taken step by step from the authors' code.
"""

from __future__ import annotations

import argparse

from sinklens.commands import add_model_flags, add_overwrite_flag, check_model_flags, outside_run_internals, plain_help


def add_parser(subparsers) -> argparse.ArgumentParser:
    from sinklens.origins.fingerprint import (
        DEFAULT_ALPHA, DEFAULT_BUFFER_K, DEFAULT_SAMPLES, DEFAULT_SEED, DEFAULT_SEQ_LEN,
    )

    parser = subparsers.add_parser("fingerprint", help="SeedPrint lineage test between two models",
                                   description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_a", metavar="A", help="first model spec")
    parser.add_argument("model_b", metavar="B", help="second model spec")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="random sequences N (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per sequence (default min({DEFAULT_SEQ_LEN}, n_ctx of both))")
    parser.add_argument("--input", choices=("token", "embedding"), default="token",
                        help="random input kind (embedding needs equal hidden sizes; token does not)")
    parser.add_argument("--buffer-k", type=int, default=DEFAULT_BUFFER_K, help="bottom-k identity dims (default %(default)s)")
    parser.add_argument("--identity-mode", choices=("coset", "base"), default="coset")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="decision threshold on p (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random inputs (default %(default)s)")
    add_model_flags(parser, batch_size=16)
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON (p_value, z, n_dims, same_lineage, ...)")
    add_overwrite_flag(parser, "an earlier --json file")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from sinklens.export import write_json
    from sinklens.hooks import model_dims
    from sinklens.loading import load_model
    from sinklens.options import RunOptions
    from sinklens.origins.fingerprint import check_test_arguments, fingerprint
    from sinklens.validate import as_seed, no_finished_output, positive_int, seq_len_within_context, writable_file

    json_path = writable_file(args.json, what="--json") if args.json is not None else None  # '' is refused by name
    if json_path is not None:
        outside_run_internals(json_path, what="--json", file=True)
    no_finished_output([json_path] if json_path else [], overwrite=args.overwrite, flag="--json")
    check_test_arguments(args.buffer_k, args.identity_mode, args.alpha, cli=True)  # before the models load and run
    positive_int(args.samples, what="--samples", minimum=2)
    if args.seq_len is not None:
        positive_int(args.seq_len, what="--seq-len")
    check_model_flags(args)
    as_seed(args.seed, what="--seed")
    options = RunOptions(batch_size=args.batch_size, progress=not args.no_progress, device=args.device, desc="SeedPrint")
    model_a = load_model(args.model_a, device=args.device, dtype=args.dtype, check_patterns=False)
    model_b = load_model(args.model_b, device=args.device, dtype=args.dtype, check_patterns=False)
    seq_len_within_context(args.seq_len, min(model_dims(model_a).n_ctx, model_dims(model_b).n_ctx),
                           context="the models' context", note="the smaller cfg.n_ctx of the two")
    result = fingerprint(model_a, model_b, n_samples=args.samples, seq_len=args.seq_len, input=args.input,
                         buffer_k=args.buffer_k, identity_mode=args.identity_mode, alpha=args.alpha,
                         seed=args.seed, options=options)
    if json_path is not None:  # written first: a closed stdout (`| head`) must not lose the result
        # full precision: p_value and alpha may differ in the 7th digit, and the file must say which is smaller
        write_json(json_path, {"model_a": args.model_a, "model_b": args.model_b, **result.to_dict()}, digits=None,
                   replace=args.overwrite)
    print(f"A = {args.model_a}\nB = {args.model_b}\n{result.summary()}")
    if json_path is not None:
        print(f"wrote {json_path}")
    return 0
