"""The SeedPrint test (Yang et al.): do two models share their random initialization?

A and B are model specs (name, HF folder, .gguf, run folder, SPEC@init:S); --input embedding needs
equal hidden sizes. The algorithm follows the authors' code (sinklens.origins.fingerprint).

Examples:
    sinklens fingerprint runs/a@init runs/a            # same lineage expected (p < 0.01)
    sinklens fingerprint runs/a runs/b --json fp.json
    sinklens fingerprint smollm2-135m runs/ft --samples 500 --seq-len 128
"""

from __future__ import annotations

import argparse

from sinklens.commands import (
    add_command, add_json_flag, add_model_flags, add_overwrite_flag, check_model_flags, json_target, write_json_target,
)

# The authors' defaults, as in sinklens.origins.fingerprint (which imports torch; a test keeps them equal).
DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, DEFAULT_BUFFER_K, DEFAULT_ALPHA, DEFAULT_SEED = 2000, 1024, 400, 0.01, 42


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "fingerprint", __doc__, help="SeedPrint lineage test between two models")
    parser.add_argument("model_a", metavar="A", help="first model spec")
    parser.add_argument("model_b", metavar="B", help="second model spec")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, metavar="N", help="random sequences (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help=f"tokens per sequence (default: {DEFAULT_SEQ_LEN}, at most n_ctx)")
    parser.add_argument("--input", choices=("token", "embedding"), default="token", metavar="KIND",
                        help="random input: token (default) or embedding")
    parser.add_argument("--buffer-k", type=int, default=DEFAULT_BUFFER_K, metavar="K", help="bottom-k identity dims (default: %(default)s)")
    parser.add_argument("--identity-mode", choices=("coset", "base"), default="coset", metavar="MODE",
                        help="coset (default) or base")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="decision threshold on p (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random inputs (default: %(default)s)")
    add_model_flags(parser)
    add_json_flag(parser, "the result")
    add_overwrite_flag(parser, "an earlier --json file")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sinklens.hooks import model_dims
    from sinklens.loading import load_model
    from sinklens.options import RunOptions
    from sinklens.origins.fingerprint import check_test_arguments, fingerprint
    from sinklens.validate import as_seed, optional_positive_int, positive_int, seq_len_within_context

    target = json_target(args.json, overwrite=args.overwrite)
    check_test_arguments(args.buffer_k, args.identity_mode, args.alpha, cli=True)  # before the models load and run
    positive_int(args.samples, what="--samples", minimum=2)
    optional_positive_int(args.seq_len, what="--seq-len")
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
    # full precision: p_value and alpha may differ in the 7th digit, and the file must say which is smaller
    write_json_target(target, {"model_a": args.model_a, "model_b": args.model_b, **result.to_dict()},
                      overwrite=args.overwrite, text=f"A = {args.model_a}\nB = {args.model_b}\n{result.summary()}")
    if target not in (None, "-"):
        print(f"wrote {target}")
    return 0
