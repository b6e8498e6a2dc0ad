"""Train prefix-tuning, Prefix-Tuning+ or LoRA on a frozen model, offline.

METHOD: prefix (keys/values inside each head's softmax), prefix-plus (head output += phi(q)^T M,
PrefixMemory-Tuning) or lora (W_Q W_K W_V W_O W_in W_out); prefix methods also report their share.

Examples:
    sinklens peft prefix --task keyword --steps 200 --plot prefix.png --json prefix.json
"""

from __future__ import annotations

import argparse

from sinklens.commands import (
    add_command, add_json_flag, add_model_flags, add_overwrite_flag, check_model_flags, json_target, write_json_target,
)

#: Adam moves every entry by about lr: on SmolLM2 prefix-plus diverged at 1e-2, prefix worsened at 1e-3.
DEFAULT_LR = {"prefix": 1e-4, "prefix-plus": 1e-4, "lora": 1e-3}
METHODS = tuple(DEFAULT_LR)  # sinklens.peft.adapters.METHODS, named here so that --help imports no torch


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", metavar="SPEC",
                        help="name, folder, .gguf, Hub id (default: %(default)s)")
    parser.add_argument("--task", choices=("text", "keyword"), default="text", help="offline task (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=64, metavar="N", help="task rows, 1/8 held out (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=32, metavar="N", help="tokens per row (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the task and adapters (default: %(default)s)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, metavar="L", help="layers to adapt (default: all)")
    parser.add_argument("--rank", type=int, default=8, metavar="R", help="LoRA rank (default: %(default)s)")
    add_model_flags(parser)
    add_json_flag(parser, "the result")
    parser.add_argument("--plot", metavar="FILE", help="save the figure (png, pdf, svg)")
    add_overwrite_flag(parser, "--json/--plot files")


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "peft", __doc__, help="train prefix-tuning, Prefix-Tuning+ or LoRA")
    parser.add_argument("method", choices=METHODS, metavar="METHOD", help=", ".join(METHODS))
    add_task_flags(parser)
    parser.add_argument("--steps", type=int, default=100, metavar="N", help="AdamW steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=None, metavar="X", help="learning rate (default: 1e-3 lora, else 1e-4)")
    parser.add_argument("--prefix-len", type=int, default=8, metavar="P", help="prefix vectors per layer (default: %(default)s)")
    parser.add_argument("--input-lengths", type=int, nargs="+", default=None, metavar="N",
                        help="lengths for the share (default: 4 8 .. --seq-len)")
    parser.set_defaults(func=run)


def prepare(args: argparse.Namespace):
    """Check the shared flags and the outputs, load the model, build the task: ``(model, task, outputs)``."""
    from sinklens.loading import load_model
    from sinklens.peft.train import keyword_task, text_task
    from sinklens.validate import as_seed, no_finished_output, positive_int, writable_file

    check_model_flags(args)
    for flag, minimum in (("rows", 3), ("seq_len", 4), ("rank", 1)):
        positive_int(getattr(args, flag), what="--" + flag.replace("_", "-"), minimum=minimum)
    as_seed(args.seed, what="--seed")
    plot = writable_file(args.plot, what="--plot") if args.plot else None
    if plot:
        no_finished_output([plot], overwrite=args.overwrite, flag="--plot")
    outputs = (json_target(args.json, overwrite=args.overwrite), plot)
    model = load_model(args.model, device=args.device, dtype=args.dtype, check_patterns=False)
    make = text_task if args.task == "text" else keyword_task
    return model, make(model, n_rows=args.rows, seq_len=args.seq_len, n_eval=max(1, args.rows // 8), seed=args.seed), outputs


def finish(args: argparse.Namespace, outputs, data: dict, figure) -> int:
    from sinklens.plotting.style import save_figure

    write_json_target(outputs[0], {"model": str(args.model), **data}, overwrite=args.overwrite)
    if outputs[1]:
        print(f"wrote {save_figure(figure(), outputs[1])}")
    return 0


def run(args: argparse.Namespace) -> int:
    from sinklens.peft.adapters import make_adapter
    from sinklens.peft.sinks import measure_prefix_sinks
    from sinklens.peft.train import train_adapter
    from sinklens.plotting.peft import plot_prefix_sinks, plot_training
    from sinklens.validate import positive_int

    positive_int(args.steps, what="--steps", minimum=0)
    options = {"prefix": {"n_prefix": positive_int(args.prefix_len, what="--prefix-len")},
               "lora": {"rank": args.rank}}.get(args.method, {})
    model, task, outputs = prepare(args)
    adapter = make_adapter(model, args.method, layers=args.layers, seed=args.seed, **options)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.method]
    result = train_adapter(model, adapter, task, steps=args.steps, lr=lr, batch_size=args.batch_size, seed=args.seed)
    print(result.summary())
    data, sinks = {"training": result.to_dict()}, None
    if args.method != "lora" and adapter.layers == list(range(adapter.dims.n_layers)):
        lengths = args.input_lengths or sorted({n for n in (4, 8, 16, 32, 64, 128, 256) if n < task.seq_len} | {task.seq_len})
        sinks = measure_prefix_sinks(model, [adapter], task.eval, input_lengths=lengths)
        data["sinks"] = sinks.to_dict()
        print(sinks.summary())
    return finish(args, outputs, data, lambda: plot_prefix_sinks(sinks) if sinks else plot_training([result]))
