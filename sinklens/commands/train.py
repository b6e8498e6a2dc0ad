"""``sinklens train``: pretrain a small LM with a chosen attention variant and track its sinks.

Examples::

    sinklens train --preset tiny --variant headwise_rms --data bigram-backcopy --steps 300 --out runs/hw
    sinklens train --config run.toml --set optim.lr=3e-4 --set data.seq_len=128 --out runs/a
    sinklens train --data ~/corpus --set data.tokenizer=bpe --set data.vocab_size=2048 --out runs/text
    sinklens train --data bigram-backcopy --intervention restart:positions=16 --out runs/moved
    torchrun --nproc_per_node 2 -m sinklens.cli train ... # DDP

Writes ``OUT/metrics.jsonl``, ``OUT/config.json``, the checkpoint files and ``OUT/figures/training.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sinklens.train.config import DATA_SOURCES, TrainConfig, load_config


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="pretrain a small LM and track its attention sinks",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="run directory (metrics, checkpoints, figures)")
    parser.add_argument("--config", help="a .json or .toml TrainConfig (flags and --set override it)")
    parser.add_argument("--preset", help="model preset of ModelConfig.from_preset (default: 'tiny' without --config)")
    parser.add_argument("--variant", help="attention variant (baseline, headwise_rms, gated, qk_norm, sigmoid, sink_logit, softpick)")
    parser.add_argument("--data", help=f"one of {list(DATA_SOURCES[:2])}, a text file/folder, a nanoGPT folder "
                                       "with train.bin, a .bin file, or hf:<dataset name>")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int, help="model init seed (the data order depends only on data.seed)")
    parser.add_argument("--data-seed", type=int)
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:1 ...")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field, e.g. --set optim.lr=3e-4 (repeatable; applied last)")
    parser.add_argument("--intervention", dest="interventions", action="append", default=[], metavar="NAME:K=V,...",
                        help="training-time intervention, e.g. restart:positions=16 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)
    return parser


def _data_overrides(spec: str) -> list[str]:
    """``--data`` → ``data.source`` / ``data.path`` overrides."""
    if spec in DATA_SOURCES:
        return [f"data.source={spec}"]
    if spec.startswith("hf:"):
        return ["data.source=hf", f"data.path={spec[3:]}"]
    path = Path(spec).expanduser()
    if path.suffix == ".bin" or (path / "train.bin").is_file():
        return ["data.source=memmap", f"data.path={path}"]
    return ["data.source=text", f"data.path={path}"]


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's :class:`TrainConfig`: config file, then preset and flags, then ``--set`` overrides,
    validated once at the end.

    For text, memmap and hf data ``model.d_vocab`` is set to the data's vocabulary unless
    ``--set model.d_vocab=...`` says otherwise.
    """
    from sinklens.train.config import DataConfig, override_dict
    from sinklens.train.model_config import ModelConfig

    data = load_config(args.config).to_dict() if args.config else TrainConfig().to_dict()
    if args.preset or not args.config:
        data["model"] = ModelConfig.from_preset(args.preset or "tiny").to_dict()
    flags = []
    if args.variant:
        flags.append(f"model.variant={args.variant}")
    if args.data:
        flags += _data_overrides(args.data)
    for flag, key in (("steps", "steps"), ("batch_size", "batch_size"), ("seq_len", "data.seq_len"), ("lr", "optim.lr"),
                      ("seed", "seed"), ("data_seed", "data.seed"), ("device", "device")):
        if getattr(args, flag) is not None:
            flags.append(f"{key}={getattr(args, flag)}")
    if args.interventions:
        flags.append(f"interventions={list(args.interventions)!r}")
    data = override_dict(data, flags + list(args.overrides))
    if data["data"]["source"] in ("text", "memmap", "hf") and not any(o.startswith("model.d_vocab=") for o in args.overrides):
        from sinklens.train.data import build_source

        data["model"]["d_vocab"] = build_source(DataConfig(**data["data"])).vocab_size
    return TrainConfig.from_dict(data)


def run(args: argparse.Namespace) -> int:
    from sinklens.plotting.training import plot_training
    from sinklens.train.loop import train

    cfg = build_config(args)
    result = train(cfg, out_dir=args.out, resume=args.resume, progress=not args.no_progress)
    out = Path(args.out)
    if result.history:
        plot_training({cfg.model.variant: result.history}, path=out / "figures" / "training.png")
    losses = result.losses()
    evals = result.evals()
    print(f"trained {cfg.model.variant} for {cfg.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if evals:
        last = evals[-1]
        print(
            f"final eval: val_loss {last['val_loss']:.4f}, sink_rate {last['sink_rate']:.3f}, "
            f"first_token_norm_ratio {last['first_token_norm_ratio']:.2f}, variance_ratio {last['variance_ratio']:.2f}"
        )
    print(f"run directory: {out}")
    return 0
