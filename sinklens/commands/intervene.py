"""``sinklens intervene``: apply one intervention and print the attention a position receives, per layer.

Example::

    sinklens intervene --method self-only --position 10 --text "The quick brown fox ..." --json out.json

prints, per layer, the attention received by position K (mean over heads and over the queries
after K) before and after, and writes the same, at full precision (``InterventionResult.to_dict()``), to
``--json`` as ``{"layers", "before", "after", ...}``
(plus the per-head values, the sink's attention, residual norms, tracked dims and losses; strict
JSON: a value that is not a finite number, e.g. the losses with ``--no-loss`` or on an encoder, is ``null``).

``--method`` is any intervention of :mod:`sinklens.interventions.registry`, with hyphens or
underscores: create methods (``self-only``, ``restart``, ``amplify``, ``transplant-dims``) turn
position K into a sink; remove methods (``block-keys``, ``calibrate``, ``clamp-dims``,
``edit-neurons``, ``variance-calibration``, in its ``attenuate`` mode) take away the sink at ``--position``
(default 0). The sinklens 0.1 names (``variance``, ``transplant``, ``block``, ``clamp``, ``ablate-neurons``)
still work.

The input is ``--text`` (default: the built-in prompts) or ``--random-tokens N`` sequences of
``--seq-len`` tokens; a model without a tokenizer (a run on a synthetic task) runs on 16 random-token
sequences unasked, and says so. Text prompts get the model's BOS (an encoder's ``[CLS] … [SEP]``) and random
sequences start with it (a model trained on a synthetic task: its BOS token 0), unless ``--no-bos``, as in
``sinklens analyze``; the JSON records it under ``options`` (``prepend_bos``, ``special_tokens``) with the
method's options.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sinklens.commands import (
    DEFAULT_RANDOM_SEQ_LEN, add_model_flags, add_overwrite_flag, check_model_flags, outside_run_internals, plain_help,
    random_token_inputs,
)
from sinklens.errors import InvalidArgumentError
from sinklens.inputs import is_encoder
from sinklens.interventions import registry
from sinklens.interventions.experiments import InterventionResult, create_sink, remove_sink
from sinklens.options import RunOptions


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise InvalidArgumentError(f"{flag} expects integers separated by commas, got {text!r}.") from None
    if not values:
        raise InvalidArgumentError(f"{flag} is empty; give at least one integer (e.g. {flag} 0,1).")
    repeated = [v for i, v in enumerate(values) if v in values[:i]]
    if repeated:  # the Python API keeps the first of each (validate.index_list); on the command line it is a typo
        raise InvalidArgumentError(f"{flag} {text!r} gives {repeated[0]} more than once; give each value once.")
    return values


def _method_help() -> str:
    create = ", ".join(n.replace("_", "-") for n in registry.names("create"))
    remove = ", ".join(n.replace("_", "-") for n in registry.names("remove"))
    return f"intervention (create: {create}; remove: {remove})"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "intervene", help="create or remove a sink with an intervention and report the attention it receives",
        description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--method", required=True, help=_method_help())
    parser.add_argument("--position", type=int, default=None, help="position K to turn into a sink (create methods); the sink for remove methods (default 0)")
    parser.add_argument("--model", default="smollm2-135m", help="model spec for sinklens.loading.load_model (default smollm2-135m)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", action="append", default=None, help="input text (repeatable; default: the built-in prompts)")
    source.add_argument("--random-tokens", type=int, metavar="N", default=None, help="N uniformly random token sequences instead")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"length of --random-tokens sequences (default: {DEFAULT_RANDOM_SEQ_LEN}, at most the model's context)")
    parser.add_argument("--layers", default=None, help="layers to intervene in, e.g. '0,1,2' (default all; required by edit-neurons)")
    parser.add_argument("--alpha", type=float, default=None, help="amplification factor for --method amplify (default 8)")
    parser.add_argument("--site", default=None, help="hook site for amplify/calibrate (default attn.hook_z)")
    parser.add_argument("--dims", default=None, help="residual dims for transplant-dims/clamp-dims, e.g. '507'")
    parser.add_argument("--neurons", default=None, help="FFN neurons for edit-neurons, e.g. '12,99' (needs --layers)")
    parser.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (it moves the sink)")
    add_model_flags(parser, batch_size=8)
    parser.add_argument("--no-loss", action="store_true", help="skip the next-token loss (two fewer forward passes; encoders have none)")
    parser.add_argument("--json", default=None, help="write the result as strict JSON to this file (full precision, as InterventionResult.to_dict())")
    parser.add_argument("--out", default=None, help="directory for the figure intervention.png")
    add_overwrite_flag(parser, "an earlier --json file or --out figure")
    parser.set_defaults(func=run)
    return parser


def _method_options(entry: registry.Intervention, args: argparse.Namespace) -> dict[str, Any]:
    """The factory options given on the command line; an option the method does not take is an error."""
    given = {"alpha": args.alpha, "site": args.site, "neurons": _int_list(args.neurons, "--neurons")}
    kw = {k: v for k, v in given.items() if v is not None}
    accepted = entry.options()
    for key in kw:
        if key not in accepted:
            raise InvalidArgumentError(f"--{key} does not apply to --method {args.method} ({entry.name}).")
    return kw


def check_args(args: argparse.Namespace) -> registry.Intervention:
    """Validate everything that needs no model (method, lists, output paths), before the model loads."""
    from sinklens.validate import no_finished_output, optional_positive_int, positive_int, writable_dir, writable_file

    entry = registry.get(args.method)
    if entry.role not in ("create", "remove"):
        raise InvalidArgumentError(f"--method {args.method} is neither a create nor a remove intervention.")
    if entry.role == "create" and args.position is None:
        raise InvalidArgumentError(f"--method {args.method} needs --position K (the position to turn into a sink).")
    check_model_flags(args)
    if args.position is not None:  # its upper bound (the prompt) is checked once the model has tokenized it
        positive_int(args.position, what="--position", minimum=0)
    optional_positive_int(args.random_tokens, what="--random-tokens")
    optional_positive_int(args.seq_len, what="--seq-len", minimum=2)  # the sink and a later position
    if args.seq_len is not None and args.text is not None:
        raise InvalidArgumentError(f"--seq-len {args.seq_len} sets the length of --random-tokens sequences, not of --text.")
    if entry.name == "edit_neurons" and args.layers is None:
        raise InvalidArgumentError(
            "--method edit-neurons needs --layers: a neuron index names a different neuron in each layer."
        )
    _int_list(args.layers, "--layers")
    _int_list(args.dims, "--dims")
    _method_options(entry, args)
    for option in entry.requires:
        if getattr(args, option, None) is None:
            raise InvalidArgumentError(f"--method {args.method} needs --{option} ({entry.requires[option]}).")
    overwrite = getattr(args, "overwrite", False)
    if args.json is not None:  # '' is refused by name, not read as "no file"
        json_path = writable_file(args.json, what="--json")
        outside_run_internals(json_path, what="--json", file=True)
        no_finished_output([json_path], overwrite=overwrite, flag="--json")
    if args.out is not None:
        outside_run_internals(Path(args.out), what="--out", file=False)
        out = writable_dir(args.out, what="--out", create=False)
        no_finished_output([out / "intervention.png"], overwrite=overwrite, flag="--out")
    return entry


def intervene(model: Any, args: argparse.Namespace) -> InterventionResult:
    """The command's logic on an already-loaded model (used by :func:`run` and the tests)."""
    entry = check_args(args)
    common = dict(layers=_int_list(args.layers, "--layers"), dims=_int_list(args.dims, "--dims"),
                  loss=False if args.no_loss else None,
                  options=RunOptions(batch_size=args.batch_size, device=args.device, prepend_bos=not args.no_bos,
                                     progress=False))
    kw = _method_options(entry, args)
    batches = random_token_inputs(model, args, command="intervene", text_flag="--text" if args.text else None,
                                  prepend_bos=not args.no_bos)
    inputs = args.text if batches is None else batches
    if entry.role == "create":
        return create_sink(model, inputs, args.position, method=entry.name, **common, **kw)
    return remove_sink(model, inputs, sink=args.position or 0, method=entry.name, **common, **kw)


