"""Pretrain a small LM with an attention variant and track its sinks: OUT/config.json, metrics.jsonl,
checkpoints, figures/training.png. A run folder is replaced only with --resume or --overwrite.

Every config field is a flag, its key with hyphens (--optim.lr, --data.seq-len; --fields lists
them); --set KEY=VALUE takes the key as config files write it (--set data.seq_len=128). Applied
in order: --config or --preset, the flags below, --set, the field flags.

Examples:
    sinklens train --preset tiny --variant headwise_rms --data bigram-backcopy --out runs/hw
    sinklens train --config run.toml --optim.lr 3e-4 --data.seq-len 128 --out runs/a
    sinklens train --out runs/hw --resume --steps 600   # continue a run, and train it longer
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from sinklens.commands import add_command
from sinklens.options import SEQ_LEN

if TYPE_CHECKING:
    from sinklens.sinklm.config import TrainConfig

#: The synthetic --data sources; any other --data is a path or hf:NAME.
SYNTHETIC_DATA = ("bigram-backcopy", "markov")


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "train", __doc__, help="pretrain a small LM and track its attention sinks")
    parser.add_argument("--out", metavar="DIR", help="run folder (metrics, checkpoints, figures); required")
    parser.add_argument("--config", metavar="FILE", help="a .json or .toml TrainConfig")
    parser.add_argument("--preset", help="tiny (default without --config), small, 124m, ...")
    parser.add_argument("--variant", metavar="SPEC",
                        help="attention variant, e.g. headwise_rms:gain=shared")
    parser.add_argument("--data", metavar="SOURCE",
                        help=f"{' or '.join(SYNTHETIC_DATA)}, a text file or folder, a nanoGPT folder or .bin, hf:NAME")
    parser.add_argument("--steps", metavar="N", help="optimizer steps (default: 300)")
    parser.add_argument("--batch-size", metavar="N", help="sequences per optimizer step (default: 16)")
    parser.add_argument("--seq-len", metavar="N", help=f"short for --data.seq-len (default: {SEQ_LEN})")
    parser.add_argument("--lr", metavar="LR", help="short for --optim.lr (default: 0.001)")
    parser.add_argument("--seed", metavar="S", help="model init seed (data order: --data.seed)")
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="set any config field, e.g. optim.lr=3e-4 (repeatable)")
    parser.add_argument("--intervention", dest="interventions", action="append", default=[], metavar="SPEC",
                        help="intervention, e.g. restart:positions=16 (repeatable)")
    run_mode = parser.add_mutually_exclusive_group()
    run_mode.add_argument("--resume", action="store_true",
                          help="continue --out from its newest good checkpoint")
    run_mode.add_argument("--overwrite", action="store_true", help="delete the run in --out and start afresh")
    parser.add_argument("--fields", action="store_true", help="list every config field flag and exit")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run, accepts_config_flags=True)


def _data_overrides(spec: str) -> list[str]:
    """``--data`` as ``data.source`` / ``data.path`` overrides; text, memmap and hf set ``model.d_vocab=auto``."""
    if spec in SYNTHETIC_DATA:
        return [f"data.source={spec}"]
    if spec.startswith("hf:"):
        return ["data.source=hf", f"data.path={spec[3:]}", "model.d_vocab=auto"]
    path = Path(spec).expanduser()
    source = "memmap" if path.suffix == ".bin" or (path / "train.bin").is_file() else "text"
    return [f"data.source={source}", f"data.path={path}", "model.d_vocab=auto"]


def _model_table(path: str) -> dict:
    from sinklens.sinklm.config import read_config_file

    table = read_config_file(Path(path).expanduser()).get("model", {})
    return dict(table) if isinstance(table, dict) else {}


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's :class:`TrainConfig`: config file, the run's own config (``--resume``) or preset (the file's
    ``[model]`` keys over it), then the short flags, ``--set`` items and field flags, by one tyro parse."""
    from dataclasses import fields, replace

    from sinklens.specs import split_spec
    from sinklens.sinklm.run_folder import resume_config
    from sinklens.sinklm.config import PRESETS, ModelConfig, TrainConfig, load_config, parse_flags, set_flags

    resumed = resume_config(args.out) if args.resume and args.out and not args.config else None
    file_model = {}  # explicit: the model fields set by the config file, the run or the preset's definition
    if args.config:
        base, file_model = load_config(args.config), _model_table(args.config)
        explicit = set(file_model)
    elif resumed is not None:  # --resume continues the run with its own config
        base, explicit = resumed, {f.name for f in fields(ModelConfig)}
    else:  # (a --resume with nothing to resume from is refused by train(), as a fresh run there would be)
        base, explicit = TrainConfig(), set()
    if resumed is None and (args.preset or not (args.config or args.resume)):  # a resumed run's model is its own
        name = args.preset or "tiny"
        base = base.replace(model=ModelConfig.from_preset(name, **file_model))
        explicit |= set(PRESETS[name])
    base = replace(base, model=base.model.unset_derived(keep=explicit))
    flags = []
    if args.variant:
        name, options = split_spec(args.variant, what="attention variant")
        flags += ["--model.variant", name]
        flags += [f"--model.variant-options.{key}={value!r}" for key, value in options.items()]
    if args.data:
        flags += set_flags(_data_overrides(args.data))
    for flag, key in (("steps", "steps"), ("batch_size", "batch-size"), ("seq_len", "data.seq-len"), ("lr", "optim.lr"),
                      ("seed", "seed"), ("device", "device")):
        if getattr(args, flag) is not None:
            flags += [f"--{key}", getattr(args, flag)]
    if args.interventions:
        flags += ["--interventions", *args.interventions]
    return parse_flags(base, [*flags, *set_flags(args.overrides), *getattr(args, "config_flags", [])])


