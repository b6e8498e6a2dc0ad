"""``sinklens intervene``: apply one intervention and print the attention a position receives, per layer.

Example::

    sinklens intervene --method self-only --position 10 --text "The quick brown fox ..." --json out.json

prints, per layer, the attention received by position K (mean over heads and over the queries
after K) before and after, and writes the same to ``--json`` as ``{"layers", "before", "after", ...}``
(plus the per-head values, the sink's attention, residual norms, tracked dims and losses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sinklens.interventions.experiments import CREATE_METHODS, REMOVE_METHODS, InterventionResult, create_sink, remove_sink

METHODS = sorted({m.replace("_", "-") for m in CREATE_METHODS} | {m.replace("_", "-") for m in REMOVE_METHODS})


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from err


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "intervene", help="create or remove a sink with an intervention and report the attention it receives",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--method", required=True, choices=METHODS, help="intervention (create: self-only, restart, variance, transplant; remove: block, calibrate, clamp, ablate-neurons)")
    parser.add_argument("--position", type=int, default=None, help="position K to turn into a sink (create methods); the sink for remove methods (default 0)")
    parser.add_argument("--model", default="smollm2-135m", help="model spec for sinklens.loading.load_model (default smollm2-135m)")
    parser.add_argument("--text", action="append", default=None, help="input text (repeatable; default: the built-in prompts)")
    parser.add_argument("--layers", default=None, help="layers to intervene in, e.g. '0,1,2' (default all)")
    parser.add_argument("--alpha", type=float, default=None, help="amplification factor for --method variance (default 8)")
    parser.add_argument("--site", default=None, help="hook site for variance/calibrate (default attn.hook_z)")
    parser.add_argument("--dims", default=None, help="residual dims for transplant/clamp, e.g. '507'")
    parser.add_argument("--neurons", default=None, help="FFN neurons for ablate-neurons, e.g. '12,99'")
    parser.add_argument("--no-loss", action="store_true", help="skip the next-token loss (two fewer forward passes)")
    parser.add_argument("--json", default=None, help="write the result as JSON to this file")
    parser.add_argument("--out", default=None, help="directory for the figure intervention.png")
    parser.set_defaults(func=run)
    return parser


def intervene(model: Any, args: argparse.Namespace) -> InterventionResult:
    """The command's logic on an already-loaded model (used by :func:`run` and the tests)."""
    method = args.method.replace("-", "_")
    kw: dict[str, Any] = {}
    if args.site is not None:
        kw["site"] = args.site
    if args.alpha is not None:
        if method != "variance":
            raise ValueError(f"--alpha only applies to --method variance, not {args.method}.")
        kw["alpha"] = args.alpha
    if args.neurons is not None:
        kw["neurons"] = _int_list(args.neurons)
    common = dict(layers=_int_list(args.layers), dims=_int_list(args.dims), loss=not args.no_loss)
    texts = args.text
    if method in CREATE_METHODS:
        if args.position is None:
            raise ValueError(f"--method {args.method} needs --position K.")
        return create_sink(model, texts, args.position, method=method, **common, **kw)
    return remove_sink(model, texts, sink=args.position or 0, method=method, **common, **kw)


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


def run(args: argparse.Namespace) -> int:
    from sinklens.loading import load_model

    model = load_model(args.model)
    try:
        result = intervene(model, args)
    except ValueError as err:
        print(f"sinklens intervene: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=1))
    if args.out:
        result.plot(Path(args.out) / "intervention.png")
    return 0
