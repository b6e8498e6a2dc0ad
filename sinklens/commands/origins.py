"""The init-time picture of a model: token preference, contraction and positional discrepancy on random
token sequences. Prints the summaries and writes origins.json plus three PNG figures to --out.

origins.json records init_seed, the seed the weights were drawn with (--init-seed, the S of
SPEC@init:S, a run's own seed for RUN@init, 0 for SPEC@init; null for the weights as loaded).
On an encoder (BERT) token preference is skipped, and origins.json says why.

Examples:
    sinklens origins --model smollm2-135m --init-seed 0 --out origins-report
    sinklens origins --model runs/a@init
    sinklens origins --model runs/a            # the trained model, for comparison
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sinklens.commands import (
    add_command, add_model_flags, add_overwrite_flag, check_model_flags, outside_run_internals, result_folder,
)
from sinklens.options import SEQ_LEN


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "origins", __doc__,
                         help="init-time token preference, contraction and positional discrepancy")
    parser.add_argument("--model", default="smollm2-135m", help="model spec, SPEC@init:S too (default: %(default)s)")
    parser.add_argument("--init-seed", type=int, default=None, metavar="S",
                        help="re-initialise the architecture with this seed (default: the weights as loaded)")
    parser.add_argument("--sequences", type=int, default=128, metavar="N", help="random sequences (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help=f"tokens per sequence (default: {SEQ_LEN}, at most n_ctx)")
    parser.add_argument("--bos", action="store_true", help="prepend the BOS token (position 0 then leaves the summaries)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    add_model_flags(parser)
    parser.add_argument("--out", default="origins-report", metavar="DIR", help="output folder (default: %(default)s)")
    add_overwrite_flag(parser, "the origins.json and figures already in --out")
    parser.add_argument("--no-figures", action="store_true", help="write origins.json only")
    parser.set_defaults(func=run)


#: The figures ``origins`` draws (``--no-figures`` removes earlier ones), with what each shows, for ``index.md``.
FIGURE_FILES = {
    "rank_probability.png": "mean next-token probability against its rank over the random sequences (log-log; "
                            "dotted: uniform 1/d_vocab)",
    "contraction.png": "mean cosine between residual streams at every site, across sequences (inter) and within one "
                       "(intra), and each sublayer's share of the change",
    "positional.png": "variance over sequences of each position's attention output / the later half's, by layer "
                      "(> 1: that position varies more)",
}


def check_init_seed(model: str, init_seed: int) -> None:
    """Refuse ``--init-seed S`` beside a ``--model SPEC@init:T`` with another seed ``T``."""
    from sinklens.errors import InvalidArgumentError
    from sinklens.loading.init import parse_init_spec

    parsed = parse_init_spec(str(model))
    if parsed is not None and parsed.seed is not None and parsed.seed != init_seed:
        raise InvalidArgumentError(
            f"--init-seed {init_seed} conflicts with the seed {parsed.seed} of --model {str(model)!r}; give the seed once "
            f"(--model {parsed.base}@init:{init_seed}, or --model {parsed.base}@init --init-seed {init_seed}).")


def effective_init_seed(model_spec: str, init_seed: int | None, model: Any) -> int | None:
    """The seed the loaded weights were drawn with: ``init_seed``, else the ``S`` of ``SPEC@init:S``, else for
    ``SPEC@init`` a run's own seed or 0; None without ``@init`` (the weights as loaded)."""
    from sinklens.loading.init import parse_init_spec

    parsed = parse_init_spec(str(model_spec))
    if init_seed is not None or parsed is None:
        return init_seed
    if parsed.seed is not None:
        return parsed.seed
    train_config = getattr(model, "train_config", None)
    return int(train_config.seed) if train_config is not None else 0


def check_bos(model: Any, model_spec: str) -> None:
    """Refuse ``--bos`` (:class:`InvalidArgumentError`) on a model whose tokenizer names no BOS (or CLS) token."""
    from sinklens.errors import InvalidArgumentError
    from sinklens.inputs import bos_token_id

    if getattr(model, "tokenizer", None) is None:  # random_token_batches puts token 0 at position 0
        return
    try:
        bos_token_id(model)
    except InvalidArgumentError as err:
        tok = model.tokenizer
        bos, unk = getattr(tok, "bos_token", None), getattr(tok, "unk_token_id", None)
        unknown = ", the unknown token" if unk is not None and getattr(tok, "bos_token_id", None) == unk else ""
        raise InvalidArgumentError(f"--bos: the tokenizer of {model_spec!r} has no BOS (or CLS) token of its own "
                                   f"(bos_token={bos!r}{unknown}); run without --bos.") from err


