"""Matplotlib figures for reports and tutorials, one module per topic."""
