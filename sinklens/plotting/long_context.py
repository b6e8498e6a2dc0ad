"""Figure for :class:`~sinklens.analysis.long_context.ContextSweepResult`: the sink against context length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinklens.analysis.long_context import ContextSweepResult
from sinklens.plotting.style import expect_result, finish, new_figure


def plot_context_sweep(result: ContextSweepResult, *, path: str | Path | None = None) -> Any:
    """Two panels against the sequence length (log axis): left, the attention position 0 receives (mean over
    layers, heads and queries); right, Gu et al.'s sink rate of position 0 and the secondary sinks found."""
    expect_result(result, ContextSweepResult, "plot_context_sweep")
    fig, [[left, right]] = new_figure(1, 2, width=4.2, height=3.2)
    x = result.lengths
    left.plot(x, [p.sink_attention for p in result.points], "o-")
    left.set_ylabel("attention to position 0\n(mean over layers, heads, queries)")
    right.plot(x, [p.sink_rate for p in result.points], "o-")
    right.set_ylabel(f"sink rate of position 0 (Gu et al.)\n(share of heads > {result.settings.get('sink_threshold')})")
    twin = right.twinx()
    twin.plot(x, [p.n_secondary for p in result.points], "s--", color="tab:red")
    twin.set_ylabel("secondary sink positions", color="tab:red")
    twin.yaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(n) for n in x])
        ax.set(xlabel="context length (tokens)", ylim=(0, 1.02))
    return finish(fig, path)
