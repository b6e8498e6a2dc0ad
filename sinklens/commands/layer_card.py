"""Which layers to fine-tune: the Layer Card (arXiv 2602.04019).

Per layer: resnorm, activation energy, coupling and LoRA cost on an offline task. With --top-k K
and --check-steps N, LoRA trained on the K best layers and on all layers for N steps: the share
of all-layer LoRA's loss gain that the K layers recover.

Examples:
    sinklens layer-card --top-k 6 --check-steps 100 --plot card.png --json card.json
"""

from __future__ import annotations

import argparse

from sinklens.commands import add_command
from sinklens.commands.peft import add_task_flags


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "layer-card", __doc__, help="per-layer resnorm, energy, coupling and LoRA placement")
    add_task_flags(parser)
    parser.add_argument("--card-rows", type=int, default=8, metavar="N", help="rows the card uses (default: %(default)s)")
    parser.add_argument("--no-coupling", action="store_true", help="skip the coupling (one backward per layer)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="name the K best layers")
    parser.add_argument("--objective", choices=("resnorm", "gain_per_param"), default="resnorm", metavar="SCORE",
                        help="placement score: resnorm (default) or gain_per_param")
    parser.add_argument("--check-steps", type=int, default=0, metavar="N", help="steps of the placement check (default: 0)")
    parser.add_argument("--lr", type=float, default=1e-3, metavar="X", help="check learning rate (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sinklens.commands.peft import finish, prepare
    from sinklens.errors import InvalidArgumentError
    from sinklens.peft.layer_card import layer_card, placement_check
    from sinklens.plotting.peft import plot_layer_card
    from sinklens.validate import positive_int

    positive_int(args.card_rows, what="--card-rows")
    positive_int(args.check_steps, what="--check-steps", minimum=0)
    if args.top_k is not None:
        positive_int(args.top_k, what="--top-k")
    elif args.check_steps:
        raise InvalidArgumentError("--check-steps needs --top-k (the layers to check).")
    model, task, outputs = prepare(args)
    card = layer_card(model, task, layers=args.layers, n_rows=args.card_rows, rank=args.rank, coupling=not args.no_coupling)
    if args.top_k is not None:
        print(f"top {args.top_k} layers by {args.objective}: {card.place(args.top_k, args.objective)}")
        if args.check_steps:
            placement_check(model, task, card, k=args.top_k, objective=args.objective, steps=args.check_steps,
                            lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    print(card.summary())
    return finish(args, outputs, card.to_dict(), lambda: plot_layer_card(card))
