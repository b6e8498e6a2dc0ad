"""Sinks against context length: one sequence of the standard library's sources per length, read
from queries and keys (memory linear in the length); writes long_context.json and .png to --out.

Examples:
    sinklens context                                   # SmolLM2 at 256, 1024 and 4096 tokens
    sinklens context --lengths 512,8192 --bos --out ctx   # with the tokenizer's BOS first
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sinklens.commands import (
    add_bos_flag, add_command, add_model_flags, add_overwrite_flag, check_model_flags, int_list, result_folder,
)

FILES = ("long_context.json", "long_context.png")


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "context", __doc__, help="sink attention and sink rate against context length")
    parser.add_argument("--model", default="smollm2-135m", metavar="SPEC",
                        help="name, folder, .gguf, Hub id (default: %(default)s)")
    parser.add_argument("--lengths", default="256,1024,4096", metavar="N,N,...",
                        help="sequence lengths in tokens, BOS included (default: %(default)s)")
    parser.add_argument("--out", default="sinklens-context", metavar="DIR", help="output folder (default: %(default)s)")
    add_model_flags(parser)
    add_bos_flag(parser)
    add_overwrite_flag(parser, "an earlier long_context.json")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sinklens.analysis.long_context import context_sweep
    from sinklens.export import write_json
    from sinklens.loading import load_model
    from sinklens.options import RunOptions
    from sinklens.plotting.long_context import plot_context_sweep
    from sinklens.plotting.style import save_figure
    from sinklens.validate import writable_dir

    lengths = int_list(args.lengths, "--lengths")
    check_model_flags(args)
    existed = Path(args.out).expanduser().exists()
    out = writable_dir(args.out, what="--out")
    with result_folder(out, FILES[:1], overwrite=args.overwrite, existed=existed):
        start = time.perf_counter()
        model = load_model(args.model, device=args.device, dtype=args.dtype, check_patterns=False)
        result = context_sweep(model, lengths, options=RunOptions(batch_size=args.batch_size, device=args.device,
                                                                  prepend_bos=args.bos))
        write_json(out / FILES[0], {"model": str(args.model), **result.to_dict()})
        save_figure(plot_context_sweep(result), out / FILES[1])
    for p in result.points:
        print(f"{p.length:>6} tokens: attention to 0 {p.sink_attention:.3f}, sink rate {p.sink_rate:.3f}, "
              f"{p.n_secondary} secondary sinks, {len(p.residual_sinks)} residual sinks ({p.seconds:.1f} s)")
    print(f"wrote {', '.join(FILES)} to {out}/ in {time.perf_counter() - start:.1f} s")
    return 0
