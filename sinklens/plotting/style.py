"""Shared figure set-up and saving, so every sinklens figure looks and saves the same way."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt  # the backend is left to matplotlib (Agg headless, Jupyter inline)
import numpy as np

from sinklens.export import write_atomic


def expect_result(result: Any, kind: type, where: str) -> None:
    """Raise ``TypeError`` naming ``where``, the result class it draws and what it was given."""
    if not isinstance(result, kind):
        raise TypeError(f"{where} needs a {kind.__name__}, got a {type(result).__name__}.")


def new_figure(n_rows: int = 1, n_cols: int = 1, *, width: float = 6.0, height: float = 4.0, **kw: Any):
    """A figure with ``n_rows × n_cols`` axes of ``width × height`` inches each."""
    return plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False, **kw)


def save_figure(fig: Any, path: str | Path, *, close: bool = True) -> Path:
    """Save ``fig`` atomically at 120 dpi (default suffix ``.png``, parents created); close it unless ``close=False``."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format=path.suffix[1:].lower()))
    if close:
        plt.close(fig)
    return path


def finish(fig: Any, path: str | Path | None) -> Any:
    """Return ``fig``, saved as PNG at ``path`` first if a path is given (the figure stays open)."""
    if path is not None:
        save_figure(fig, path, close=False)
    return fig


def layer_head_image(ax: Any, values: Any, layers: Sequence[int], *, label: str = "", **kw: Any) -> None:
    """A layer × head image with a colour bar labelled ``label``, its rows labelled with their model layers (a subset
    such as ``[1, 3]`` allowed); ``kw`` go to ``imshow``."""
    image = ax.imshow(values, aspect="auto", origin="lower", **kw)
    ax.set(xlabel="head", ylabel="layer")
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=6 if len(layers) > 16 else 8)
    ax.figure.colorbar(image, ax=ax, label=label)


def paired_bars(ax: Any, left: Sequence[float] | np.ndarray, right: Sequence[float] | np.ndarray,
                labels: tuple[str, str]) -> np.ndarray:
    """Two series as side-by-side bars (width 0.4 each) at x = 0, 1, ...; returns those x positions."""
    x = np.arange(len(left))
    ax.bar(x - 0.2, left, width=0.4, label=labels[0])
    ax.bar(x + 0.2, right, width=0.4, label=labels[1])
    return x


def chosen_layers(layers: Sequence[int], wanted: Sequence[int] | None, at_most: int) -> list[int]:
    """``wanted`` (each one analysed), or up to ``at_most`` evenly spaced ``layers``."""
    if wanted is None:
        return list(layers[:: max(1, len(layers) // at_most)][:at_most])
    if missing := [layer for layer in wanted if layer not in layers]:
        raise ValueError(f"Layers {missing} were not analysed; available: {list(layers)}.")
    return list(wanted)
