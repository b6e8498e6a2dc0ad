"""Figures for intervention experiments: before/after sink profiles and patching heat maps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinklens.interventions.experiments import InterventionResult
from sinklens.interventions.patching import SinkPatchResult
from sinklens.plotting.style import expect_result, finish, new_figure


def plot_intervention(result: InterventionResult, path: str | Path | None = None) -> Any:
    """Left: head-averaged attention to the target (solid) and the original sink (dashed) per layer, before
    (grey) and after. Right: the target's ``hook_resid_post`` norm per layer before and after (log)."""
    expect_result(result, InterventionResult, "plot_intervention")
    fig, [[ax, ax2]] = new_figure(1, 2, width=5.5, height=3.6)
    layers = result.layers
    ax.plot(layers, result.received_before.mean(dim=1), color="0.5", label=f"to pos {result.target}, before")
    ax.plot(layers, result.received_after.mean(dim=1), color="C3", label=f"to pos {result.target}, after")
    if result.sink != result.target:
        ax.plot(layers, result.sink_before.mean(dim=1), color="0.5", ls="--", label=f"to sink {result.sink}, before")
        ax.plot(layers, result.sink_after.mean(dim=1), color="C0", ls="--", label=f"to sink {result.sink}, after")
    ax.set(xlabel="layer", ylabel="attention received (mean over heads, queries)",
           title=result.method, ylim=(0, 1))
    ax.legend(fontsize=7)
    ax2.plot(layers, result.resid_norm_before, color="0.5", label="before")
    ax2.plot(layers, result.resid_norm_after, color="C3", label="after")
    ax2.set(xlabel="layer", ylabel=f"‖resid_post‖ at pos {result.target}", yscale="log")
    ax2.legend(fontsize=7)
    return finish(fig, path)


def plot_patching(result: SinkPatchResult, path: str | Path | None = None) -> Any:
    """Heat map of the fraction of the sink metric each patched component restores."""
    expect_result(result, SinkPatchResult, "plot_patching")
    restored, axes = result.restored, list(result.axes)
    if restored.ndim == 3:  # layer × pos × head: sum over positions
        restored, axes = restored.sum(dim=1), [axes[0], axes[2]]
    fig, [[ax]] = new_figure(1, 1, width=6.0, height=4.0)
    bound = max(float(restored.abs().max()), 1e-6)
    im = ax.imshow(restored.numpy(), cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
    ax.set(xlabel=axes[1], ylabel="layer", title=f"sink restored by patching {result.site} (target {result.target})")
    ax.set_yticks(range(len(result.coords["layer"])), [str(v) for v in result.coords["layer"]])
    ax.set_xticks(range(len(result.coords[axes[1]])), [str(v) for v in result.coords[axes[1]]], fontsize=7)
    fig.colorbar(im, ax=ax, label="fraction restored")
    return finish(fig, path)
