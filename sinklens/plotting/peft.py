"""Figures for :mod:`sinklens.peft`: the prefix trade-off curve, training losses and the Layer Card."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sinklens.peft.layer_card import LayerCard
from sinklens.peft.sinks import PrefixSinks
from sinklens.peft.train import TrainResult
from sinklens.plotting.style import expect_result, finish, new_figure


def plot_prefix_sinks(result: PrefixSinks, *, path: str | Path | None = None) -> Any:
    """Against the input length (means over layers and heads): left, the prefix's attention mass (solid) and
    output share (dashed) per adapter; right, attention on position 0 with each adapter and without (black)."""
    expect_result(result, PrefixSinks, "plot_prefix_sinks")
    fig, [[left, right]] = new_figure(1, 2, width=4.6, height=3.6)
    n = np.array(result.input_lengths)
    mass, share, pos0 = (result.mean(k).numpy() for k in ("prefix_mass", "output_share", "pos0_mass"))
    for a, label in enumerate(result.labels):
        color = f"C{a}"
        if not np.isnan(mass[a]).all():
            left.plot(n, mass[a], "o-", color=color, label=f"{label}: attention mass")
        left.plot(n, share[a], "s--", color=color, label=f"{label}: output share")
        right.plot(n, pos0[a], "o-", color=color, label=label)
    right.plot(n, result.mean("base_pos0_mass").numpy(), "k^-", label="no adapter")
    for ax, title in ((left, "prefix share"), (right, "attention on position 0")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="input length (tokens)", ylim=(0, 1.02), title=title)
        ax.legend(fontsize=7)
    return finish(fig, path)


def plot_training(results: Sequence[TrainResult], *, path: str | Path | None = None) -> Any:
    """Training-batch loss against step, one line per run."""
    for r in results:
        expect_result(r, TrainResult, "plot_training")
    fig, [[ax]] = new_figure(1, 1, width=5.0, height=3.4)
    for r in results:
        ax.plot(np.arange(len(r.losses)), r.losses, label=f"{r.method} ({r.n_params:,d} params): eval {r.eval_after['loss']:.3f}")
    ax.set(xlabel="step", ylabel="training loss")
    ax.legend(fontsize=7)
    return finish(fig, path)


def plot_layer_card(result: LayerCard, *, path: str | Path | None = None) -> Any:
    """Resnorm per layer (placement-checked layers in red), activation energy per layer and the coupling ``ρ``."""
    expect_result(result, LayerCard, "plot_layer_card")
    fig, axes = new_figure(1, 3, width=3.8, height=3.2)
    x = np.array(result.layers)
    chosen = set(result.placement.get("layers", []))
    axes[0, 0].bar(x, result.resnorm.numpy(), color=["tab:red" if layer in chosen else "tab:blue" for layer in result.layers])
    axes[0, 1].bar(x, result.activation_energy.numpy(), color="tab:gray")
    im = axes[0, 2].imshow(result.coupling.numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
    axes[0, 2].set_xticks(range(len(x)), [str(v) for v in x], fontsize=6)
    axes[0, 2].set_yticks(range(len(x)), [str(v) for v in x], fontsize=6)
    fig.colorbar(im, ax=axes[0, 2], shrink=0.8)
    for ax, title in zip(axes[0], ("resnorm", "activation energy", "coupling ρ")):
        ax.set(xlabel="layer", title=title)
    return finish(fig, path)
