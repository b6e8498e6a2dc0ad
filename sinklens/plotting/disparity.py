"""Figures for :class:`sinklens.analysis.disparity.MassiveActivations`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib import colormaps

from sinklens.analysis.disparity import MassiveActivations
from sinklens.plotting.style import expect_result, finish, new_figure, paired_bars


def _stream_labels(result: Any) -> list[str]:
    return [str(s) if s < result.n_layers else "out" for s in result.streams]


def plot_massive_by_layer(result: MassiveActivations, *, path: str | Path | None = None) -> Any:
    """Max ``|x|`` per residual stream at the sink and at all other positions (log), with the median and threshold."""
    expect_result(result, MassiveActivations, "plot_massive_by_layer")
    fig, [[ax]] = new_figure(width=7.0, height=4.0)
    xs, floor = list(range(len(result.streams))), 1e-8
    ax.plot(xs, result.max_abs_sink.amax(-1).clamp_min(floor), "o-", label=f"position {result.sink_position}")
    ax.plot(xs, result.max_abs_other.amax(-1).clamp_min(floor), "s-", label="other positions")
    ax.plot(xs, result.median_abs.clamp_min(floor), ":", color="gray", label="median |x|")
    if result.abs_threshold is not None:
        ax.axhline(result.abs_threshold, color="red", lw=0.8, ls="--", label=f"|x| = {result.abs_threshold:g}")
    ax.set_xticks(xs, _stream_labels(result), fontsize=7)
    ax.set(yscale="log", xlabel="residual stream (input of block; out = final)",
           ylabel=f"max |activation| over {result.n_sequences} sequences",
           title="Massive activations by residual stream")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_top_dims(result: MassiveActivations, *, k: int = 10, path: str | Path | None = None) -> Any:
    """At the last residual stream: the ``k`` dims with the largest ``|x|`` at the sink beside their max elsewhere."""
    expect_result(result, MassiveActivations, "plot_top_dims")
    stream = result.streams[-1]
    top = result.top_dims(stream, k, "sink")
    fig, [[ax]] = new_figure(width=7.0, height=4.0)
    xs = paired_bars(ax, [v for _, v in top], [float(result.max_abs_other[-1, d]) for d, _ in top],
                     (f"position {result.sink_position}", "other positions"))
    ax.set_xticks(xs, [str(d) for d, _ in top])
    ax.set(yscale="log", xlabel="residual dimension", ylabel="max |activation|",
           title=f"Top dimensions at residual stream {stream}")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_position_profile(result: MassiveActivations, *, path: str | Path | None = None) -> Any:
    """Per-position norm ratio (to the median of the other positions) and top-k energy share, per layer."""
    expect_result(result, MassiveActivations, "plot_position_profile")
    fig, [[ratio, energy]] = new_figure(1, 2, width=5.5, height=4.0)
    n = len(result.streams)
    for i, label in enumerate(_stream_labels(result)):
        color = colormaps["viridis"](i / max(1, n - 1))
        ratio.plot(result.norm_ratio[i], color=color, lw=1, label=label if i in (0, n - 1) else None)
        energy.plot(result.topk_energy[i], color=color, lw=1)
    ratio.set(yscale="log", xlabel="position", ylabel="||x_p|| / median other ||x_q||")
    ratio.legend(fontsize=7, title="stream")
    energy.set(xlabel="position", ylabel=f"share of ||x||² in top-{result.top_k} dims", ylim=(0, 1.02))
    return finish(fig, path)
