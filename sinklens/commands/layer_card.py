"""``sinklens layer-card``: which layers to fine-tune (Layer Card, arXiv 2602.04019).

Per layer: resnorm, activation energy, coupling and LoRA cost. --check-steps trains LoRA on the
--top-k layers and on all layers and reports the share of the loss gain the top-k recover.

Examples::

    sinklens layer-card --top-k 6 --check-steps 100 --plot card.png --json card.json
"""

from __future__ import annotations

import argparse

from sinklens.commands import plain_help
from sinklens.commands.peft import add_output_flags, add_task_flags


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("layer-card", help="per-layer resnorm, energy, coupling and LoRA placement",
                                   description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_flags(parser)
    parser.add_argument("--rank", metavar="R", type=int, default=8, help="LoRA rank (default: 8)")
    parser.add_argument("--card-rows", metavar="N", type=int, default=8, help="rows the card uses (default: 8)")
    parser.add_argument("--no-coupling", action="store_true", help="skip the coupling (one backward per layer)")
    parser.add_argument("--top-k", metavar="K", type=int, default=None, help="name the K best layers")
    parser.add_argument("--objective", choices=("resnorm", "gain_per_param"), metavar="O",
                        default="resnorm", help="resnorm or gain_per_param (default: resnorm)")
    parser.add_argument("--check-steps", metavar="N", type=int, default=0, help="steps of the placement check (default: 0)")
    parser.add_argument("--lr", metavar="X", type=float, default=1e-3, help="check learning rate (default: 1e-3)")
    add_output_flags(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from sinklens.commands.peft import load_task, output_paths
    from sinklens.errors import InvalidArgumentError
    from sinklens.export import write_json
    from sinklens.peft.layer_card import layer_card, placement_check
    from sinklens.validate import positive_int

    positive_int(args.rank, what="--rank")
    positive_int(args.card_rows, what="--card-rows")
    positive_int(args.check_steps, what="--check-steps", minimum=0)
    if args.top_k is not None:
        positive_int(args.top_k, what="--top-k")
    if args.check_steps and args.top_k is None:
        raise InvalidArgumentError("--check-steps needs --top-k (the layers to check).")
    paths = output_paths(args)
    model, task = load_task(args)
    card = layer_card(model, task, layers=args.layers, n_rows=args.card_rows, rank=args.rank, coupling=not args.no_coupling)
    if args.top_k is not None:
        print(f"top {args.top_k} layers by {args.objective}: {card.place(args.top_k, args.objective)}")
        if args.check_steps:
            placement_check(model, task, card, k=args.top_k, objective=args.objective, steps=args.check_steps,
                            lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    print(card.summary())
    if "json" in paths:
        write_json(paths["json"], {"model": args.model, **card.to_dict()}, replace=args.overwrite)
        print(f"wrote {paths['json']}")
    if "plot" in paths:
        from sinklens.plotting.peft import plot_layer_card

        plot_layer_card(card, path=paths["plot"])
        print(f"wrote {paths['plot']}")
    return 0
