"""Figures for the init-time picture: token preference, contraction by sublayer, positional discrepancy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import MaxNLocator

from sinklens.origins.contraction import ContractionResult
from sinklens.origins.positional import PositionalDiscrepancy
from sinklens.origins.preference import TokenPreference
from sinklens.plotting.style import expect_result, finish, new_figure, paired_bars


def plot_rank_probability(prefs: dict[str, TokenPreference], *, path: str | Path | None = None) -> Any:
    """Mean next-token probability against its rank (log–log), one line per label; uniform ``1/d_vocab`` dotted."""
    if not isinstance(prefs, dict):
        raise TypeError(f"plot_rank_probability needs {{label: TokenPreference}}, got {type(prefs).__name__}; "
                        "pass e.g. {'my model': token_preference(model)}.")
    for pref in prefs.values():
        expect_result(pref, TokenPreference, "plot_rank_probability")
    fig, [[ax]] = new_figure(1, 1, width=6.0, height=4.0)
    for label, pref in prefs.items():
        ranked = pref.ranked().numpy()
        ax.loglog(np.arange(1, ranked.size + 1), ranked, label=label)
    if prefs:
        v = next(iter(prefs.values())).mean_probs.shape[1]
        ax.axhline(1.0 / v, color="grey", ls=":", label="uniform 1/V")
    ax.set(xlabel="rank", ylabel="mean next-token probability",
           title="token preference on random inputs")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_contraction(result: ContractionResult, *, path: str | Path | None = None) -> Any:
    """Inter- and intra-sequence mean cosine at every site, and each sublayer's share of the inter-sequence change."""
    expect_result(result, ContractionResult, "plot_contraction")
    fig, [[ax, ax2]] = new_figure(1, 2, width=6.0, height=4.0)
    names = [s.name for s in result.sites]
    x = np.arange(len(names))
    ax.plot(x, [s.inter_mean for s in result.sites], "o-", label="inter-sequence")
    ax.plot(x, [s.intra for s in result.sites], "s-", label="intra-sequence")
    ax.set_xticks(x, names, rotation=90, fontsize=7)
    ax.set(ylabel="mean cosine similarity", title="concentration by sublayer")
    ax.legend(fontsize=8)
    share = result.share("inter_mean").numpy()
    paired_bars(ax2, share[:, 0], share[:, 1], ("attention", "MLP"))
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    asymmetry = (f"{result.activation}: E[f(z)] = {result.activation_mean_at_zero:.3f}" if result.mlp_skipped is None
                 else "mixture of experts: no MLP asymmetry")
    ax2.set(xlabel="layer", ylabel="share of the inter-sequence change", title=f"who concentrates ({asymmetry})")
    ax2.legend(fontsize=8)
    return finish(fig, path)


def positive_or_nan(values: np.ndarray) -> np.ndarray:
    """``values`` with NaN for each entry not finite and > 0 (a log axis leaves it out)."""
    return np.where(np.isfinite(values) & (values > 0), values, np.nan)


def plot_positional(result: PositionalDiscrepancy, *, path: str | Path | None = None) -> Any:
    """Each position's attention-output variance relative to the later half, per layer (log y, from the first
    random token), and the first-token ratio by layer; non-positive values are left out."""
    expect_result(result, PositionalDiscrepancy, "plot_positional")
    fig, [[ax, ax2]] = new_figure(1, 2, width=6.0, height=4.0)
    rel = result.relative("attn_out_var").numpy()
    first = result.first_counted
    for layer in range(0, rel.shape[0], max(1, rel.shape[0] // 6)):
        ax.semilogy(np.arange(first, rel.shape[1]), positive_or_nan(rel[layer, first:]), label=f"layer {layer}")
    ax.set(xlabel="position", ylabel="attn-out variance / later-half mean")
    ax.legend(fontsize=7)
    for name in ("attn_out_var", "resid_var", "attn_out_norm"):
        ax2.semilogy(np.arange(rel.shape[0]), positive_or_nan(result.first_token_ratio(name).numpy()), "o-", label=name)
    ax2.axhline(1.0, color="grey", ls=":")
    ax2.set(xlabel="layer", ylabel=f"position {first} / later half", title="positional discrepancy")
    ax2.legend(fontsize=8)
    for a in (ax, ax2):  # integer ticks only: layers, positions
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    return finish(fig, path)
