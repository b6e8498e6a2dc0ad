"""Figures for :class:`sinklens.analysis.neurons.SuperNeurons`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinklens.analysis.neurons import SuperNeurons
from sinklens.display import neuron_name
from sinklens.errors import InvalidArgumentError
from sinklens.plotting.style import expect_result, finish, new_figure


def _dim(result: Any, dim: int | None) -> int:
    if dim is None and not result.dims:
        raise ValueError("No massive dimension was found or given; pass dim=... to find_super_neurons(dims=[...]).")
    return result.dims[0] if dim is None else dim


def plot_contributions(result: SuperNeurons, *, dim: int | None = None, k: int = 10, path: str | Path | None = None) -> Any:
    """The ``k`` neurons writing most (directly, residual units) into ``dim`` at the sink towards its peak's sign."""
    expect_result(result, SuperNeurons, "plot_contributions")
    dim = _dim(result, dim)
    top = result.top(dim, k)
    fig, [[ax]] = new_figure(width=7.0, height=4.0)
    supers = set(result.super_neurons())
    colors = ["tab:red" if (l, n) in supers else "tab:blue" for l, n, _ in top]
    ax.bar(range(len(top)), [c for _, _, c in top], color=colors)
    ax.set_xticks(range(len(top)), [neuron_name(l, n) for l, n, _ in top], rotation=45, fontsize=8)
    ax.set(ylabel=f"contribution to dim {dim} at position {result.sink_position}\n(residual units)",
           title=f"Top {len(top)} direct writers of dim {dim}, towards its peak's sign\n"
                 "(erasers not shown; red: super neurons)")
    return finish(fig, path)


def plot_row_sparsity(result: SuperNeurons, *, path: str | Path | None = None) -> Any:
    """Every neuron's ``W_out`` row kurtosis vs its top-k mass share; super neurons in red."""
    expect_result(result, SuperNeurons, "plot_row_sparsity")
    fig, [[ax]] = new_figure(width=6.0, height=4.5)
    kurt, share = result.row_kurtosis.flatten(), result.row_top_share.flatten()
    sup = result.is_super.flatten()
    ax.scatter(kurt[~sup], share[~sup], s=4, alpha=0.4, color="tab:blue", label="neurons")
    ax.scatter(kurt[sup], share[sup], s=30, color="tab:red", label="super neurons")
    ax.set(xscale="log", xlabel="kurtosis of W_out row", title="Channel sparsity of W_out rows",
           ylabel=f"share of ||W_out row||² in top {result.row_top_k}")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_dim_path(result: SuperNeurons, *, dim: int | None = None, path: str | Path | None = None) -> Any:
    """Residual value of ``dim`` at the sink per stream index, with each block's attention and MLP step."""
    expect_result(result, SuperNeurons, "plot_dim_path")
    dim = _dim(result, dim)
    d_model = result.resid_sink.shape[1]
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < d_model:
        raise InvalidArgumentError(f"dim must be a residual dimension in 0..{d_model - 1}, got {dim!r}.")
    fig, [[ax]] = new_figure(width=7.0, height=4.0)
    n = result.attn_out_sink.shape[0]
    ax.plot(range(n + 1), result.resid_sink[:, dim].numpy(), "o-", color="black", label="residual (input of block)")
    ax.bar([x + 0.3 for x in range(n)], result.attn_out_sink[:, dim].numpy(), width=0.3, label="attn_out", color="tab:orange")
    ax.bar([x + 0.6 for x in range(n)], result.mlp_out_sink[:, dim].numpy(), width=0.3, label="mlp_out", color="tab:green")
    ax.set(xlabel="block", ylabel=f"dim {dim} at position {result.sink_position}",
           title=f"Where dim {dim} is written and erased")
    ax.legend(fontsize=8)
    return finish(fig, path)
