"""Matplotlib figures for reports and tutorials, one module per topic."""

from sinklens.plotting.style import new_figure, save_figure

__all__ = ["new_figure", "save_figure"]
