"""Figures for :class:`~sinklens.analysis.sinks.SinkResult`: where attention goes, per layer × head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sinklens.analysis.sinks import SinkResult
from sinklens.plotting.style import chosen_layers, expect_result, finish, layer_head_image, new_figure


def _main_sink(result: Any, position: int | None) -> int:
    return (result.sink_positions or [0])[0] if position is None else result.position_index(position)


def plot_sink_heatmap(result: SinkResult, *, position: int | None = None, path: str | Path | None = None) -> Any:
    """Layer × head mean attention to one key position (default: first sink, else 0); dots above ``sink_threshold``."""
    expect_result(result, SinkResult, "plot_sink_heatmap")
    pos = _main_sink(result, position)
    values = torch.nan_to_num(result.received[:, :, pos], nan=0.0)
    n_layers, n_heads = values.shape
    fig, [[ax]] = new_figure(width=max(4.0, 0.45 * n_heads + 2.5), height=max(3.0, 0.22 * n_layers + 1.5))
    layer_head_image(ax, values.numpy(), result.layers, cmap="viridis", vmin=0.0, vmax=1.0,
                     label=f"mean attention received (over queries, {result.n_sequences} sequences)")
    marked = torch.nonzero(values > result.sink_threshold)
    if len(marked):
        ax.scatter(marked[:, 1].numpy(), marked[:, 0].numpy(), s=12, c="white", marker="o", label=f"> ε = {result.sink_threshold}")
        ax.legend(loc="upper right", fontsize=7, framealpha=0.6)
    ax.set_title(f"mean attention to position {pos}{_token_label(result, pos)} "
                 f"(Gu et al. sink rate {result.sink_rate(position=pos):.2f})")
    return finish(fig, path)


def _token_label(result: Any, pos: int) -> str:
    """``" '<s>'"`` when the token at ``pos`` is the same in every sequence, else ``""``."""
    return "" if (token := result.token_at(pos)) is None else f" {token!r}"


def plot_sink_rate(result: SinkResult, *, position: int | None = None, path: str | Path | None = None) -> Any:
    """Gu et al.'s sink rate of one position per head (share of sequences with ``α^Gu > sink_threshold``) and layer."""
    expect_result(result, SinkResult, "plot_sink_rate")
    pos = _main_sink(result, position)
    frac = result.head_is_sink(method="gu")[:, :, pos]
    fig, [[left, right]] = new_figure(1, 2, width=4.5, height=max(3.0, 0.2 * frac.shape[0] + 1.5))
    layer_head_image(left, frac.numpy(), result.layers, cmap="magma", vmin=0, vmax=1,
                     label=f"share of the {result.n_sequences} sequences")
    left.set_title(f"share of sequences with α > {result.sink_threshold} "
                   f"(position {pos}{_token_label(result, pos)})", fontsize=9)
    right.barh(result.layers, result.sink_rate_by_layer(position=pos).numpy(), color="tab:purple")
    right.set(xlim=(0, 1), xlabel=f"sink rate, Gu et al. (ε = {result.sink_threshold})",
              ylabel="layer", yticks=result.layers,
              title=f"by layer; overall {result.sink_rate(position=pos):.2f}")
    return finish(fig, path)


def plot_received_by_position(result: SinkResult, *, path: str | Path | None = None) -> Any:
    """Mean attention received (over heads) vs key position, one line for each of up to 6 layers, log y;
    detected sinks dashed, the mean over analysed layers in black."""
    expect_result(result, SinkResult, "plot_received_by_position")
    fig, [[ax]] = new_figure(width=7.0, height=4.0)
    positions = torch.arange(result.received.shape[-1]).numpy()
    for layer in chosen_layers(result.layers, None, 6):
        row = result.layers.index(layer)
        ax.plot(positions, result.received[row].nanmean(dim=0).numpy(), lw=1, alpha=0.8, label=f"layer {layer}")
    ax.plot(positions, result.mean_received().numpy(), color="black", lw=2, label="all layers")
    for k in result.sink_positions:
        ax.axvline(k, color="tab:red", ls="--", lw=1)
    n_at = result.n_sequences_at
    ax.set(yscale="log", ylabel="mean attention received (over heads, queries)",
           xlabel=f"key position (averaged over the sequences reaching it: {int(n_at[0])} at 0, "
                  f"{int(n_at[-1])} at {len(n_at) - 1})",
           title="attention received by key position (dashed: detected sinks)")
    ax.legend(fontsize=7, ncol=2)
    return finish(fig, path)
