"""Loss and sink metrics of several training runs on shared axes.

Per run: status (finished, diverged, incomplete), final loss, last sink metrics and the steps
its smoothed loss took to reach the target (default: the first run's final loss), on the steps
all runs logged; n/a (null in --json) where undefined. --positional draws the positional
discrepancy at init and at each kept checkpoint beside --out (compare-positional.png).

Examples:
    sinklens compare runs/baseline runs/headwise --out compare.png
    sinklens compare runs/* --target-loss 2.5 --json summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from sinklens.commands import add_command, add_json_flag, add_overwrite_flag, json_target, outside_run_internals, write_json_target
from sinklens.options import SEQ_LEN


def add_parser(subparsers) -> None:
    parser = add_command(subparsers, "compare", __doc__, help="compare training runs (loss, sink metrics, steps to a target loss)")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders written by sinklens train")
    parser.add_argument("--labels", nargs="+", metavar="L", help="legend labels (default: variant @ folder name)")
    parser.add_argument("--target-loss", type=float, metavar="LOSS", help="steps-to-target's loss (default: first run's final)")
    parser.add_argument("--smoothing", type=int, default=10, metavar="N",
                        help="moving average over N training steps (default: %(default)s)")
    parser.add_argument("--out", metavar="FILE", help="figure file, .png unless its suffix says otherwise "
                                                      "(default: compare.png in the first run's folder)")
    add_json_flag(parser, "the summary")
    parser.add_argument("--positional", action="store_true", help="also measure the positional discrepancy in training")
    parser.add_argument("--n-sequences", type=int, default=64, metavar="N", help="random sequences of --positional (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, metavar="N",
                        help="their length (default: %(default)s, at most data.seq_len)")
    add_overwrite_flag(parser, "an existing --out figure or --json file")
    parser.set_defaults(func=run)


def metric_text(value, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``, or ``"n/a"`` (padded to the spec's width) for None, NaN or infinity."""
    import math
    import re

    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return "n/a".rjust(int(re.match(r"[<>^=]?[+\- ]?0?(\d*)", spec).group(1) or 0))


def run_status(lines: list[dict], steps: int | None) -> dict:
    """``{"status", "steps_done", "steps"}`` of a run: ``"diverged"`` (a stopping ``nonfinite`` line at or after the
    last train step), ``"incomplete"`` (fewer than ``steps`` steps), ``"finished"``, or ``"unknown"`` (no steps)."""
    done = max((line["step"] + 1 for line in lines if line.get("kind") == "train"), default=0)
    stops = [line["step"] for line in lines if line.get("kind") == "nonfinite" and line.get("action") == "stop"]
    skipped = max((line["step"] + 1 for line in lines if line.get("kind") == "nonfinite"), default=0)
    if stops and max(stops) >= done:
        return {"status": "diverged", "steps_done": max(stops), "steps": steps}
    done = max(done, skipped)
    status = "unknown" if steps is None else "incomplete" if done < steps else "finished"
    return {"status": status, "steps_done": done, "steps": steps}


def status_text(row: dict) -> str:
    """A row's status for the table: ``finished``, ``diverged at step 3 of 100``, ``incomplete: 40 of 100 steps``."""
    steps = row.get("steps")
    if row["status"] == "diverged":
        return f"diverged at step {row['steps_done']}" + (f" of {steps}" if steps is not None else "")
    if row["status"] == "incomplete":
        return f"incomplete: {row['steps_done']} of {steps} steps"
    return row["status"]


