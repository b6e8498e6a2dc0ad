"""``sinklens.analyze``: every analyzer in one streaming pass, gathered in a :class:`SinkReport`.

All reducers share one forward pass per batch (:func:`sinklens.streaming.stream`), so analysing
costs little more than running the model with attention patterns exposed; only ``[layer, head,
pos]``-sized statistics are kept. The one weight-only analysis (super neurons from weights) runs
after the pass, fed by the sink token's mean MLP input that the pass collected.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinklens.analysis._common import checked_options
from sinklens.analysis.disparity import MassiveActivations, MassiveActivationsReducer, MassiveSettings
from sinklens.analysis.neurons import SuperNeuronReducer, SuperNeurons, SuperNeuronSettings
from sinklens.analysis.normalized_disparity import NormalizedDisparity, NormalizedDisparityReducer
from sinklens.analysis.qk_locking import QKLocking, QKLockingReducer, qk_locking_reason
from sinklens.analysis.sinks import SinkReducer, SinkResult, SinkSettings
from sinklens.analysis.value_drain import ValueDrain, ValueDrainReducer, ValueDrainSettings, value_drain_reason
from sinklens.analysis.variance import VarianceReducer, VarianceResult
from sinklens.analysis.verify import CausalCheck, verify_attribution
from sinklens.analysis.weight_super_neurons import SinkInputReducer, WeightNeurons, super_neurons_from_weights
from sinklens.display import CompactRepr
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dtype, with_cached_weights
from sinklens.inputs import Inputs, is_encoder, require_a_later_position
from sinklens.options import RunOptions
from sinklens.residual_units import input_norm_reason, neuron_reason
from sinklens.streaming import batches_for, stream


def _max_or_nan(values: torch.Tensor) -> float:
    """The largest value, ignoring NaN (``inf`` stays ``inf``); NaN when every value is NaN."""
    finite_or_inf = values[~values.isnan()]
    return float(finite_or_inf.max()) if finite_or_inf.numel() else math.nan


@dataclass(repr=False, eq=False)
class SinkReport(CompactRepr):
    """Where a model's attention sinks are and what causes them, from one streaming pass.

    Attributes:
        model_name: what the model was called (a spec or class name).
        n_sequences / n_tokens: how much text was analysed (real tokens, padding excluded).
        prepend_bos: whether position 0 was a prepended BOS token (it moves the sink).
        sink_position: the position whose causes were analysed (variance discrepancy, massive
            dimensions, super neurons, normalised disparity, query-key locking); 0 unless given.
        sinks: :class:`~sinklens.analysis.sinks.SinkResult` (received attention, sink rates, sink tokens).
        variance: :class:`~sinklens.analysis.variance.VarianceResult` (value-aggregation variance).
        massive: :class:`~sinklens.analysis.disparity.MassiveActivations` (dimension disparity).
        neurons: :class:`~sinklens.analysis.neurons.SuperNeurons` (super neurons and dimension paths, in residual
            units); None when skipped (a mixture-of-experts MLP: see ``skipped``).
        weight_neurons: :class:`~sinklens.analysis.weight_super_neurons.WeightNeurons` (super neurons from weights);
            None when skipped; without its read-vector alignments (``align_in``/``align_gate`` None) on a model
            without normalization (``skipped["mlp_input_alignment"]``).
        normalized: :class:`~sinklens.analysis.normalized_disparity.NormalizedDisparity` (disparity after the norm);
            None when skipped (a model without normalization, ``cfg.normalization_type=None``: see ``skipped``).
        locking: :class:`~sinklens.analysis.qk_locking.QKLocking` (query–key locking); None when skipped
            (rotated queries/keys not exposed: see ``skipped``).
        seconds: wall time of the pass (left out of ``==``: two reports of the same inputs are equal).
        settings: the run and analyzer settings (batch size, truncation, thresholds).
        causal: :class:`~sinklens.analysis.verify.CausalCheck` from ``analyze(..., verify=True)`` (zeroing each
            massive dimension's top writers at the sink), else None.
        skipped: section name -> why it was skipped (e.g. ``"super_neurons"`` on a mixture-of-experts model).
        value_drain: :class:`~sinklens.analysis.value_drain.ValueDrain` (what the sink writes: no-op or
            broadcast sink heads); None when skipped (see ``skipped``).

    The text layout lives in :mod:`sinklens.analysis.report_text`, file writing in
    :mod:`sinklens.analysis.report_files`; :meth:`summary` and :meth:`save` call them.
    """

    model_name: str
    n_sequences: int
    n_tokens: int
    prepend_bos: bool
    sink_position: int
    sinks: SinkResult
    variance: VarianceResult
    massive: MassiveActivations
    neurons: SuperNeurons | None
    weight_neurons: WeightNeurons | None
    normalized: NormalizedDisparity | None
    locking: QKLocking | None
    seconds: float = field(compare=False)  # timing: two analyses of the same inputs are equal
    settings: dict[str, Any] = field(default_factory=dict)
    causal: CausalCheck | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    value_drain: ValueDrain | None = None

    # ------------------------------------------------------------------------------- numbers
    def massive_dims(self) -> list[int]:
        """Residual dimensions that are massive at the sink position in some layer."""
        return self.massive.massive_dims("sink")

    def headline(self) -> dict[str, Any]:
        """The handful of numbers a reader wants first (all defined in the analyzers' docstrings)."""
        p = self.sink_position
        disc = self.variance.discrepancy(p)
        return {
            "sink_positions": self.sinks.sink_positions,
            "sink_rate": self.sinks.sink_rate(position=p),  # Gu et al.'s definition (their code)
            "sinklens_sink_rate": self.sinks.sink_rate(position=p, method="sinklens"),
            "sink_position_tokens": {str(k): self.sinks.token_at(k) for k in self.sinks.sink_positions},
            "position_0": self.sinks.describe_start(),
            "mean_attention_to_sink": float(torch.nanmean(self.sinks.received[:, :, p])),
            "massive_dims": self.massive_dims(),
            "max_norm_ratio_at_sink": _max_or_nan(self.massive.norm_ratio[:, p]),
            "super_neurons": self.neurons.super_neurons()[:8] if self.neurons is not None else [],
            "variance_discrepancy_median": float(torch.nanmedian(disc)),
            "layers_with_variance_discrepancy_above_1": int((disc.nanmedian(dim=1).values > 1).sum()),
        }

    # ------------------------------------------------------------------------------- text and files
    def summary(self, *, timing: bool = True) -> str:
        """The text summary (see :func:`sinklens.analysis.report_text.format_summary`)."""
        from sinklens.analysis.report_text import format_summary

        return format_summary(self, timing=timing)

    def save(self, out_dir: str | Path, *, figures: bool = True) -> list[Path]:
        """Write ``report.json``, ``summary.txt`` and figures (see :func:`sinklens.analysis.report_files.save_report`)."""
        from sinklens.analysis.report_files import save_report

        return save_report(self, out_dir, figures=figures)

    # ------------------------------------------------------------------------------- export
    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready nested dicts/lists (NaN and inf become None)."""
        p = self.sink_position
        return to_json({
            "model": self.model_name,
            "n_sequences": self.n_sequences,
            "n_tokens": self.n_tokens,
            "prepend_bos": self.prepend_bos,
            "sink_position": p,
            "seconds": self.seconds,
            "settings": self.settings,
            "headline": self.headline(),
            "sinks": self.sinks.to_dict(),
            "variance": self.variance.to_dict(position=p),
            "massive_activations": self.massive.to_dict(),
            "super_neurons": self.neurons.to_dict() if self.neurons is not None
            else {"skipped": self.skipped.get("super_neurons")},
            "super_neurons_from_weights": self.weight_neurons.to_dict() if self.weight_neurons is not None
            else {"skipped": self.skipped.get("super_neurons")},
            "causal_check": self.causal.to_dict() if self.causal is not None else None,
            "skipped": self.skipped,
            "normalized_disparity": self.normalized.to_dict(dims=self.massive_dims() or None)
            if self.normalized is not None else {"skipped": self.skipped.get("normalized_disparity")},
            "query_key_locking": self.locking.to_dict() if self.locking is not None
            else {"skipped": self.skipped.get("query_key_locking")},
            "value_drain": self.value_drain.to_dict() if self.value_drain is not None
            else {"skipped": self.skipped.get("value_drain")},
        })


@with_cached_weights  # the analyzers of one pass stack each weight once
def analyze(
    model: Any,
    inputs: Inputs | None = None,
    *,
    sink_position: int = 0,
    sink_threshold: float = SinkSettings.sink_threshold,
    abs_threshold: float | None = MassiveSettings.abs_threshold,
    rel_threshold: float | None = MassiveSettings.rel_threshold,
    model_name: str | None = None,
    verify: bool = False,
    options: RunOptions = RunOptions(),
) -> SinkReport:
    """Run every sink analyzer on ``model`` in one streaming pass and return a :class:`SinkReport`.

    Args:
        inputs: anything :func:`sinklens.inputs.as_batches` accepts (None: the built-in prompts).
        sink_position: position whose causes are analysed (variance, massive dims, neurons, normalised disparity, locking).
        sink_threshold: Gu et al.'s sink-rate threshold ``ε``.
        abs_threshold / rel_threshold: massive-activation thresholds (Sun et al.: |x| > 100 and
            > 1000x the median |x|); for small models use e.g. ``abs_threshold=None, rel_threshold=50``.
        model_name: what to call the model in the report (default: its class name).
        verify: also run the causal check (:func:`sinklens.analysis.verify.verify_attribution`): zero each
            massive dimension's top writing neurons at the sink and report the share of the dimension and of the
            sink's received attention that disappears (one extra forward per dimension, plus one baseline).
        options: batching, BOS (say which in papers: it moves the sink), truncation, extra hooks
            (e.g. an intervention from :mod:`sinklens.interventions`) and progress bar.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> report = analyze(tiny_model(), ["t5 t6 t7 t8 t9 t10", "t3 t4 t5 t6"],
        ...                  abs_threshold=None, rel_threshold=3.0, options=RunOptions(progress=False))
        >>> report.n_sequences, report.sinks.received.shape[:2]
        (2, torch.Size([2, 4]))
    """
    start = time.perf_counter()
    options = checked_options(options, "analyze")
    sink_settings = SinkSettings(sink_threshold)
    massive_settings = MassiveSettings(abs_threshold=abs_threshold, rel_threshold=rel_threshold, sink_position=sink_position)
    batches = batches_for(model, inputs, options)
    require_a_later_position(batches, what="analyze", sink_position=massive_settings.sink_position,
                             bidirectional=is_encoder(model))
    moe = neuron_reason(model)  # a mixture-of-experts or post-LN model has no additive neuron writes: skip
    skipped = {"super_neurons": f"skipped: {moe}"} if moe is not None else {}
    no_locking = qk_locking_reason(model)
    if no_locking is not None:
        skipped["query_key_locking"] = f"skipped: {no_locking}"
    # A model without normalization (cfg.normalization_type=None) has no norm input to read: the sections
    # that read one (normalised disparity; the MLP input that the weight ranking aligns with) are skipped.
    no_norm = input_norm_reason(model, "attn")
    if no_norm is not None:
        skipped["normalized_disparity"] = f"skipped: {no_norm}"
    no_mlp_input = None if moe is not None else input_norm_reason(model, "mlp")
    if no_mlp_input is not None:
        skipped["mlp_input_alignment"] = f"skipped: {no_mlp_input}"
    neuron_reducers = [] if moe is not None else [
        SuperNeuronReducer(model, settings=SuperNeuronSettings(sink_position=sink_position)),
        *([] if no_mlp_input is not None else [SinkInputReducer(model, sink_position=sink_position)]),
    ]
    reducers = [
        SinkReducer(model, settings=sink_settings),
        VarianceReducer(model),
        MassiveActivationsReducer(model, settings=massive_settings),
        *neuron_reducers,
        *([] if no_norm is not None else [NormalizedDisparityReducer(model, sink_position=sink_position)]),
        *([] if no_locking is not None else [QKLockingReducer(model, sink_position=sink_position)]),
    ]
    # Value drain (what the sink writes) rides the same pass; its result is the last one.
    no_drain = value_drain_reason(model)
    if no_drain is not None:
        skipped["value_drain"] = f"skipped: {no_drain}"
    else:
        reducers.append(ValueDrainReducer(model, settings=ValueDrainSettings(sink_position=sink_position)))
    desc = "sinklens analyze" if options.desc == RunOptions.desc else options.desc
    results = stream(model, batches, reducers, options=options.replace(desc=desc))
    value_drain = None if no_drain is not None else results.pop()
    locking = None if no_locking is not None else results.pop()
    normalized = None if no_norm is not None else results.pop()
    sink_input = None if moe is not None or no_mlp_input is not None else results.pop()
    neurons = None if moe is not None else results.pop()
    sinks, variance, massive = results
    weight_neurons, causal = None, None
    if neurons is not None:
        weight_neurons = super_neurons_from_weights(
            model, dims=neurons.dims or None, sink_input=sink_input,
            w_out_sparsity=(neurons.row_kurtosis, neurons.row_top_share),  # same rows, same k: computed once
        )
        if verify:
            causal = verify_attribution(model, batches, neurons, options=options)
    elif verify:
        skipped["causal_check"] = f"skipped: {moe}"
    return SinkReport(
        model_name=model_name or type(model).__name__,
        n_sequences=int(sum(b.tokens.shape[0] for b in batches)),
        n_tokens=sum(sum(b.host_lengths()) for b in batches),
        prepend_bos=bool(batches[0].prepend_bos),
        sink_position=sink_position,
        sinks=sinks,
        variance=variance,
        massive=massive,
        neurons=neurons,
        weight_neurons=weight_neurons,
        normalized=normalized,
        locking=locking,
        value_drain=value_drain,
        seconds=time.perf_counter() - start,
        settings={"batch_size": options.batch_size, "max_length": options.max_length,
                  "sink_threshold": sink_settings.sink_threshold, "abs_threshold": abs_threshold,
                  "rel_threshold": rel_threshold, "verify": verify,
                  "dtype": str(model_dtype(model)).removeprefix("torch."), "device": str(model_device(model))},
        causal=causal,
        skipped=skipped,
    )
