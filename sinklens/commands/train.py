"""``sinklens train``: pretrain a small LM with a chosen attention variant and track its sinks.

Examples::

    sinklens train --preset tiny --variant headwise_rms --data bigram-backcopy --steps 300 --out runs/hw
    sinklens train --config run.toml --optim.lr 3e-4 --data.seq_len 128 --out runs/a
    sinklens train --config run.toml --set optim.lr=3e-4 --set data.seq_len=128 --out runs/a   # same
    sinklens train --data ~/corpus --data.tokenizer bpe --data.vocab_size 2048 --out runs/text
    sinklens train --data bigram-backcopy --intervention restart:positions=16 --out runs/moved
    sinklens train --out runs/hw --resume          # continue an interrupted run, with its own config
    sinklens train --out runs/hw --resume --steps 600   # ... and train it longer
    torchrun --nproc_per_node 2 -m sinklens.cli train ... # DDP

Every field of the run's TrainConfig is a flag (``--optim.lr``, ``--model.n_layers``,
``--on_nonfinite skip``...; list them with ``sinklens train --fields``), parsed from the config
dataclasses by tyro; ``--set section.key=value`` is the same thing in the 0.1 spelling. The short
flags below are aliases applied first; the config file (``--config``) and ``--preset`` give the
base: the preset's model fields first, then the config file's ``[model]`` keys over them (the
file's other tables as written), so ``--config run.toml --preset small`` keeps the file's variant
and whatever model fields it sets. ``d_mlp`` and ``n_kv_heads`` that neither the preset's own
definition, the file nor a flag sets are derived from the final fields, after every override
(``--preset tiny --model.d_model 128`` gets the ``d_mlp`` of d_model 128, see
:class:`~sinklens.sinklm.config.ModelConfig`). An invalid value (``--optim.lr nan``, an unknown
variant, an unknown intervention) is an error before anything runs, and an existing run directory is
never replaced unless ``--resume`` or ``--overwrite`` says so.

Writes ``OUT/metrics.jsonl``, ``OUT/config.json``, the checkpoints and ``OUT/figures/training.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sinklens.commands import plain_help
from sinklens.specs import split_spec
from sinklens.sinklm.config import DATA_SOURCES, TrainConfig, load_config
from sinklens.sinklm.variants import attention_variants


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="pretrain a small LM and track its attention sinks",
                                   description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="run directory (metrics, checkpoints, figures); required")
    parser.add_argument("--config", help="a .json or .toml TrainConfig (flags and --set override it)")
    parser.add_argument("--preset", help="model preset of ModelConfig.from_preset (default: 'tiny' without --config): "
                                         "the base of the model fields; a --config file's [model] keys and the "
                                         "--model.* flags override it, and d_mlp / n_kv_heads that none of them sets "
                                         "follow the final d_model / family / n_heads")
    parser.add_argument("--variant", metavar="NAME[:K=V,...]",
                        help=f"attention variant, one of {attention_variants()}, with options after a colon, "
                             "e.g. headwise_rms:gain=shared or variance_calibrated:mode=position_amplify "
                             "(same as --set model.variant_options.K=V)")
    parser.add_argument("--data", help=f"one of {list(DATA_SOURCES[:2])}, a text file/folder, a nanoGPT folder "
                                       "with train.bin, a .bin file, or hf:<dataset name>")
    parser.add_argument("--steps", help="alias of --steps of the config")
    parser.add_argument("--batch-size", help="alias of --batch_size")
    parser.add_argument("--seq-len", help="alias of --data.seq_len")
    parser.add_argument("--lr", help="alias of --optim.lr")
    parser.add_argument("--seed", help="alias of --seed: model init seed (the data order depends only on data.seed)")
    parser.add_argument("--data-seed", help="alias of --data.seed")
    parser.add_argument("--device", help="alias of --device: auto (default), cpu, cuda, cuda:1 ...")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field, e.g. --set optim.lr=3e-4 (repeatable; applied last)")
    parser.add_argument("--intervention", dest="interventions", action="append", default=[], metavar="NAME:K=V,...",
                        help="training-time intervention of the registry, e.g. restart:positions=16 (repeatable)")
    run_mode = parser.add_mutually_exclusive_group()
    run_mode.add_argument("--resume", action="store_true",
                          help="continue the run in --out from its newest good checkpoint, with its own config; "
                               "other flags may change steps, optim, eval..., not the model, data or seed")
    run_mode.add_argument("--overwrite", action="store_true", help="delete the run already in --out and start afresh")
    parser.add_argument("--fields", action="store_true", help="list every config field flag (tyro) and exit")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run, accepts_config_flags=True)
    return parser


def _data_overrides(spec: str) -> list[str]:
    """``--data`` → ``data.source`` / ``data.path`` overrides; text, memmap and hf data set ``model.d_vocab=auto``."""
    if spec in DATA_SOURCES:
        return [f"data.source={spec}"]
    if spec.startswith("hf:"):
        return ["data.source=hf", f"data.path={spec[3:]}", "model.d_vocab=auto"]
    path = Path(spec).expanduser()
    if path.suffix == ".bin" or (path / "train.bin").is_file():
        return ["data.source=memmap", f"data.path={path}", "model.d_vocab=auto"]
    return ["data.source=text", f"data.path={path}", "model.d_vocab=auto"]


def _model_table(path: str) -> dict:
    """The ``[model]`` table of a config file as written (the keys it sets), ``{}`` without one."""
    import json
    import tomllib

    file = Path(path).expanduser()
    text = file.read_text()
    table = (json.loads(text) if file.suffix == ".json" else tomllib.loads(text)).get("model", {})
    return dict(table) if isinstance(table, dict) else {}


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's :class:`TrainConfig`: config file, the run's own config (``--resume``) or preset,
    then the short flags and ``--set`` overrides, then the tyro field flags (``args.config_flags``),
    parsed and validated in one go.

    With both ``--preset`` and ``--config``, the model is the preset with the file's ``[model]`` keys
    over it. The derived model fields (``ModelConfig.DERIVED``: ``n_kv_heads``, ``d_mlp``) that
    neither the preset's definition nor the config file sets (a resumed run's own config sets all)
    are left None in the base and derived from the final fields when the flags are applied, so they
    follow ``--model.d_model``, ``--model.family`` or ``--model.n_heads``.

    For text, memmap and hf data ``model.d_vocab`` is ``"auto"`` (the training loop sets it to the
    data's vocabulary) unless a flag says otherwise.
    """
    from dataclasses import fields, replace

    from sinklens.sinklm.checkpoint import resume_config
    from sinklens.sinklm.config import PRESETS, ModelConfig, overrides_to_args, parse_args

    explicit: set[str] = set()  # model fields set by the preset's definition, the config file or the run
    resumed = resume_config(args.out) if args.resume and args.out and not args.config else None
    if args.config:
        base = load_config(args.config)
        explicit |= set(_model_table(args.config))
    elif resumed is not None:
        base = resumed  # --resume continues the run with its own config
        explicit |= {f.name for f in fields(ModelConfig)}
    else:  # (a --resume with nothing to resume from is refused by train(), as a fresh run there would be)
        base = TrainConfig()
    if args.preset or not (args.config or args.resume):
        name = args.preset or "tiny"
        file_model = _model_table(args.config) if args.config else {}
        base = base.replace(model=ModelConfig.from_preset(name, **file_model))
        explicit |= set(PRESETS[name])
    base = replace(base, model=base.model.unset_derived(keep=explicit))
    sets = []
    if args.variant:
        name, options = split_spec(args.variant, what="attention variant")
        sets.append(f"model.variant={name}")
        sets += [f"model.variant_options.{key}={value!r}" for key, value in options.items()]
    if args.data:
        sets += _data_overrides(args.data)
    for flag, key in (("steps", "steps"), ("batch_size", "batch_size"), ("seq_len", "data.seq_len"), ("lr", "optim.lr"),
                      ("seed", "seed"), ("data_seed", "data.seed"), ("device", "device")):
        if getattr(args, flag) is not None:
            sets.append(f"{key}={getattr(args, flag)}")
    if args.interventions:
        sets.append(f"interventions={list(args.interventions)!r}")
    flags, variant_options = overrides_to_args(base, sets + list(args.overrides))
    cfg = parse_args(base, flags + list(getattr(args, "config_flags", [])))
    if variant_options or any(getattr(cfg.model, name) is None for name in ModelConfig.DERIVED):
        # rebuilding the model fills any derived field still None (config.json is always complete)
        cfg = cfg.replace(model={**cfg.model.to_dict(), "variant_options": {**cfg.model.variant_options, **variant_options}})
    return cfg


