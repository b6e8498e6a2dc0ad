"""Convergence study: does head-wise RMSNorm (or variance calibration) speed up training where a sink forms?

Trains ``baseline``, ``headwise_rms``, ``variance_calibrated`` and a sink-free control (``sigmoid``
attention by default) with the same data (``data.seed`` fixes every batch, so all runs see identical
sequences in identical order) and several model seeds each, through :func:`sinklens.train.loop.train`
(the ``sinklens train`` code path, eager, CPU, one thread), and reports per variant:

* ``steps_to_target``: first step at which the training loss, smoothed by a trailing moving
  average of ``--smoothing`` logged steps (:func:`sinklens.plotting.training.steps_to_loss`), is at
  or below the target loss. The target defaults to the mean over seeds of the baseline's final
  smoothed loss plus ``--target-margin`` nats (a loss the baseline reaches late in its run); a run
  that never reaches it is counted as "never" and left out of the mean (the count is reported).
  The 95% interval is Student's t over seeds (``scipy.stats.t``, n − 1 degrees of freedom).
* ``final_val_loss``: the last evaluation's validation loss (fixed held-out batches), mean and 95% t-interval.
* ``paired_vs_baseline``: per seed, the variant's steps to target and final validation loss minus the
  baseline's (same seed, same data), with their mean and 95% t-interval — the fairer comparison,
  because runs on identical batches share most of their noise.
* ``sinklens_sink_rate`` over training: at every evaluation, the share of (layer, head) pairs whose mean
  attention on position 0 over the queries ``q >= 1`` exceeds ε = 0.3 (sinklens' variant of Gu et al. 2024's
  sink rate, which also counts query 0), averaged over held-out sequences
  (:class:`sinklens.train.sink_metrics.SinkMetrics`; the study below was recorded with it).
* ``sink_onset``: the first evaluation step whose sink rate exceeds 0.3 (None: never).

Tasks (``--task``):

* ``backcopy``: the bigram-backcopy task (Guo et al. 2024) of :mod:`sinklens.train.data`,
  GPT-2-style blocks (learned absolute positions), BOS at position 0.
* ``text``: docstrings of the Python standard library's top-level modules (``ast.get_docstring``
  of every module, class and function, > 40 characters), a 512-token BPE trained on them
  (:mod:`sinklens.sinklm.tokenizer`), a Llama-style model (RoPE, SwiGLU) of 4 layers, d_model 256;
  every sequence starts with ``<|endoftext|>`` as BOS.
* ``text-small``: the same corpus and tokenizer, a smaller model (``--family`` llama or gpt2,
  ``--layers`` 2, ``--heads`` 4, ``--d-model`` 64 by default) and **no BOS** unless ``--bos``: windows
  start at arbitrary tokens, so position 0 is marked only by the causal mask. ``--corpus stdlib`` trains on
  every ``*.py`` file of the standard library instead (the docstrings, ≈ 0.4M tokens, repeat within a few
  thousand steps).

A variant may name an option mode after a colon: ``variance_calibrated:position_amplify`` trains
``variance_calibrated`` with ``variant_options={"mode": "position_amplify"}``.

Writes ``benchmarks/results/convergence_<task>.json`` (strict JSON: config, machine, command, wall
time, per-run curves, summary) and ``assets/convergence_<task>.png``.

Example::

    nice -n 10 python benchmarks/bench_convergence.py --task backcopy --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from sinklens.export import write_json
from sinklens.prompts import stdlib_docstrings
from sinklens.plotting.training import smooth, steps_to_loss
from sinklens.sinklm.checkpoint import with_current_metric_names
from sinklens.sinklm.config import TrainConfig
from sinklens.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "headwise_rms", "variance_calibrated", "sigmoid")


def docstring_corpus(path: Path) -> Path:
    """Write the standard library's docstrings (modules, classes, functions; > 40 characters) to ``path`` once."""
    if path.is_file():
        return path
    texts = [doc for doc in stdlib_docstrings() if len(doc) > 40]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(texts), encoding="utf-8")
    return path


def text_corpus(args: argparse.Namespace) -> dict[str, Any]:
    """The ``data`` fields of the real-text corpus: ``--corpus docstrings`` (the standard library's docstrings,
    ≈ 0.9 MB, ≈ 0.4M BPE-512 tokens: repeated many times by a few thousand steps) or ``stdlib`` (every ``*.py``
    file of the standard library, up to 40M characters: no repetition at CPU scale)."""
    if args.corpus == "stdlib":
        return {"source": "text", "path": sysconfig.get_paths()["stdlib"], "glob": "**/*.py", "max_tokens": 40_000_000}
    return {"source": "text", "path": str(docstring_corpus(Path(args.cache) / "stdlib_docstrings.txt"))}


