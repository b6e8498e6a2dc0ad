"""Streaming analyzers of attention sinks and their causes, one module per measurement: each public analyzer takes
``(model, inputs=None, *, <its settings>, options=RunOptions())`` and streams one
:class:`sinklens.streaming.Reducer`; :func:`~sinklens.analysis.report.analyze` runs them all in one pass."""
