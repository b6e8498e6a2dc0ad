"""Apply one intervention; print, per layer, the attention a position receives before and after it.

Create methods (self-only, restart, amplify, transplant-dims) turn --position K into a sink; remove
methods (block-keys, calibrate, clamp-dims, edit-neurons, variance-calibration) take the sink away.

Examples:
    sinklens intervene --method self-only --position 10 --text "The quick brown fox" --json out.json
    sinklens intervene --method block-keys --random-tokens 8 --out figs
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinklens.commands import (
    add_bos_flag, add_command, add_json_flag, add_model_flags, add_overwrite_flag, check_model_flags, int_list,
    json_target, outside_run_internals, random_token_inputs, write_json_target,
)
from sinklens.errors import InvalidArgumentError
from sinklens.options import SEQ_LEN

if TYPE_CHECKING:
    from sinklens.interventions import registry
    from sinklens.interventions.experiments import InterventionResult


def add_parser(subparsers: Any) -> None:
    parser = add_command(subparsers, "intervene", __doc__,
                         help="create or remove a sink with an intervention and report the attention it receives")
    parser.add_argument("--method", required=True, help="intervention name, with hyphens or underscores")
    parser.add_argument("--position", type=int, default=None, metavar="K",
                        help="position to make a sink, or sink to remove (default 0)")
    parser.add_argument("--model", default="smollm2-135m", metavar="SPEC",
                        help="name, folder, .gguf, Hub id (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", action="extend", nargs="+", metavar="T", help="one or more prompts (repeatable)")
    source.add_argument("--random-tokens", type=int, metavar="N", default=None, help="N uniformly random token sequences")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help=f"tokens per random sequence (default: {SEQ_LEN}, at most n_ctx)")
    parser.add_argument("--layers", default=None, help="layers to intervene in, e.g. 0,1,2 (default: all)")
    parser.add_argument("--alpha", type=float, default=None, help="amplification factor of amplify (default: 8)")
    parser.add_argument("--site", default=None, help="hook site of amplify / calibrate (default: attn.hook_z)")
    parser.add_argument("--dims", default=None, help="residual dims of transplant-dims / clamp-dims, e.g. 507")
    parser.add_argument("--neurons", default=None, help="FFN neurons of edit-neurons, e.g. 12,99 (needs --layers)")
    add_bos_flag(parser)
    add_model_flags(parser)
    parser.add_argument("--no-loss", action="store_true", help="skip the next-token loss (two fewer passes)")
    add_json_flag(parser, "the result")
    parser.add_argument("--out", default=None, metavar="DIR", help="folder for the figure intervention.png")
    add_overwrite_flag(parser, "an earlier --json file or --out figure")
    parser.set_defaults(func=run)


def _method_options(entry: registry.Intervention, args: argparse.Namespace) -> dict[str, Any]:
    """The factory options given on the command line; an option the method does not take is an error."""
    given = {"alpha": args.alpha, "site": args.site, "neurons": int_list(args.neurons, "--neurons")}
    kw = {k: v for k, v in given.items() if v is not None}
    if extra := [key for key in kw if key not in entry.options()]:
        raise InvalidArgumentError(f"--{extra[0]} does not apply to --method {args.method} ({entry.name}).")
    return kw


def check_args(args: argparse.Namespace) -> registry.Intervention:
    """Validate everything that needs no model (method, lists, output paths), before the model loads."""
    from sinklens.interventions import registry
    from sinklens.validate import no_finished_output, optional_positive_int, writable_dir

    entry = registry.get(args.method)
    if entry.role not in ("create", "remove"):
        raise InvalidArgumentError(f"--method {args.method} is neither a create nor a remove intervention.")
    if entry.role == "create" and args.position is None:
        raise InvalidArgumentError(f"--method {args.method} needs --position K (the position to turn into a sink).")
    check_model_flags(args)
    optional_positive_int(args.position, what="--position", minimum=0)  # upper bound: once tokenized
    optional_positive_int(args.random_tokens, what="--random-tokens")
    optional_positive_int(args.seq_len, what="--seq-len", minimum=2)  # the sink and a later position
    if args.seq_len is not None and args.text is not None:
        raise InvalidArgumentError(f"--seq-len {args.seq_len} sets the length of --random-tokens sequences, not of --text.")
    if entry.name == "edit_neurons" and args.layers is None:
        raise InvalidArgumentError("--method edit-neurons needs --layers: a neuron index names a different neuron "
                                   "in each layer.")
    int_list(args.layers, "--layers")
    int_list(args.dims, "--dims")
    _method_options(entry, args)
    for option in entry.requires:
        if getattr(args, option, None) is None:
            raise InvalidArgumentError(f"--method {args.method} needs --{option} ({entry.requires[option]}).")
    args.json = json_target(args.json, overwrite=args.overwrite)
    if args.out is not None:
        outside_run_internals(Path(args.out), what="--out", file=False)
        out = writable_dir(args.out, what="--out", create=False)
        no_finished_output([out / "intervention.png"], overwrite=args.overwrite, flag="--out")
    return entry


def intervene(model: Any, args: argparse.Namespace, entry: registry.Intervention) -> InterventionResult:
    """The command's logic on an already-loaded model, for the arguments :func:`check_args` accepted as ``entry``."""
    from sinklens.interventions.experiments import create_sink, remove_sink
    from sinklens.options import RunOptions

    options = RunOptions(batch_size=args.batch_size, device=args.device, prepend_bos=args.bos, progress=False)
    common = dict(layers=int_list(args.layers, "--layers"), dims=int_list(args.dims, "--dims"),
                  loss=False if args.no_loss else None, options=options)
    kw = _method_options(entry, args)
    batches = random_token_inputs(model, args, command="intervene", text_flag="--text" if args.text else None)
    inputs = args.text if batches is None else batches
    if entry.role == "create":
        return create_sink(model, inputs, args.position, method=entry.name, **common, **kw)
    return remove_sink(model, inputs, sink=args.position or 0, method=entry.name, **common, **kw)