def task_config(task: str, variant: str, seed: int, args: argparse.Namespace) -> TrainConfig:
    """The run config of one (task, variant, seed); only ``model.variant`` and ``seed`` differ between runs."""
    if task == "backcopy":
        model = {"family": "gpt2", "n_layers": 3, "d_model": 64, "n_heads": 1, "n_ctx": 64, "d_vocab": 64}
        data = {"source": "bigram-backcopy", "seq_len": 64, "vocab_size": 64, "seed": 1234}
        lr = 3e-3
    elif task == "text-small":  # without --bos, position 0 is an arbitrary token, marked only by the causal mask
        model = {"family": args.family, "n_layers": args.layers or 2, "d_model": args.d_model or 64,
                 "n_heads": args.heads or 4, "n_ctx": args.seq_len or 64, "d_vocab": "auto"}
        data = {**text_corpus(args), "tokenizer": "bpe", "vocab_size": 512, "bos": args.bos,
                "seq_len": args.seq_len or 64, "seed": 1234, "cache_dir": str(Path(args.cache) / "data")}
        lr = 3e-3
    elif task == "text":
        corpus = docstring_corpus(Path(args.cache) / "stdlib_docstrings.txt")
        model = {"family": "llama", "n_layers": 4, "d_model": 256, "n_heads": 4, "n_ctx": args.seq_len or 64,
                 "d_vocab": "auto"}
        data = {"source": "text", "path": str(corpus), "tokenizer": "bpe", "vocab_size": 512,
                "seq_len": args.seq_len or 64, "seed": 1234, "cache_dir": str(Path(args.cache) / "data")}
        lr = 3e-3
    else:
        raise ValueError(f"Unknown task {task!r}; expected 'backcopy' or 'text'.")
    if args.seq_len and task == "backcopy":
        model["n_ctx"] = data["seq_len"] = args.seq_len
    name, _, mode = variant.partition(":")  # "variance_calibrated:attenuate" picks a calibration mode
    options = {"mode": mode} if mode else {}
    return TrainConfig.from_dict({
        "model": {**model, "variant": name, "variant_options": options},
        "data": data,
        "optim": {"lr": args.lr or lr, "warmup_steps": 20},
        "eval": {"interval": args.eval_interval, "batches": 1, "batch_size": 32, "persistence_sequences": 0},
        "steps": args.steps, "batch_size": args.batch_size, "seed": seed, "device": "cpu", "log_interval": 1,
        "compile": False,  # the eager path the study describes, the same on every machine (not "auto")
        "cpu_autocast": args.cpu_autocast,
    })


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95% Student-t interval ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (NaN bounds for n < 2)."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = statistics.fmean(values)
    if n < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]], *, smoothing: int, target: float | None,
              margin: float) -> dict[str, Any]:
    """Steps to the target loss, final validation loss and sink rate per variant (see the module docstring)."""
    def final_smoothed(lines: list[dict[str, Any]]) -> float:
        return smooth([x["loss"] for x in lines if x["kind"] == "train"], smoothing)[-1]

    if target is None:
        target = statistics.fmean(final_smoothed(lines) for lines in runs["baseline"].values()) + margin
    out: dict[str, Any] = {"target_loss": target, "smoothing": smoothing, "variants": {}}
    for variant, by_seed in runs.items():
        steps = {seed: steps_to_loss(lines, target, smoothing=smoothing) for seed, lines in by_seed.items()}
        reached = [s for s in steps.values() if s is not None]
        finals = [[x for x in lines if x["kind"] == "eval"][-1] for lines in by_seed.values()]
        mean, lo, hi = t_interval([float(s) for s in reached])
        vmean, vlo, vhi = t_interval([f["val_loss"] for f in finals])
        smean, slo, shi = t_interval([f["sinklens_sink_rate"] for f in finals])
        out["variants"][variant] = {
            "steps_to_target": steps, "reached": f"{len(reached)}/{len(steps)}",
            "steps_mean": mean, "steps_ci95": [lo, hi],
            "final_train_loss_smoothed": {seed: final_smoothed(lines) for seed, lines in by_seed.items()},
            "final_val_loss": [f["val_loss"] for f in finals], "final_val_loss_mean": vmean, "final_val_loss_ci95": [vlo, vhi],
            "final_sink_rate": [f["sinklens_sink_rate"] for f in finals], "final_sink_rate_mean": smean, "final_sink_rate_ci95": [slo, shi],
            "final_attn_to_first": [f["attn_to_first"] for f in finals],
            "sink_onset": {seed: next((x["step"] for x in lines if x["kind"] == "eval" and x["sinklens_sink_rate"] > 0.3), None)
                           for seed, lines in by_seed.items()},
        }
    base = out["variants"].get("baseline")
    for variant, row in out["variants"].items():
        if variant == "baseline" or base is None:
            continue
        seeds = [s for s in row["steps_to_target"] if row["steps_to_target"][s] is not None
                 and base["steps_to_target"].get(s) is not None]
        diffs = [float(row["steps_to_target"][s] - base["steps_to_target"][s]) for s in seeds]
        mean, lo, hi = t_interval(diffs)
        vdiffs = [a - b for a, b in zip(row["final_val_loss"], base["final_val_loss"])]
        vmean, vlo, vhi = t_interval(vdiffs)
        row["paired_vs_baseline"] = {"steps_diff": diffs, "steps_diff_mean": mean, "steps_diff_ci95": [lo, hi],
                                     "val_loss_diff": vdiffs, "val_loss_diff_mean": vmean, "val_loss_diff_ci95": [vlo, vhi]}
    return out


