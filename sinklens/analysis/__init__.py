"""Streaming analyzers of attention sinks and their causes, one module per measurement.

* :mod:`~sinklens.analysis.attention` — attention received per key position (the base reducer);
* :mod:`~sinklens.analysis.sinks` — sink positions, Gu et al. sink rates, sink tokens;
* :mod:`~sinklens.analysis.qk_attention` — the same attention weights from queries and keys, memory linear in T;
* :mod:`~sinklens.analysis.variance` — value-aggregation variance of head outputs by position;
* :mod:`~sinklens.analysis.disparity` — massive activations in the residual stream (Sun et al.);
* :mod:`~sinklens.analysis.neurons` — super neurons and the write/erase path of each massive dimension;
* :mod:`~sinklens.analysis.weight_super_neurons` — super-neuron candidates from weights alone;
* :mod:`~sinklens.analysis.normalized_disparity` — dimension disparity after the norm;
* :mod:`~sinklens.analysis.qk_locking` — query–key locking on the sink key;
* :mod:`~sinklens.analysis.value_drain` — what the sink writes: no-op vs broadcast sink heads;
* :mod:`~sinklens.analysis.verify` — the causal check: zero each massive dimension's top writers;
* :mod:`~sinklens.analysis.report` — :func:`~sinklens.analysis.report.analyze` (all of them in one
  pass) and :class:`~sinklens.analysis.report.SinkReport` with its text summary; its files and figures
  are written by :func:`sinklens.plotting.report.save_report`.

Each public analyzer takes ``(model, inputs=None, *, <its settings>, options=RunOptions())``; each
reducer follows :class:`sinklens.streaming.Reducer` and holds the same frozen settings dataclass as
its result.
"""