def run(args: argparse.Namespace) -> int:
    from sinklens.commands.compare import metric_text
    from sinklens.errors import InvalidArgumentError
    from sinklens.plotting.training import plot_training
    from sinklens.train.loop import train
    from sinklens.validate import writable_file

    if args.fields:
        print(fields_help())
        return 0
    if not args.out:
        raise InvalidArgumentError("sinklens train needs --out, the run directory.")
    cfg = build_config(args)
    # the figure is drawn after training: a figures path that cannot be written is refused before it
    figure = Path(args.out).expanduser() / "figures" / "training.png"
    if figure.parent.parent.is_dir() or not figure.parent.parent.exists():  # (--out a file: train() says so)
        writable_file(figure, what="the training figure")
    result = train(cfg, out_dir=args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    if result.history:
        plot_training({cfg.model.variant: result.history}, path=figure)
    resumes = [line for line in result.history if line["kind"] == "resume"]
    if args.resume and resumes:
        changed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in resumes[-1]["changes"].items())
        print(f"resumed at step {resumes[-1]['step']}" + (f" with {changed}" if changed else " with the run's config"))
    losses, evals = result.losses(), result.evals()
    if losses:
        print(f"trained {cfg.model.variant} for {cfg.steps} steps: loss {metric_text(losses[0])} -> "
              f"{metric_text(losses[-1])}")
    if evals:
        last = evals[-1]
        print(f"final eval: val_loss {metric_text(last.get('val_loss'))}, sink_rate {metric_text(last.get('sink_rate'), '.3f')} "
              f"(Gu et al.; sinklens_sink_rate {metric_text(last.get('sinklens_sink_rate'), '.3f')}), "
              f"first_token_norm_ratio {metric_text(last.get('first_token_norm_ratio'), '.2f')}, "
              f"variance_ratio {metric_text(last.get('variance_ratio'), '.2f')}")
        if "persistence_spearman" in last:
            print(f"persistence of the step-0 bias: token-preference Spearman "
                  f"{metric_text(last['persistence_spearman'], '.3f')}, Kendall {metric_text(last.get('persistence_kendall'), '.3f')}, "
                  f"contraction direction |cos| {metric_text(last.get('persistence_direction_cos'), '.3f')}")
    info = result.compile
    seconds = f", first compiled step {info['compile_s']:.1f} s" if info.get("compile_s") else ""
    print(f"device: {result.device}, autocast {result.autocast}, compile {'on' if info.get('compiled') else 'off'}"
          f"{seconds}" + (f"; {info['error']}" if info.get("error") else ""))
    gpu = next((line for line in result.history if line["kind"] == "device"), None)
    mfus = sorted(line["mfu"] for line in result.history if line["kind"] == "train" and line.get("mfu") is not None)
    if gpu is not None:
        peak = f"{gpu['peak_flops'] / 1e12:.1f} TFLOP/s dense bf16 peak" if gpu["peak_flops"] else "unknown peak"
        mfu = f"MFU {mfus[len(mfus) // 2]:.3f} (median over logged steps) of its {peak}" if mfus else f"MFU: {peak}"
        print(f"gpu: {gpu['device']}, {mfu}")
    print(f"run directory: {Path(args.out)}")
    return 0


def fields_help() -> str:
    """``sinklens train --fields``: one line per field flag: its type, default and first sentence of description."""
    import re
    import types
    import typing

    from sinklens.sinklm.config import TrainConfig, field_class, flag_keys

    defaults = TrainConfig().to_dict()
    lines = ["Every TrainConfig field is a flag (--KEY VALUE; --set KEY=VALUE and config files use the key):"]
    for key in flag_keys():
        part, _, leaf = key.rpartition(".")
        cls = field_class(key)
        tp = typing.get_type_hints(cls)[leaf]
        union = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        kinds = ["{" + ",".join(map(str, typing.get_args(t))) + "}" if typing.get_origin(t) is typing.Literal else
                 getattr(t, "__name__", "LIST").upper() for t in (typing.get_args(tp) if union else (tp,))]
        doc = (cls.__doc__ or "").partition("Attributes:")[2]
        found = re.search(rf"^\s+(?:[\w, ]*\b)?{leaf}\b[\w, ]*:\s(.+?)(?:\.\s|\.$|\n\s*\n|\n\s+\w[\w, ]*:\s)", doc,
                          re.MULTILINE | re.DOTALL)
        text = re.sub(r"\s+", " ", re.sub(r":\w+:`~?([^`]+)`", r"\1", found.group(1)).replace("``", "")) if found else ""
        head = f"  --{key.replace('_', '-')} {'|'.join(kinds).replace('NONETYPE', 'None')} = "
        line = f"{head + str(defaults[part][leaf] if part else defaults[leaf]):<50} {text}".rstrip()
        lines.append(line if len(line) <= 100 else line[:97] + "...")
    return "\n".join(lines)

