"""``sinklens.analyze``: every analyzer in one streaming pass, gathered in a :class:`SinkReport`.

All reducers share one forward pass per batch (:func:`sinklens.streaming.stream`), so analysing
costs little more than running the model with attention patterns exposed; only ``[layer, head,
pos]``-sized statistics are kept. The one weight-only analysis (super neurons from weights) runs
after the pass, fed by the sink token's mean MLP input that the pass collected.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinklens.analysis._common import to_json
from sinklens.analysis.disparity import MassiveActivations, MassiveActivationsReducer
from sinklens.analysis.links import (
    NormalizedDisparity,
    NormalizedDisparityReducer,
    QKLocking,
    QKLockingReducer,
    SinkInputReducer,
    WeightNeurons,
    super_neurons_from_weights,
)
from sinklens.analysis.neurons import SuperNeuronReducer, SuperNeurons
from sinklens.analysis.sinks import SinkReducer, SinkResult
from sinklens.analysis.variance import VarianceReducer, VarianceResult
from sinklens.hooks import model_dims
from sinklens.inputs import Inputs, as_batches
from sinklens.streaming import HookFn, stream


@dataclass
class SinkReport:
    """Where a model's attention sinks are and what causes them, from one streaming pass.

    Attributes:
        model_name: what the model was called (a spec or class name).
        n_sequences / n_tokens: how much text was analysed (real tokens, padding excluded).
        prepend_bos: whether position 0 was a prepended BOS token (it moves the sink).
        sink_position: the position whose causes were analysed (variance discrepancy, massive
            dimensions, super neurons, links); 0 unless given.
        sinks: :class:`~sinklens.analysis.sinks.SinkResult` (received attention, sink rates, sink tokens).
        variance: :class:`~sinklens.analysis.variance.VarianceResult` (value-aggregation variance).
        massive: :class:`~sinklens.analysis.disparity.MassiveActivations` (dimension disparity).
        neurons: :class:`~sinklens.analysis.neurons.SuperNeurons` (super neurons and dimension paths).
        weight_neurons: :class:`~sinklens.analysis.links.WeightNeurons` (link b, from weights).
        normalized: :class:`~sinklens.analysis.links.NormalizedDisparity` (link c).
        locking: :class:`~sinklens.analysis.links.QKLocking` (link d).
        seconds: wall time of the pass.
    """

    model_name: str
    n_sequences: int
    n_tokens: int
    prepend_bos: bool
    sink_position: int
    sinks: SinkResult
    variance: VarianceResult
    massive: MassiveActivations
    neurons: SuperNeurons
    weight_neurons: WeightNeurons
    normalized: NormalizedDisparity
    locking: QKLocking
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

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
            "sink_rate": self.sinks.sink_rate(position=p),
            "mean_attention_to_sink": float(torch.nanmean(self.sinks.received[:, :, p])),
            "massive_dims": self.massive_dims(),
            "max_norm_ratio_at_sink": float(torch.nan_to_num(self.massive.norm_ratio[:, p]).max()),
            "super_neurons": self.neurons.super_neurons()[:8],
            "variance_discrepancy_median": float(torch.nanmedian(disc)),
            "layers_with_variance_discrepancy_above_1": int((disc.nanmedian(dim=1).values > 1).sum()),
        }

    # ------------------------------------------------------------------------------- text
    def summary(self, *, timing: bool = True) -> str:
        """A readable text report: top sinks, sink rate and variance by layer, massive dimensions, super neurons.

        ``timing=False`` leaves out the wall time, so the text is reproducible (tutorials, tests).
        """
        p = self.sink_position
        h = self.headline()
        lines = [
            f"sinklens report — {self.model_name}",
            f"{self.n_sequences} sequences, {self.n_tokens} tokens, BOS {'prepended' if self.prepend_bos else 'not prepended'}"
            + (f"; analysed in {self.seconds:.1f} s" if timing else ""),
            "",
            f"Sink positions: {h['sink_positions']}   sink rate at position {p} (eps={self.sinks.eps}): {h['sink_rate']:.3f}   "
            f"mean attention received: {h['mean_attention_to_sink']:.3f}",
        ]
        top = self.sinks.top_sinks(5)
        if top:
            lines.append("Top sink tokens at later positions: " + ", ".join(
                f"{r['token']!r} ({r['mean_received']:.3f})" if r.get("token") is not None else f"id {r['token_id']}"
                for r in top))
        lines += ["", _table(
            ["layer", "sink rate", "attn to sink", "var ratio z", "var ratio zW_O", "norm ratio", "max |x| sink"],
            self._layer_rows(),
        )]
        dims = h["massive_dims"]
        rule = " and ".join(
            ([f"|x| > {self.massive.abs_threshold:g}"] if self.massive.abs_threshold is not None else [])
            + ([f"|x| > {self.massive.rel_threshold:g}x the median |x|"] if self.massive.rel_threshold is not None else [])
        )
        lines += ["", f"Massive dimensions at position {p}: {dims or 'none'} ({rule})"]
        for path in self.neurons.paths:
            neurons = ", ".join(f"L{l}N{n} ({c:+.1f})" for l, n, c in path.top_neurons[:3])
            erased = f"erased in block {path.erase_layer}" if path.erase_layer is not None else "never erased"
            lines.append(
                f"  dim {path.dim}: peak {path.peak_value:+.1f} at stream {path.peak_layer}, written in block "
                f"{path.write_layer} (attention share {path.attn_share:.2f}), {erased}; top neurons: {neurons}"
            )
        supers = self.neurons.super_neurons()
        lines += ["", f"Super neurons (|act at sink| outlier): {len(supers)}"]
        for layer, neuron in supers[:8]:
            row = self.neurons.neuron_row(layer, neuron)
            lines.append(
                f"  L{layer} N{neuron}: act at sink {row['sink_act']:+.2f} ({row['position_ratio']:.0f}x its RMS elsewhere), "
                f"W_out kurtosis {row['row_kurtosis']:.0f}, top-{self.neurons.row_top_k} mass {row['row_top_share']:.2f}"
            )
        lock = self.locking
        lines += [
            "",
            f"Query-key locking (head median): share of positive scores against the sink "
            f"{float(lock.pos_share_sink.nanmedian()):.2f} vs other keys {float(lock.pos_share_other.nanmedian()):.2f}; "
            f"sink key in the top query directions: cosine {float(lock.key_pc_cosine.nanmedian()):.2f}",
        ]
        return "\n".join(lines)

    def _layer_rows(self) -> list[list[str]]:
        p = self.sink_position
        rate = self.sinks.sink_rate_by_layer(position=p)
        attn = torch.nanmean(self.sinks.received[:, :, p], dim=1)
        disc_z = self.variance.discrepancy(p).nanmedian(dim=1).values
        disc_r = self.variance.discrepancy(p, of="result").nanmedian(dim=1).values
        rows = []
        for i, layer in enumerate(self.sinks.layers):
            stream_row = self.massive.layers.index(layer) if layer in self.massive.layers else None
            norm = float(self.massive.norm_ratio[stream_row, p]) if stream_row is not None else float("nan")
            max_x = float(self.massive.max_abs_sink[stream_row].max()) if stream_row is not None else float("nan")
            rows.append([str(layer), f"{float(rate[i]):.2f}", f"{float(attn[i]):.3f}", f"{float(disc_z[i]):.2f}",
                         f"{float(disc_r[i]):.2f}", f"{norm:.1f}", f"{max_x:.1f}"])
        return rows

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
            "super_neurons": self.neurons.to_dict(),
            "super_neurons_from_weights": self.weight_neurons.to_dict(),
            "normalized_disparity": self.normalized.to_dict(dims=self.massive_dims() or None),
            "query_key_locking": self.locking.to_dict(),
        })

    def save(self, out_dir: str | Path, *, figures: bool = True) -> list[Path]:
        """Write ``report.json``, ``summary.txt`` and (unless ``figures=False``) PNG figures; return the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "report.json", out / "summary.txt"]
        written[0].write_text(json.dumps(self.to_dict(), indent=1))
        written[1].write_text(self.summary() + "\n")
        if figures:
            written += self.save_figures(out)
        return written

    def save_figures(self, out_dir: str | Path) -> list[Path]:
        """Save every figure of the report as PNG into ``out_dir``."""
        import matplotlib.pyplot as plt

        out = Path(out_dir)
        p = self.sink_position
        makers = {
            "attention_to_sink.png": lambda path: self.sinks.plot(path, position=p),
            "sink_rate.png": lambda path: self.sinks.plot_sink_rate(path, position=p),
            "attention_by_position.png": lambda path: self.sinks.plot_received(path),
            "variance_by_position.png": lambda path: self.variance.plot(path),
            "variance_discrepancy.png": lambda path: self.variance.plot_discrepancy(path, position=p),
            "massive_activations.png": lambda path: self.massive.plot(path),
        }
        if self.neurons.dims:
            makers["super_neurons.png"] = lambda path: self.neurons.plot(path=path)
            makers["massive_dim_path.png"] = lambda path: self.neurons.plot_path(path=path)
        makers["w_out_sparsity.png"] = lambda path: self.neurons.plot_sparsity(path=path)
        paths = []
        for name, make in makers.items():
            fig = make(out / name)
            plt.close(fig)
            paths.append(out / name)
        return paths


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def analyze(
    model: Any,
    inputs: Inputs | None = None,
    *,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    sink_position: int = 0,
    eps: float = 0.3,
    abs_threshold: float | None = 100.0,
    rel_threshold: float | None = 1000.0,
    extra_hooks: Sequence[tuple[str, HookFn]] = (),
    progress: bool = True,
    model_name: str | None = None,
) -> SinkReport:
    """Run every sink analyzer on ``model`` in one streaming pass and return a :class:`SinkReport`.

    Args:
        inputs: prompts, token ids or TokenBatches (default: the built-in prompt set); see
            :func:`sinklens.inputs.as_batches`. Use :func:`sinklens.inputs.random_token_batches` for
            the theory's random-token setting.
        prepend_bos: put BOS at position 0 (say which in papers: it moves the sink).
        max_length: truncate prompts to this many tokens.
        sink_position: position whose causes are analysed (variance, massive dims, neurons, links).
        eps: Gu et al.'s sink-rate threshold.
        abs_threshold / rel_threshold: massive-activation thresholds (Sun et al.: |x| > 100 and
            > 1000x the median |x|); for small models use e.g. ``abs_threshold=None, rel_threshold=50``.
        extra_hooks: hooks added to every forward, e.g. an intervention from :mod:`sinklens.interventions`.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> report = analyze(tiny_model(), ["t5 t6 t7 t8 t9 t10", "t3 t4 t5 t6"], progress=False,
        ...                  abs_threshold=None, rel_threshold=3.0)
        >>> report.n_sequences, report.sinks.received.shape[:2]
        (2, torch.Size([2, 4]))
    """
    start = time.perf_counter()
    batches = as_batches(model, inputs, batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
    dims = model_dims(model)
    reducers = [
        SinkReducer(model, eps=eps),
        VarianceReducer(model),
        MassiveActivationsReducer(model, abs_threshold=abs_threshold, rel_threshold=rel_threshold,
                                  sink_position=sink_position),
        SuperNeuronReducer(model, sink_position=sink_position),
        SinkInputReducer(model, sink_position=sink_position),
        NormalizedDisparityReducer(model, sink_position=sink_position),
        QKLockingReducer(model, sink_position=sink_position),
    ]
    sinks, variance, massive, neurons, sink_input, normalized, locking = stream(
        model, batches, reducers, extra_hooks=extra_hooks, progress=progress, desc="sinklens analyze"
    )
    weight_neurons = super_neurons_from_weights(
        model, dims=neurons.dims or None, sink_input=sink_input,
        w_out_sparsity=(neurons.row_kurtosis, neurons.row_top_share),  # same rows, same k: computed once
    )
    n_tokens = int(sum(int(b.valid.sum()) for b in batches))
    return SinkReport(
        model_name=model_name or getattr(dims, "name", None) or type(model).__name__,
        n_sequences=int(sum(b.tokens.shape[0] for b in batches)),
        n_tokens=n_tokens,
        prepend_bos=bool(batches[0].prepend_bos),
        sink_position=sink_position,
        sinks=sinks,
        variance=variance,
        massive=massive,
        neurons=neurons,
        weight_neurons=weight_neurons,
        normalized=normalized,
        locking=locking,
        seconds=time.perf_counter() - start,
        settings={"batch_size": batch_size, "max_length": max_length, "eps": eps,
                  "abs_threshold": abs_threshold, "rel_threshold": rel_threshold},
    )
