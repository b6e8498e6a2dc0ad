"""Figures of training runs: loss and sink metrics over steps, several runs on shared axes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sinklens.plotting.style import finish, new_figure
from sinklens.errors import InvalidArgumentError
from sinklens.validate import positive_int

#: Eval metrics plotted by default, with their axis labels.
SINK_PANELS = {
    "val_loss": "validation loss (nats)",
    "sink_rate": "sink rate at position 0 (Gu et al., ε)",
    "first_token_norm_ratio": "‖resid[0]‖ / mean ‖resid[t≥1]‖ (max over layers)",
    "variance_ratio": "var(z[0]) / var(z[t≥1]) (hook_z, mean over heads)",
}

#: Eval metrics plotted when a run has them: sinklens' sink-rate variant and the step-0 bias persistence.
OPTIONAL_PANELS = {
    "sinklens_sink_rate": "sinklens sink rate at position 0 (queries ≥ 1, ε)",
    "persistence_spearman": "token-preference Spearman ρ with step 0",
    "persistence_direction_cos": "|cos| of the contraction direction with step 0",
}


def smooth(values: Sequence[float], window: int, *, steps: Sequence[int] | None = None) -> list[float]:
    """Trailing moving average: at logged step ``s``, the mean of the values logged at
    ``s - window < t <= s`` (``steps``: the logged steps, default 0, 1, ...)."""
    window = positive_int(window, what="smoothing window (steps)")
    steps = range(len(values)) if steps is None else steps
    if len(steps) != len(values):
        raise InvalidArgumentError(f"smooth got {len(values)} values for {len(steps)} steps.")
    out, total, first = [], 0.0, 0
    for i, (step, value) in enumerate(zip(steps, values)):
        total += value
        while steps[first] <= step - window:  # drop the values logged before the window (s - window, s]
            total -= values[first]
            first += 1
        out.append(total / (i + 1 - first))
    return out


def plot_training(runs: Mapping[str, Sequence[dict[str, Any]]], *,
                  panels: Sequence[str] | None = None, smoothing: int = 10,
                  path: str | Path | None = None) -> Any:
    """One panel per metric, one line per run of ``{label: metrics lines}``: training loss smoothed over ``smoothing``
    steps and the evaluation metrics (default: ``"loss"``, the sink panels and the optional ones a run recorded)."""
    if panels is None:
        present = {key for lines in runs.values() for line in lines if line.get("kind") == "eval" for key in line}
        panels = ("loss", *SINK_PANELS, *[p for p in OPTIONAL_PANELS if p in present])
    fig, axes = new_figure(1, len(panels), width=4.2, height=3.4)
    for ax, panel in zip(axes[0], panels):
        for label, lines in runs.items():
            if panel == "loss":
                ax.plot(*smoothed_loss(lines, smoothing), label=label)
            else:
                evals = [line for line in lines if line["kind"] == "eval" and line.get(panel) is not None]
                ax.plot([line["step"] for line in evals], [line[panel] for line in evals], marker="o", ms=3, label=label)
        ax.set_title("training loss (nats)" if panel == "loss" else {**SINK_PANELS, **OPTIONAL_PANELS}.get(panel, panel),
                     fontsize=9)
        ax.set(xlabel="step", yscale="log" if panel in ("first_token_norm_ratio", "variance_ratio") else "linear")
    axes[0][0].legend(fontsize=8)
    return finish(fig, path)


def smoothed_loss(lines: Sequence[dict[str, Any]], smoothing: int) -> tuple[list[int], list[float]]:
    """The logged training steps and their :func:`smooth` ed loss."""
    steps = [line["step"] for line in lines if line["kind"] == "train"]
    return steps, smooth([line["loss"] for line in lines if line["kind"] == "train"], smoothing, steps=steps)


def steps_to_loss(lines: Sequence[dict[str, Any]], target: float, *, smoothing: int = 10) -> int | None:
    """First logged step whose :func:`smooth` ed training loss is ``<= target``; None if never."""
    return next((int(step) for step, value in zip(*smoothed_loss(lines, smoothing)) if value <= target), None)


def plot_positional_over_training(trajectories: Mapping[str, Any], *, path: str | Path | None = None) -> Any:
    """Per run: the first random token's ``attn_out_var`` relative to the later half (log) against the training
    step, one line per layer; step 0 is the initialization."""
    fig, axes = new_figure(1, len(trajectories), width=4.2, height=3.4)
    name = "attn_out_var"
    for ax, (label, traj) in zip(axes[0], trajectories.items()):
        ratio = traj.first_token_ratio(name)  # (step, layer)
        for layer in range(ratio.shape[1]):
            ax.plot(traj.steps, ratio[:, layer].tolist(), marker="o", ms=3, label=f"layer {layer}")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(yscale="log", xlabel="step")
        position = traj.results[0].first_counted if traj.results else 0
        ax.set_title(f"{label}: {name} at position {position} / later half", fontsize=9)
    axes[0][0].legend(fontsize=8)
    return finish(fig, path)
