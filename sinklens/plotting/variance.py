"""Figures for :class:`~sinklens.analysis.variance.VarianceResult`: variance by position, first-token discrepancy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.colors import LogNorm

from sinklens.analysis.variance import VarianceResult
from sinklens.plotting.style import chosen_layers, expect_result, finish, layer_head_image, new_figure
from sinklens.validate import optional_index_list


def _position_panels(result: VarianceResult, layers: Sequence[int] | None, n_positions: int,
                     draw: Callable[[Any, int, np.ndarray], str], *, ylabel: str, path: str | Path | None) -> Any:
    """One log-log panel per layer (up to 4 by default) vs position + 1; ``draw(ax, row, x)`` returns its title."""
    rows = [result.layers.index(layer) for layer in chosen_layers(result.layers, layers, 4)]
    counts = result.counts
    xlabel = f"position t + 1 ({int(counts[0])} sequences at t = 0, {int(counts[-1])} at t = {len(counts) - 1})"
    fig, axes = new_figure(1, len(rows), width=4.2, height=3.6)
    x = np.arange(1, n_positions + 1)
    for ax, row in zip(axes[0], rows):
        ax.set_title(draw(ax, row, x), fontsize=9)
        ax.set(xscale="log", yscale="log", xlabel=xlabel)
    axes[0, 0].set_ylabel(ylabel)
    axes[0, 0].legend(fontsize=7)
    return finish(fig, path)


def plot_variance_by_position(result: VarianceResult, *, layers: Sequence[int] | None = None,
                              heads: int | Sequence[int] | None = None,
                              path: str | Path | None = None) -> Any:
    """``z_var`` against position + 1 (log-log) per layer, with the prediction ``σ_v² Σ_j A_tj²`` (dashed) and
    the uniform law ``σ_v² / (t + 1)`` (dotted). ``heads``: one, several, or None for the head mean."""
    expect_result(result, VarianceResult, "plot_variance_by_position")
    head_idx = optional_index_list(heads, result.z_var.shape[1], what="heads", allow_negative=False)
    label_heads = "mean of heads" if heads is None else f"heads {head_idx}"

    def draw(ax: Any, row: int, x: np.ndarray) -> str:
        for name, series, style in (
            ("measured Var(z)", result.z_var, dict(color="tab:blue", lw=2)),
            ("σ_v² Σ A² (pattern)", result.pred_pattern, dict(color="tab:orange", ls="--")),
            ("σ_v² / (t+1) (uniform)", result.pred_uniform, dict(color="gray", ls=":")),
        ):
            ax.plot(x, series[row, head_idx].mean(dim=0).numpy(), label=name, **style)
        ax.scatter([1], [float(result.z_var[row, head_idx, 0].mean())], color="tab:red", zorder=3, s=20)
        return f"layer {result.layers[row]} ({label_heads})"

    return _position_panels(result, layers, result.z_var.shape[-1], draw,
                            ylabel="variance of z over sequences (per coordinate)", path=path)


def plot_discrepancy(result: VarianceResult, *, position: int = 0, path: str | Path | None = None) -> Any:
    """Layer × head heatmaps of the variance-discrepancy ratio at ``position`` for ``z`` (left) and
    for the head's output ``z · W_O`` (right), on a log colour scale centred at 1."""
    expect_result(result, VarianceResult, "plot_discrepancy")
    z, res = (result.discrepancy(position, of=of) for of in ("z", "result"))
    both = torch.cat([z.flatten(), res.flatten()])
    both = both[torch.isfinite(both) & (both > 0)]
    span = max(float(both.log10().abs().max()) if both.numel() else 1.0, 0.1)
    norm = LogNorm(vmin=10 ** -span, vmax=10**span)
    n_layers, n_heads = z.shape
    fig, axes = new_figure(1, 2, width=max(3.5, 0.4 * n_heads + 2.0), height=max(3.0, 0.2 * n_layers + 1.5))
    for ax, values, title in ((axes[0, 0], z, "Var(z)"), (axes[0, 1], res, "Var(z · W_O)")):
        layer_head_image(ax, values.clamp(min=1e-12).numpy(), result.layers, cmap="RdBu_r", norm=norm,
                         label=f"> 1: position {position} varies more than the rest; < 1: less")
        ax.set_title(f"{title}: position {position} / rest", fontsize=9)
    fig.suptitle(f"variance over {result.n_sequences} sequences", fontsize=9)
    return finish(fig, path)


def plot_feature_std_by_position(
    result: VarianceResult, *, layers: Sequence[int] | None = None, path: str | Path | None = None
) -> Any:
    """Li et al.'s per-position feature std against position + 1 (log-log), per layer: ``feature_std`` (solid), the
    head mean of ``feature_std_head`` (dashed) and ``feature_std[0] / sqrt(t + 1)`` (dotted)."""
    expect_result(result, VarianceResult, "plot_feature_std_by_position")

    def draw(ax: Any, row: int, x: np.ndarray) -> str:
        concat = result.feature_std[row].numpy()
        ax.plot(x, concat, color="tab:blue", lw=2, label="std over o_proj input (Li et al.)")
        ax.plot(x, result.feature_std_head[row].mean(dim=0).numpy(), color="tab:green", ls="--", label="per head (mean)")
        ax.plot(x, concat[0] / np.sqrt(x), color="gray", ls=":", label="std[0] / sqrt(t+1)")
        return f"layer {result.layers[row]}"

    return _position_panels(result, layers, result.feature_std.shape[-1], draw,
                            ylabel="feature std (mean over sequences)", path=path)