def plot(runs: dict[str, dict[int, list[dict[str, Any]]]], summary: dict[str, Any], *, smoothing: int, title: str,
         path: Path) -> None:
    """Training loss (mean over seeds of the smoothed curves, min–max band), validation loss and sink rate."""
    from sinklens.plotting.style import new_figure, save_figure

    fig, axes = new_figure(1, 3, width=4.4, height=3.4)
    for i, (variant, by_seed) in enumerate(runs.items()):
        color = f"C{i}"
        curves = [smooth([x["loss"] for x in lines if x["kind"] == "train"], smoothing) for lines in by_seed.values()]
        steps = [x["step"] for x in next(iter(by_seed.values())) if x["kind"] == "train"]
        n = min(len(c) for c in curves)
        mean = [statistics.fmean(c[j] for c in curves) for j in range(n)]
        axes[0][0].plot(steps[:n], mean, color=color, label=variant)
        axes[0][0].fill_between(steps[:n], [min(c[j] for c in curves) for j in range(n)],
                                [max(c[j] for c in curves) for j in range(n)], color=color, alpha=0.15)
        for key, ax in (("val_loss", axes[0][1]), ("sinklens_sink_rate", axes[0][2])):
            evals = [[x for x in lines if x["kind"] == "eval"] for lines in by_seed.values()]
            xs = [x["step"] for x in evals[0]]
            ys = [statistics.fmean(e[j][key] for e in evals) for j in range(len(xs))]
            ax.plot(xs, ys, color=color, marker="o", ms=3, label=variant)
            for e in evals:
                ax.plot(xs, [x[key] for x in e], color=color, alpha=0.25, lw=0.8)
    axes[0][0].axhline(summary["target_loss"], color="grey", ls=":", lw=1)
    axes[0][0].set_title(f"training loss (smoothed {smoothing}), target dotted", fontsize=9)
    axes[0][1].set_title("validation loss (nats)", fontsize=9)
    axes[0][2].set_title("sinklens sink rate at position 0 (queries ≥ 1, ε = 0.3)", fontsize=9)
    for ax in axes[0]:
        ax.set_xlabel("step")
    lo = min(summary["variants"][v]["final_val_loss_mean"] for v in runs)
    axes[0][0].set_ylim(lo - 0.3, lo + 2.0)
    axes[0][1].set_ylim(lo - 0.3, lo + 2.0)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["backcopy", "text", "text-small"], default="backcopy")
    parser.add_argument("--layers", type=int, default=None, help="text-small: layers (default 2)")
    parser.add_argument("--d-model", type=int, default=None, help="text-small: d_model (default 64)")
    parser.add_argument("--heads", type=int, default=None, help="text-small: heads per layer (default 4)")
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama", help="text-small: block family")
    parser.add_argument("--bos", action="store_true", help="text-small: start every sequence with BOS")
    parser.add_argument("--corpus", choices=["docstrings", "stdlib"], default="docstrings",
                        help="text-small: the standard library's docstrings (default) or all its *.py sources")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--smoothing", type=int, default=20)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--target-margin", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-autocast", choices=["none", "bfloat16"], default="none",
                        help="TrainConfig.cpu_autocast: bfloat16 mixed precision (default: float32)")
    parser.add_argument("--runs-dir", default=None,
                        help="save each finished run here and reuse it (lets several processes split the variants)")
    parser.add_argument("--no-summary", action="store_true", help="only train (and save to --runs-dir)")
    parser.add_argument("--summary-only", action="store_true", help="only summarize runs saved in --runs-dir")
    parser.add_argument("--cache", default=os.environ.get("SINKLENS_CACHE", str(Path.home() / ".cache" / "sinklens")))
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/convergence_<task>.json)")
    parser.add_argument("--figure", default=None, help="PNG (default assets/convergence_<task>.png)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "baseline" not in args.variants and not args.no_summary:
        raise SystemExit("--variants must include baseline (it defines the target loss)")

    started = time.time()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {v: {} for v in args.variants}
    wall: dict[str, dict[int, float]] = {v: {} for v in args.variants}
    cache = Path(args.runs_dir) if args.runs_dir else None
    for seed in args.seeds:  # seeds outermost: an interrupted study still has every variant for the first seeds
        for variant in args.variants:
            cfg = task_config(args.task, variant, seed, args)
            done = cache / f"{args.task}_{variant}_seed{seed}.json" if cache is not None else None
            if done is not None and done.is_file():  # a run finished by this or another process (same config)
                saved = json.loads(done.read_text())
                if saved["config"] == cfg.to_dict():
                    runs[variant][seed] = [with_current_metric_names(line) for line in saved["history"]]
                    wall[variant][seed] = saved["wall_s"]
                    continue
            if args.summary_only:
                raise SystemExit(f"--summary-only: no finished run for {variant} seed {seed} in {cache}")
            t0 = time.time()
            result = train(cfg, progress=False)
            wall[variant][seed] = time.time() - t0
            runs[variant][seed] = result.history
            if done is not None:
                write_json(done, {"config": cfg.to_dict(), "wall_s": wall[variant][seed], "history": result.history},
                           digits=None, indent=None)
            last = result.evals()[-1]
            print(f"{variant:>20} seed {seed}: {wall[variant][seed]:6.1f}s  val_loss {last['val_loss']:.4f}  "
                  f"sinklens_sink_rate {last['sinklens_sink_rate']:.3f}  attn_to_first {last['attn_to_first']:.3f}", flush=True)
    if args.no_summary:
        return

    summary = summarize(runs, smoothing=args.smoothing, target=args.target_loss, margin=args.target_margin)
    for variant, row in summary["variants"].items():
        lo, hi = row["steps_ci95"]
        print(f"{variant:>20}: steps to {summary['target_loss']:.4f}: {row['steps_to_target']} "
              f"(mean {row['steps_mean']:.0f}, 95% CI [{lo:.0f}, {hi:.0f}], reached {row['reached']}); "
              f"final val loss {row['final_val_loss_mean']:.4f}; final sink rate {row['final_sink_rate']}")
    cfg = task_config(args.task, "baseline", args.seeds[0], args)
    record = {
        "task": args.task, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: v for k, v in cfg.to_dict().items() if k != "seed"}, "seeds": args.seeds, "variants": args.variants,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "threads": torch.get_num_threads(), "gpu": None},
        "wall_s_this_process": time.time() - started, "wall_s_per_run": wall,
        "wall_s_runs_sum": sum(w for by_seed in wall.values() for w in by_seed.values()), "summary": summary,
        # curves: the training loss every 10th step and every evaluation
        "curves": {v: {str(s): [{k: x[k] for k in ("step", "loss")} if x["kind"] == "train" else
                                {k: x[k] for k in ("step", "val_loss", "sinklens_sink_rate", "attn_to_first")}
                                for x in lines if x["kind"] == "eval" or (x["kind"] == "train" and x["step"] % 10 == 0)]
                       for s, lines in by_seed.items()}
                   for v, by_seed in runs.items()},
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"convergence_{args.task}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, record, digits=6)
    figure = Path(args.figure) if args.figure else ROOT / "assets" / f"convergence_{args.task}.png"
    title = {"backcopy": "bigram-backcopy, GPT-2 blocks, 3 layers × 1 head, d_model 64",
             "text": "stdlib docstrings, BPE 512, Llama blocks, 4 layers, d_model 256",
             "text-small": f"stdlib {'sources' if args.corpus == 'stdlib' else 'docstrings'}, BPE 512, "
                           f"{'BOS' if args.bos else 'no BOS'}, {cfg.model.family} "
                           f"blocks, {cfg.model.n_layers} layers × {cfg.model.n_heads} heads, d_model {cfg.model.d_model}"}[args.task]
    plot(runs, summary, smoothing=args.smoothing, title=f"{title} ({len(args.seeds)} seeds)", path=figure)
    print(f"wall {record['wall_s_this_process']:.0f}s (runs: {record['wall_s_runs_sum']:.0f}s); results {out}; figure {figure}")
    json.dumps(record["summary"], allow_nan=True)  # summary printable even with NaN bounds


if __name__ == "__main__":
    main()