def format_table(result: InterventionResult) -> str:
    """Per layer: attention received by the target before / after (mean over heads and later queries)."""
    lines = [
        f"method={result.method}  target position={result.target}  sink={result.sink}",
        f"{'layer':>5}  {'before':>8}  {'after':>8}  {'ratio':>7}",
    ]
    for layer, b, a in zip(result.layers, result.received_layer_before.tolist(), result.received_layer_after.tolist()):
        ratio = a / b if b > 0 else float("inf")
        lines.append(f"{layer:>5}  {b:8.4f}  {a:8.4f}  {ratio:7.2f}")
    if result.loss_before == result.loss_before:  # not NaN
        lines.append(f"next-token loss: {result.loss_before:.4f} -> {result.loss_after:.4f} nats")
    return "\n".join(lines)


def loss_note(model: Any, args: argparse.Namespace) -> str | None:
    """Why the loss line is missing when the user did not ask for ``--no-loss`` (an encoder has no next-token loss)."""
    if not args.no_loss and is_encoder(model):
        return "next-token loss: not defined for an encoder (bidirectional attention); left out"
    return None


def run(args: argparse.Namespace) -> int:
    from sinklens.export import write_json
    from sinklens.loading import load_model
    from sinklens.plotting.interventions import plot_intervention  # matplotlib: only when a figure is drawn

    check_args(args)  # usage errors before the model loads
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    result = intervene(model, args)
    # files first: a reader that closes stdout (`| head`) must not cost them
    if args.json is not None:
        write_json(args.json, result.to_dict(), digits=None, replace=args.overwrite)  # full precision, as to_dict()
    if args.out is not None:
        plot_intervention(result, Path(args.out) / "intervention.png")
    print(format_table(result))
    if note := loss_note(model, args):
        print(note)
    return 0