def run(args: argparse.Namespace) -> int:
    from sinklens.errors import UnsupportedArchitectureError
    from sinklens.export import staged_outputs, write_json, write_text_atomic
    from sinklens.hooks import model_dims
    from sinklens.loading import load_model
    from sinklens.options import RunOptions
    from sinklens.origins import contraction, positional_discrepancy, token_preference
    from sinklens.origins.preference import random_tokens_after_bos, refuse_encoder
    from sinklens.validate import as_seed, no_finished_output, positive_int, seq_len_within_context, writable_dir

    outside_run_internals(Path(args.out), what="--out", file=False)
    out = writable_dir(args.out, what="--out", create=False)
    no_finished_output([out / "origins.json"], overwrite=args.overwrite, flag="--out")
    positive_int(args.sequences, what="--sequences", minimum=2)
    if args.seq_len is not None:  # the default is capped at the model's context once it is loaded
        positive_int(args.seq_len, what="--seq-len", minimum=2)
        random_tokens_after_bos(args.seq_len, args.bos, what="--seq-len", bos="--bos")
    check_model_flags(args)
    as_seed(args.seed, what="--seed")
    if args.init_seed is not None:
        as_seed(args.init_seed, what="--init-seed")
        check_init_seed(args.model, args.init_seed)
    with result_folder(out, ["origins.json"], overwrite=args.overwrite):
        start = time.perf_counter()
        print(f"loading {args.model}{'' if args.init_seed is None else f' at init (seed {args.init_seed})'} ...",
              file=sys.stderr)
        model = load_model(args.model, device=args.device, dtype=args.dtype, init_seed=args.init_seed,
                           check_patterns=False)
        n_ctx = model_dims(model).n_ctx
        seq_len_within_context(args.seq_len, n_ctx)
        seq_len = args.seq_len or min(SEQ_LEN, n_ctx)
        random_tokens_after_bos(seq_len, args.bos, what="--seq-len", bos="--bos")
        if args.bos:
            check_bos(model, str(args.model))
        opts = RunOptions(batch_size=args.batch_size, progress=True)
        common = dict(n_sequences=args.sequences, seq_len=seq_len, prepend_bos=args.bos, seed=args.seed)
        try:  # token preference cannot run on an encoder
            refuse_encoder(model, "token preference")
            skipped = None
        except UnsupportedArchitectureError as err:
            skipped = str(err)
        pref = None if skipped else token_preference(model, **common, options=opts.replace(desc="token preference"))
        con = contraction(model, **common, options=opts.replace(desc="contraction"))
        pos = positional_discrepancy(model, **common, options=opts.replace(desc="positional"))
        ps = None if pref is None else pref.summary()
        # files first (a reader that closes stdout, `| head`, must not cost them), all at once (staged_outputs): an
        # error or Ctrl-C while writing leaves an earlier result as it was, and figures it does not draw are removed
        init_seed = effective_init_seed(str(args.model), args.init_seed, model)
        with staged_outputs(out, marker="origins.json", owned=(*FIGURE_FILES, "index.md")) as stage:
            write_json(stage / "origins.json", {"model": str(args.model), "init_seed": init_seed, "token_preference": ps,
                                                **({"token_preference_skipped": skipped} if skipped else {}),
                                                "contraction": con.summary(), "positional": pos.summary()})
            drawn = () if args.no_figures else tuple(FIGURE_FILES)[0 if pref is not None else 1:]
            if drawn:
                from sinklens.plotting.origins import plot_contraction, plot_positional, plot_rank_probability

                if pref is not None:
                    plot_rank_probability({str(args.model): pref}, path=stage / "rank_probability.png")
                plot_contraction(con, path=stage / "contraction.png")
                plot_positional(pos, path=stage / "positional.png")
                write_text_atomic(stage / "index.md", "\n".join([
                    f"# sinklens origins: {args.model}", "", "- `origins.json`: every number (strict JSON).",
                    *(f"- `{name}`: {FIGURE_FILES[name]}." for name in drawn)]) + "\n")
        _print_results(ps, skipped, con, pos, getattr(model, "tokenizer", None))
        print(f"\nwrote {out}/origins.json{f' and {len(drawn)} figures' if drawn else ''} in "
              f"{time.perf_counter() - start:.1f} s")
    return 0


def _print_results(ps: dict[str, Any] | None, skipped: str | None, con: Any, pos: Any, tok: Any) -> None:
    if ps is None:
        print(f"\ntoken preference skipped: {skipped}")
    else:
        print(f"\ntoken preference over {ps['n_sequences']} random sequences x {ps['seq_len']} tokens:")
        print(f"  max/median probability ratio {ps['max_median_ratio']:.3g}; argmax entropy {ps['argmax_entropy']:.3f} "
              f"nats (uniform {ps['argmax_entropy_uniform']:.3f}); argmax Gini {ps['argmax_gini']:.3f}")
        if ps["argmax_ties"]:
            print(f"  {ps['argmax_ties']} predictions with a tied largest logit have no argmax and are not counted")
        for row in ps["top"][:5]:
            text = repr(tok.decode([row["token"]])) if tok is not None else ""
            print(f"  token {row['token']:>6} {text:<14} p = {row['prob']:.3g} ({row['rel_uniform']:.1f}x uniform), "
                  f"alignment rank {con.alignment_rank(row['token'])}")
    print("\ncontraction (mean cosine; inter = across sequences, intra = within a sequence):")
    print(f"  {'site':<10} {'inter':>8} {'intra':>8} {'dir share':>10} {'stability':>10}")
    for s in con.sites:
        extra = f"{s.direction_share:>10.3f} {s.direction_stability:>10.3f}" if s.direction is not None else ""
        print(f"  {s.name:<10} {s.inter_mean:>8.3f} {s.intra:>8.3f} {extra}")
    share = con.share("inter_mean")
    print(f"  share of the inter-sequence change: attention {float(share[:, 0].sum()):.2f}, MLP {float(share[:, 1].sum()):.2f}; "
          f"{con.asymmetry_text()}")
    ratio = pos.first_token_ratio("attn_out_var")
    print(f"\npositional discrepancy: attention-output variance at position {pos.first_counted} / later half, by layer: "
          + " ".join(f"{float(r):.2g}" for r in ratio))
    if not pos.causal:
        print("  (bidirectional encoder: every query averages all positions, so no positional discrepancy is expected)")
