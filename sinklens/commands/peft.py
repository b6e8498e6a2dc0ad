"""``sinklens peft METHOD``: train prefix-tuning, Prefix-Tuning+ or LoRA on a frozen model, offline.

prefix: keys/values in each head's softmax; prefix-plus: head output += phi(q)^T M (Prefix-Tuning+);
lora: W_Q W_K W_V W_O W_in W_out. Prefix methods also report the prefix's share per input length.

Examples::

    sinklens peft prefix --task keyword --steps 200 --plot prefix.png --json prefix.json
"""

from __future__ import annotations

import argparse

from sinklens.commands import add_model_flags, add_overwrite_flag, check_model_flags, plain_help


#: Adam's step moves every entry of M by about lr, and phi(q) sums d_head positive features: 1e-2 made
#: prefix-plus (and the reparametrised prefix) diverge on SmolLM2 within 20 steps.
DEFAULT_LR = {"prefix": 1e-3, "prefix-plus": 1e-4, "lora": 1e-3}


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --task, --rows, --seq-len, --seed and the model flags, shared with ``layer-card``."""
    parser.add_argument("--model", metavar="SPEC", default="smollm2-135m", help="model spec (default: %(default)s)")
    parser.add_argument("--task", choices=("text", "keyword"), metavar="T", default="text", help="text or keyword (default: text)")
    parser.add_argument("--rows", metavar="N", type=int, default=64, help="task rows, eval rows included (default: 64)")
    parser.add_argument("--seq-len", metavar="N", type=int, default=32, help="tokens per row (default: 32)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="seed of the task and the adapter (default: 0)")
    parser.add_argument("--layers", metavar="L", type=int, nargs="+", default=None, help="layers to adapt (default: all)")
    add_model_flags(parser, batch_size=8)


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the result as strict JSON")
    parser.add_argument("--plot", metavar="FILE", help="save the figure (png, pdf, svg)")
    add_overwrite_flag(parser, "--json/--plot files")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from sinklens.peft.adapters import METHODS

    parser = subparsers.add_parser("peft", help="train prefix-tuning, Prefix-Tuning+ or LoRA on a frozen model",
                                   description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=METHODS, metavar="METHOD", help=argparse.SUPPRESS)  # described above
    add_task_flags(parser)
    parser.add_argument("--steps", metavar="N", type=int, default=100, help="AdamW steps (default: 100)")
    parser.add_argument("--lr", metavar="X", type=float, default=None, help="learning rate (default: 1e-4 prefix-plus, 1e-3 others)")
    parser.add_argument("--prefix-len", metavar="P", type=int, default=8, help="prefix vectors per layer (default: 8)")
    parser.add_argument("--rank", metavar="R", type=int, default=8, help="LoRA rank (default: 8)")
    parser.add_argument("--input-lengths", metavar="N", type=int, nargs="+", default=None,
                        help="share measured at (default: 4 8 .. --seq-len)")
    add_output_flags(parser)
    parser.set_defaults(func=run)
    return parser


def load_task(args: argparse.Namespace):
    """Check the shared flags, load the model, build the task: ``(model, task)``."""
    from sinklens.loading import load_model
    from sinklens.peft.train import keyword_task, text_task
    from sinklens.validate import as_seed, positive_int

    check_model_flags(args)
    positive_int(args.rows, what="--rows", minimum=3)
    positive_int(args.seq_len, what="--seq-len", minimum=4)
    as_seed(args.seed, what="--seed")
    model = load_model(args.model, device=args.device, dtype=args.dtype, check_patterns=False)
    make = text_task if args.task == "text" else keyword_task
    n_eval = max(1, args.rows // 8)
    return model, make(model, n_rows=args.rows, seq_len=args.seq_len, n_eval=n_eval, seed=args.seed)


def output_paths(args: argparse.Namespace):
    from sinklens.validate import no_finished_output, writable_file

    paths = {k: writable_file(getattr(args, k), what=f"--{k}") for k in ("json", "plot") if getattr(args, k) is not None}
    no_finished_output(list(paths.values()), overwrite=args.overwrite, flag="--json/--plot")
    return paths


def run(args: argparse.Namespace) -> int:
    from sinklens.export import write_json
    from sinklens.peft.adapters import make_adapter
    from sinklens.peft.train import train_adapter
    from sinklens.validate import positive_int

    positive_int(args.steps, what="--steps", minimum=0)
    options = {"prefix": {"n_prefix": positive_int(args.prefix_len, what="--prefix-len")},
               "lora": {"rank": positive_int(args.rank, what="--rank")}}.get(args.method, {})
    paths = output_paths(args)
    model, task = load_task(args)
    adapter = make_adapter(model, args.method, layers=args.layers, seed=args.seed, **options)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.method]
    result = train_adapter(model, adapter, task, steps=args.steps, lr=lr, batch_size=args.batch_size, seed=args.seed)
    out = {"model": args.model, "training": result.to_dict()}
    print(result.summary())
    sinks = None
    if args.method != "lora" and adapter.layers == list(range(adapter.dims.n_layers)):
        from sinklens.peft.sinks import measure_prefix_sinks

        lengths = args.input_lengths or sorted({n for n in (4, 8, 16, 32, 64, 128, 256) if n < task.seq_len} | {task.seq_len})
        sinks = measure_prefix_sinks(model, [adapter], task.eval, input_lengths=lengths)
        out["sinks"] = sinks.to_dict()
        print(sinks.summary())
    if "json" in paths:
        write_json(paths["json"], out, replace=args.overwrite)
        print(f"wrote {paths['json']}")
    if "plot" in paths:
        from sinklens.plotting.peft import plot_prefix_sinks, plot_training

        if sinks is not None:
            plot_prefix_sinks(sinks, path=paths["plot"])
        else:
            plot_training([result], path=paths["plot"])
        print(f"wrote {paths['plot']}")
    return 0