def run(args: argparse.Namespace) -> int:
    from sinklens.commands.compare import metric_text
    from sinklens.errors import InvalidArgumentError
    from sinklens.plotting.training import plot_training
    from sinklens.train.loop import train
    from sinklens.validate import writable_file

    if args.fields:
        from sinklens.sinklm.config import parse_args

        parse_args(TrainConfig(), ["--help"])
    if not args.out:
        raise InvalidArgumentError("sinklens train needs --out, the run directory.")
    cfg = build_config(args)
    # the figure is drawn after training: a figures path that cannot be written is refused before it
    figure = Path(args.out).expanduser() / "figures" / "training.png"
    if figure.parent.parent.is_dir() or not figure.parent.parent.exists():  # (--out a file: train() says so)
        writable_file(figure, what="the training figure")
    result = train(cfg, out_dir=args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    out = Path(args.out)
    if result.history:
        plot_training({cfg.model.variant: result.history}, path=figure)
    resumes = [line for line in result.history if line["kind"] == "resume"]
    if args.resume and resumes:
        changed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in resumes[-1]["changes"].items())
        print(f"resumed at step {resumes[-1]['step']}" + (f" with {changed}" if changed else " with the run's config"))
    losses = result.losses()
    evals = result.evals()
    if losses:
        print(f"trained {cfg.model.variant} for {cfg.steps} steps: loss {metric_text(losses[0])} -> "
              f"{metric_text(losses[-1])}")
    if evals:
        last = evals[-1]
        print(
            f"final eval: val_loss {metric_text(last.get('val_loss'))}, sink_rate {metric_text(last.get('sink_rate'), '.3f')} "
            f"(Gu et al.; sinklens_sink_rate {metric_text(last.get('sinklens_sink_rate'), '.3f')}), "
            f"first_token_norm_ratio {metric_text(last.get('first_token_norm_ratio'), '.2f')}, "
            f"variance_ratio {metric_text(last.get('variance_ratio'), '.2f')}"
        )
        if "persistence_spearman" in last:
            print(f"persistence of the step-0 bias: token-preference Spearman "
                  f"{metric_text(last['persistence_spearman'], '.3f')}, Kendall {metric_text(last.get('persistence_kendall'), '.3f')}, "
                  f"contraction direction |cos| {metric_text(last.get('persistence_direction_cos'), '.3f')}")
    info = result.compile
    if info:
        seconds = f", first compiled step {info['compile_s']:.1f} s beyond an eager one" if info.get("compile_s") else ""
        print(f"compile: {'on' if info['compiled'] else 'off'} ({info['reason']}{seconds})"
              + (f"; {info['error']}" if info.get("error") else ""))
    cpu = result.cpu
    if cpu.get("device") == "cpu":  # say which CPU fast paths the run had
        why = f" ({cpu['matmul_fallback_reason']})" if cpu.get("matmul_fallback_reason") else ""
        kept = ", freed memory kept mapped" if cpu.get("retained_memory") else ""
        mixed = cpu.get("autocast", "none")
        products = f"{mixed} autocast (products in {mixed} on aten)" if mixed != "none" else f"matmul {cpu['matmul']}{why}"
        print(f"cpu: {products}{kept}")
    print(f"run directory: {out}")
    return 0
