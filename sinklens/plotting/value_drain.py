"""Figure for :class:`~sinklens.analysis.value_drain.ValueDrain`: attention to the sink against what it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sinklens.analysis.value_drain import ValueDrain
from sinklens.plotting.style import expect_result, finish, layer_head_image, new_figure

#: Marker colour of each head class.
KIND_COLORS = {"no-op": "tab:blue", "broadcast": "tab:red", "partial": "tab:orange", "none": "lightgray"}


def plot_value_drain(result: ValueDrain, *, path: str | Path | None = None) -> Any:
    """Left: per head, attention to the sink (x) against the sink's share of the head's write (y), coloured by class,
    with the class thresholds. Right: the layer × head ``write_share`` map, sink heads lettered by class."""
    expect_result(result, ValueDrain, "plot_value_drain")
    fig, [[ax, grid]] = new_figure(1, 2, width=4.6, height=3.8)
    x, y = result.attn_sink.numpy(), result.write_share.numpy()
    kinds = np.array(result.kinds()).reshape(x.shape)
    for kind, color in KIND_COLORS.items():
        if (mask := kinds == kind).any():
            ax.scatter(x[mask], y[mask], s=18, color=color, label=kind, zorder=3 if kind != "none" else 2)
    s = result.settings
    ax.axvline(s.sink_head_threshold, color="k", ls=":", lw=1)
    ax.axhline(s.no_op_share, color="tab:blue", ls="--", lw=1)
    ax.axhline(s.broadcast_share, color="tab:red", ls="--", lw=1)
    ax.set(xlim=(0, 1.02), ylim=(0, 1.02), xlabel="mean attention to the sink",
           ylabel="sink's share of the head's write")
    ax.set_title(f"value drain (sink position {s.sink_position})", fontsize=9)
    ax.legend(fontsize=7)
    layer_head_image(grid, y, result.layers, cmap="viridis", vmin=0.0, vmax=1.0)
    letters = {"no-op": "n", "broadcast": "b", "partial": "p"}
    for (i, h), kind in np.ndenumerate(kinds):
        if kind in letters:
            grid.text(h, i, letters[kind], ha="center", va="center", fontsize=7, color="w")
    grid.set_title("write share of the sink", fontsize=9)
    return finish(fig, path)