def planned_steps(run_dir: str | Path) -> int | None:
    """The ``steps`` of a run's ``config.json`` (None when it has none)."""
    try:
        steps = json.loads((Path(run_dir) / "config.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def log_interval(lines: list[dict]) -> int:
    """The most common gap between a run's logged ``train`` steps (1 with fewer than two lines)."""
    steps = [line["step"] for line in lines if line["kind"] == "train"]
    gaps = Counter(b - a for a, b in zip(steps, steps[1:]) if b > a)
    return gaps.most_common(1)[0][0] if gaps else 1


def on_common_steps(runs: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], int]:
    """``runs`` with only the train lines at multiples of the least common multiple of their :func:`log_interval`
    (and each run's last train line), and that interval; other lines are kept."""
    import math

    interval = math.lcm(*(log_interval(lines) for lines in runs.values()))
    last = {label: max((line["step"] for line in lines if line["kind"] == "train"), default=None)
            for label, lines in runs.items()}
    return {label: [line for line in lines if line["kind"] != "train" or line["step"] % interval == 0
                    or line["step"] == last[label]] for label, lines in runs.items()}, interval


def summarize(runs: dict[str, list[dict]], *, target: float | None = None, smoothing: int = 10,
              steps: dict[str, int | None] | None = None) -> list[dict]:
    """Per run: final smoothed loss, steps to ``target``, last eval and :func:`run_status`. The smoothed loss at step
    ``s`` is the mean of the losses logged at ``s - smoothing < t <= s`` on the common steps (:func:`on_common_steps`);
    ``steps_to_target`` is the first step where it is ``<= target`` (default: the first run's final one)."""
    import math

    from sinklens.errors import InvalidArgumentError
    from sinklens.plotting.training import smoothed_loss, steps_to_loss

    statuses = {label: run_status(lines, (steps or {}).get(label)) for label, lines in runs.items()}
    runs, interval = on_common_steps(runs)
    finals = {label: (smoothed_loss(lines, smoothing)[1] or [math.nan])[-1] for label, lines in runs.items()}
    if target is None:
        first, target = next(iter(finals.items()))
        if not math.isfinite(target):
            raise InvalidArgumentError(
                f"The first run, {first!r}, has no finite training loss logged ({statuses[first]['status']}, "
                f"{statuses[first]['steps_done']} steps), so there is no default target loss; pass --target-loss, "
                "or put a run with training losses first.")
    rows = []
    for label, lines in runs.items():
        evals = [line for line in lines if line["kind"] == "eval"]
        rows.append({"run": label, "final_loss": finals[label], "target_loss": target,
                     "steps_to_target": steps_to_loss(lines, target, smoothing=smoothing), "common_log_interval": interval,
                     **statuses[label], **({k: v for k, v in evals[-1].items() if k != "kind"} if evals else {})})
    return rows


def run_labels(run_dirs: list[str], labels: list[str] | None = None) -> list[str]:
    """One distinct label per run: ``labels``, else ``"<variant> @ <folder name>"`` (the path where two share a name)."""
    from sinklens.errors import CorruptFileError, InvalidArgumentError

    if twice := [path for path, n in Counter(str(Path(r).resolve()) for r in run_dirs).items() if n > 1]:
        raise InvalidArgumentError(f"The run {twice[0]!r} is given twice; compare each run once.")
    if labels:
        if len(labels) != len(run_dirs):
            raise InvalidArgumentError(f"--labels has {len(labels)} entries for {len(run_dirs)} runs.")
        if repeated := [label for label, n in Counter(labels).items() if n > 1]:
            raise InvalidArgumentError(f"--labels gives {repeated[0]!r} to more than one run; each run needs its own label.")
        return list(labels)

    def variant(run_dir: str) -> str:
        cfg_path = Path(run_dir) / "config.json"
        if not cfg_path.is_file():
            return "?"
        try:  # the trainer's error for a damaged run (sinklens.sinklm.checkpoint.load_train_config)
            return json.loads(cfg_path.read_text())["model"]["variant"]
        except ValueError as err:
            raise CorruptFileError(f"{str(cfg_path)!r} is not valid JSON ({err}).") from None
        except (KeyError, TypeError):
            raise CorruptFileError(f"{str(cfg_path)!r} has no model.variant; is it a sinklens run's config?") from None

    variants = [variant(r) for r in run_dirs]
    short = [f"{v} @ {Path(r).name}" for v, r in zip(variants, run_dirs)]
    counts = Counter(short)
    return [label if counts[label] == 1 else f"{v} @ {r}" for label, v, r in zip(short, variants, run_dirs)]


def figure_path(path: str | Path, *, what: str = "--out") -> Path:
    """``path`` (``.png`` added without a suffix), checked first: writable, outside a run, a suffix matplotlib saves."""
    from matplotlib.backend_bases import FigureCanvasBase

    from sinklens.errors import InvalidArgumentError
    from sinklens.validate import writable_file

    out = writable_file(path, what=what)
    if not out.suffix:
        out = writable_file(out.with_name(out.name + ".png"), what=what)
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise InvalidArgumentError(f"{what} {str(out)!r}: matplotlib cannot save a {out.suffix!r} figure; "
                                   f"use one of {', '.join('.' + f for f in sorted(formats))}.")
    outside_run_internals(out, what=what, file=True)
    return out


def run(args: argparse.Namespace) -> int:
    from sinklens.plotting.training import plot_training
    from sinklens.sinklm.checkpoint import read_metrics
    from sinklens.validate import finite_number, no_finished_output, positive_int

    positive_int(args.smoothing, what="--smoothing")
    if args.target_loss is not None:
        finite_number(args.target_loss, what="--target-loss", low=0.0, low_open=True)
    if args.positional:
        positive_int(args.n_sequences, what="--n-sequences", minimum=2)
        positive_int(args.seq_len, what="--seq-len", minimum=2)
    out = figure_path(args.out if args.out is not None else Path(args.runs[0]) / "compare.png")
    positional_out = figure_path(out.with_name(f"{out.stem}-positional{out.suffix}")) if args.positional else None
    no_finished_output([out] + ([positional_out] if positional_out else []), overwrite=args.overwrite, flag="--out")
    target = json_target(args.json, overwrite=args.overwrite)
    info = sys.stderr if target == "-" else sys.stdout  # with --json -, stdout holds only the JSON
    labels = run_labels(args.runs, args.labels)
    runs = {label: read_metrics(run_dir) for label, run_dir in zip(labels, args.runs)}  # a bad loss: named error
    rows = summarize(runs, target=args.target_loss, smoothing=args.smoothing,
                     steps={label: planned_steps(run_dir) for label, run_dir in zip(labels, args.runs)})
    plot_training(runs, smoothing=args.smoothing, path=out)
    # every file first: a reader that closes stdout (`| head`) must not cost the positional figure
    if positional_out is not None:
        from sinklens.options import RunOptions
        from sinklens.origins.positional import positional_over_training
        from sinklens.plotting.training import plot_positional_over_training

        trajectories = {label: positional_over_training(run_dir, n_sequences=args.n_sequences, seq_len=args.seq_len,
                                                        options=RunOptions(progress=True, desc="positional"))
                        for label, run_dir in zip(labels, args.runs)}
        plot_positional_over_training(trajectories, path=positional_out)
    every = rows[0]["common_log_interval"]
    lines = [f"target loss {metric_text(rows[0]['target_loss'])} (training loss = mean of the losses logged in the last "
             f"{args.smoothing} steps" + (f", at the steps all runs logged: every {every} and each run's last" if every > 1
                                          else "") + ")"]
    for row in rows:
        extra = "".join(f", {key} {metric_text(row[key], '.3f')}" for key in ("sink_rate", "sinklens_sink_rate") if key in row)
        if "persistence_spearman" in row:
            extra += (f", vs step 0: preference Spearman {metric_text(row['persistence_spearman'], '.3f')} / Kendall "
                      f"{metric_text(row.get('persistence_kendall'), '.3f')}, direction |cos| "
                      f"{metric_text(row.get('persistence_direction_cos'), '.3f')}")
        lines.append(f"{row['run']}: {status_text(row)}, final loss {metric_text(row['final_loss'])}, steps to target "
                     f"{'never' if row['steps_to_target'] is None else row['steps_to_target']}{extra}")
    write_json_target(target, rows, overwrite=args.overwrite, text="\n".join(lines))  # tables to stderr with --json -
    print(f"figure: {out}", file=info)
    if positional_out is not None:  # the first-token attention-output variance ratio per layer, by checkpoint
        for label, traj in trajectories.items():
            print(f"{label}: attention-output variance at position 0 / later half, by layer", file=info)
            for step, row in zip(traj.steps, traj.first_token_ratio("attn_out_var").tolist()):
                print(f"  step {step:>7}: " + "  ".join(metric_text(v, "8.3g") for v in row), file=info)
        print(f"figure: {positional_out}", file=info)
    return 0