def format_table(result: InterventionResult) -> str:
    """Per layer: attention received by the target before / after (mean over heads and later queries)."""
    lines = [f"method={result.method}  target position={result.target}  sink={result.sink}",
             f"{'layer':>5}  {'before':>8}  {'after':>8}  {'ratio':>7}"]
    for layer, b, a in zip(result.layers, result.received_layer_before.tolist(), result.received_layer_after.tolist()):
        lines.append(f"{layer:>5}  {b:8.4f}  {a:8.4f}  {a / b if b > 0 else float('inf'):7.2f}")
    if result.loss_before == result.loss_before:  # not NaN
        lines.append(f"next-token loss: {result.loss_before:.4f} -> {result.loss_after:.4f} nats")
    return "\n".join(lines)


def loss_note(model: Any, args: argparse.Namespace) -> str | None:
    """Why the loss line is missing when the user did not ask for ``--no-loss`` (an encoder has no next-token loss)."""
    from sinklens.inputs import is_encoder

    encoder = not args.no_loss and is_encoder(model)
    return "next-token loss: not defined for an encoder (bidirectional attention); left out" if encoder else None


def run(args: argparse.Namespace) -> int:
    from sinklens.loading import load_model
    from sinklens.plotting.interventions import plot_intervention  # matplotlib: only when a figure is drawn

    entry = check_args(args)  # usage errors before the model loads
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    result = intervene(model, args, entry)
    if args.out is not None:  # files first: a reader that closes stdout (`| head`) must not cost them
        plot_intervention(result, Path(args.out) / "intervention.png")
    note = loss_note(model, args)
    write_json_target(args.json, result.to_dict(), overwrite=args.overwrite,
                      text=format_table(result) + (f"\n{note}" if note else ""))
    return 0
