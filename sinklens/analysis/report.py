"""``sinklens.analyze``: every analyzer in one streaming pass (one forward per batch, only
``[layer, head, pos]``-sized statistics kept), gathered in a :class:`SinkReport`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sinklens.analysis._common import checked_options, method_for_hooks
from sinklens.analysis.disparity import MassiveActivations, MassiveActivationsReducer, MassiveSettings
from sinklens.analysis.neurons import SuperNeuronReducer, SuperNeurons, add_total_effects
from sinklens.analysis.normalized_disparity import NormalizedDisparity, NormalizedDisparityReducer
from sinklens.analysis.qk_locking import QKLocking, QKLockingReducer, qk_locking_reason
from sinklens.analysis.sinks import SinkReducer, SinkResult, SinkSettings
from sinklens.analysis.value_drain import ValueDrain, ValueDrainReducer, ValueDrainSettings, value_drain_reason
from sinklens.analysis.variance import VarianceReducer, VarianceResult
from sinklens.analysis.verify import CausalCheck, verify_attribution
from sinklens.analysis.weight_super_neurons import SinkInputReducer, WeightNeurons, super_neurons_from_weights
from sinklens.display import CompactRepr, neuron_name, times_elsewhere
from sinklens.export import to_json
from sinklens.hooks import Z, model_device, model_dtype, with_cached_weights
from sinklens.inputs import Inputs, describe_bos, is_encoder, require_a_later_position
from sinklens.options import RunOptions
from sinklens.residual_units import input_norm_reason, neuron_reason
from sinklens.streaming import batches_for, stream


@dataclass(repr=False, eq=False)
class SinkReport(CompactRepr):
    """Where a model's attention sinks are and what causes them, from one streaming pass.

    Each section is its analyzer's result (``sinks``, ``variance``, ``massive``, ``neurons``, ``weight_neurons``,
    ``normalized``, ``locking``, ``value_drain``; ``causal`` with ``verify=True``), or None when skipped, with the
    reason in ``skipped[section]``. ``sink_position``: the position whose causes were analysed; ``n_tokens``: real
    tokens; ``seconds``: wall time (left out of ``==``); ``bos`` / ``attention``: what position 0 got and where
    attention was read. :func:`sinklens.plotting.report.save_report` writes it.
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
    seconds: float = field(compare=False)
    settings: dict[str, Any] = field(default_factory=dict)
    causal: CausalCheck | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    value_drain: ValueDrain | None = None
    bos: str = ""
    attention: str = ""

    def massive_dims(self) -> list[int]:
        """Residual dimensions that are massive at the sink position in some layer."""
        return self.massive.massive_dims("sink")

    def headline(self) -> dict[str, Any]:
        """The handful of numbers a reader wants first (defined in the analyzers' docstrings)."""
        p = self.sink_position
        disc = self.variance.discrepancy(p)
        ratio = self.massive.norm_ratio[:, p]
        ratio = ratio[~ratio.isnan()]
        return {
            "sink_positions": self.sinks.sink_positions,
            "sink_rate": self.sinks.sink_rate(position=p),  # Gu et al.'s definition (their code)
            "sinklens_sink_rate": self.sinks.sink_rate(position=p, method="sinklens"),
            "sink_position_tokens": {str(k): self.sinks.token_at(k) for k in self.sinks.sink_positions},
            "position_0": self.sinks.describe_start(),
            "mean_attention_to_sink": float(torch.nanmean(self.sinks.received[:, :, p])),
            "massive_dims": self.massive_dims(),
            "max_norm_ratio_at_sink": float(ratio.max()) if ratio.numel() else math.nan,
            "super_writers": self.neurons.super_neurons("writers")[:8] if self.neurons is not None else [],
            "super_erasers": self.neurons.super_neurons("erasers")[:8] if self.neurons is not None else [],
            "variance_discrepancy_median": float(torch.nanmedian(disc)),
            "layers_with_variance_discrepancy_above_1": int((disc.nanmedian(dim=1).values > 1).sum()),
        }

    def summary(self, *, timing: bool = True) -> str:
        """The text report; ``timing=False`` leaves out the wall time, so the text is reproducible."""
        p = self.sink_position
        h = self.headline()
        lines = [
            f"sinklens report — {self.model_name}",
            f"{self.n_sequences} sequences, {self.n_tokens} tokens, {self.sinks.describe_start()}"
            + (f"; analysed in {self.seconds:.1f} s" if timing else ""),
            f"bos: {self.bos}",
            f"sink statistics: {self.attention}",
            "",
            "Sink positions: " + (", ".join(f"{k} ({self.sinks.token_at(k)!r})" if self.sinks.token_at(k) is not None
                                             else f"{k} (token varies)" for k in h["sink_positions"]) or "none"),
            f"Sink rate at position {p} (sink_threshold={self.sinks.sink_threshold}): {h['sink_rate']:.3f} (Gu et al.'s code: "
            f"every query that sees the key, its own included), {self.sinks.sink_rate(position=p, method='sinklens'):.3f} "
            f"(sinklens: queries from min_query={self.sinks.min_query})   mean attention received: {h['mean_attention_to_sink']:.3f}",
        ]
        if (vs := self.sinks.virtual_sink) is not None:
            lines.append(f"Virtual sink (learned sink logits; mass given to no key, mean over real queries): "
                         f"mean {float(vs.mean()):.3f}, max {float(vs.max()):.3f} over heads")
        if top := self.sinks.top_sinks(5):
            lines.append("Most attended later tokens (mean attention received over layers and heads): " + ", ".join(
                f"{r['token']!r} ({r['mean_received']:.3f})" if r.get("token") is not None else f"id {r['token_id']}"
                for r in top))
        header = ["layer", "Gu sink rate", "attn to sink", "var ratio z", "var ratio zW_O", "norm ratio", "max |x| sink"]
        lines += ["", table(header, layer_rows(self))]
        lines.append(f"Gu sink rate: share of the layer's (head, sequence) pairs whose attention to position {p} exceeds "
                     f"sink_threshold (Gu et al.'s code); attn to sink: attention position {p} receives, mean over heads, "
                     f"queries and sequences; norm ratio: ||x|| at position {p} / median ||x|| of the other positions, "
                     f"residual entering the block, mean over sequences; max |x| sink: largest |x| at position {p} "
                     "entering the block, over sequences and dimensions.")
        var = self.variance  # what "var ratio" means, and Li et al.'s feature-std ratio beside it, by layer
        site = "" if var.output_site == Z else f", z for zW_O read at {var.output_site} (what W_O reads in this model)"
        lines += [f"var ratio z / zW_O (sinklens): median over heads of the variance over sequences around the "
                  f"all-position mean, position {p} over the rest (> 1: position {p} varies more); zW_O in residual "
                  f"units (through any post-attention norm){site}",
                  f"feature std ratio (Li et al.'s code: std over the o_proj input's features per token, mean over "
                  f"sequences), position {p} / rest, by layer: "
                  + " ".join(f"{float(r):.2f}" for r in var.discrepancy(p, of="feature_std"))]
        dims = h["massive_dims"]
        rules = ((self.massive.abs_threshold, "|x| > {:g}"), (self.massive.rel_threshold, "|x| > {:g}x the median |x|"))
        rule = " and ".join(text.format(t) for t, text in rules if t is not None)
        lines += ["", f"Massive dimensions at position {p}: {dims or 'none'} ({rule})", *neuron_lines(self),
                  *disparity_lines(self, dims)]
        if (drain := self.value_drain) is not None:  # how many sink heads are no-op / broadcast / partial
            n = drain.counts()
            lines += ["", f"Value drain at position {drain.sink_position}: {n['no-op'] + n['broadcast'] + n['partial']} "
                      f"sink heads (attention to it >= {drain.sink_head_threshold:g}): {n['no-op']} no-op (sink's write "
                      f"share < {drain.no_op_share:g}), {n['broadcast']} broadcast (>= {drain.broadcast_share:g}), "
                      f"{n['partial']} partial; writes in residual units" + (
                          f" through the post-attention norm in layers {drain.post_norm_layers}"
                          if drain.post_norm_layers else "")]
        elif "value_drain" in self.skipped:
            lines += ["", f"Value drain {self.skipped['value_drain']}"]
        lock = self.locking
        lines += [
            "",
            f"Query-key locking (head median): share of positive scores against the sink "
            f"{float(lock.pos_share_sink.nanmedian()):.2f} vs other keys {float(lock.pos_share_other.nanmedian()):.2f}; "
            f"sink key in the top query directions: cosine {float(lock.key_pc_cosine.nanmedian()):.2f}"
            if lock is not None else f"Query-key locking {self.skipped.get('query_key_locking', 'skipped')}",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready nested dicts/lists (NaN and inf become None)."""
        p = self.sink_position

        def section(result: Any, why: str, **kw: Any) -> dict[str, Any]:
            return {"skipped": self.skipped.get(why)} if result is None else result.to_dict(**kw)

        return to_json({
            "model": self.model_name, "n_sequences": self.n_sequences, "n_tokens": self.n_tokens,
            "prepend_bos": self.prepend_bos, "bos": self.bos, "attention": self.attention, "sink_position": p,
            "seconds": self.seconds, "settings": self.settings, "headline": self.headline(),
            "sinks": self.sinks.to_dict(), "variance": self.variance.to_dict(position=p),
            "massive_activations": self.massive.to_dict(),
            "super_neurons": section(self.neurons, "super_neurons"),
            "super_neurons_from_weights": section(self.weight_neurons, "super_neurons"),
            "causal_check": self.causal.to_dict() if self.causal is not None else None,
            "skipped": self.skipped,
            "normalized_disparity": section(self.normalized, "normalized_disparity",
                                            dims=self.massive_dims() or None),
            "query_key_locking": section(self.locking, "query_key_locking"),
            "value_drain": section(self.value_drain, "value_drain"),
        })


@with_cached_weights  # the analyzers of one pass stack each weight once
def analyze(model: Any, inputs: Inputs | None = None, *, sink_position: int = 0,
            sink_threshold: float = SinkSettings.sink_threshold,
            abs_threshold: float | None = MassiveSettings.abs_threshold,
            rel_threshold: float | None = MassiveSettings.rel_threshold,
            model_name: str | None = None, verify: bool = False,
            options: RunOptions = RunOptions()) -> SinkReport:
    """Run every sink analyzer on ``model`` in one streaming pass and return a :class:`SinkReport`.
    ``sink_threshold``: Gu et al.'s sink-rate ``ε``; ``abs_threshold`` / ``rel_threshold``: massive-activation
    thresholds (Sun et al.: |x| > 100 and > 1000x the median |x|; for small models e.g. ``None`` and 50);
    ``verify``: also run the causal check (:func:`sinklens.analysis.verify.verify_attribution`).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> report = analyze(tiny_model(), ["t5 t6 t7 t8 t9 t10", "t3 t4 t5 t6"],
        ...                  abs_threshold=None, rel_threshold=3.0, options=RunOptions(progress=False))
        >>> report.n_sequences, report.sinks.received.shape[:2]
        (2, torch.Size([2, 4]))
    """
    start = time.perf_counter()
    options = checked_options(options, "analyze")
    sink_settings = SinkSettings(sink_threshold, method=method_for_hooks("auto", options.extra_hooks))
    massive_settings = MassiveSettings(abs_threshold=abs_threshold, rel_threshold=rel_threshold, sink_position=sink_position)
    batches = batches_for(model, inputs, options)
    require_a_later_position(batches, what="analyze", sink_position=massive_settings.sink_position,
                             bidirectional=is_encoder(model))
    moe = neuron_reason(model)  # a mixture-of-experts or post-LN model: no additive neuron writes
    reasons = {"super_neurons": moe, "query_key_locking": qk_locking_reason(model),
               "normalized_disparity": input_norm_reason(model, "attn"),  # no normalization
               "mlp_input_alignment": None if moe is not None else input_norm_reason(model, "mlp"),
               "value_drain": value_drain_reason(model)}
    skipped = {section: f"skipped: {why}" for section, why in reasons.items() if why is not None}
    method, at = sink_settings.method, {"sink_position": sink_position}
    optional = {  # section -> its reducer, None when skipped
        "neurons": None if "super_neurons" in skipped else SuperNeuronReducer(model, **at),
        "sink_input": None if skipped.keys() & {"super_neurons", "mlp_input_alignment"}
        else SinkInputReducer(model, **at),
        "normalized": None if "normalized_disparity" in skipped else NormalizedDisparityReducer(model, **at),
        "locking": None if "query_key_locking" in skipped else QKLockingReducer(model, method=method, **at),
        "value_drain": None if "value_drain" in skipped else ValueDrainReducer(
            model, settings=ValueDrainSettings(sink_position, method=method)),
    }
    present = {name: r for name, r in optional.items() if r is not None}
    sink_reducer = SinkReducer(model, settings=sink_settings)
    reducers = [sink_reducer, VarianceReducer(model, method=method),
                MassiveActivationsReducer(model, settings=massive_settings), *present.values()]
    desc = "sinklens analyze" if options.desc == RunOptions.desc else options.desc
    results = stream(model, batches, reducers, options=options.replace(desc=desc))
    sinks, variance, massive = results[:3]
    got = dict.fromkeys(optional) | dict(zip(present, results[3:]))
    neurons, weight_neurons, causal = got["neurons"], None, None
    if neurons is not None:
        add_total_effects(model, batches, neurons, options=options)
        weight_neurons = super_neurons_from_weights(model, dims=neurons.dims or None, sink_input=got["sink_input"])
        if verify:
            causal = verify_attribution(model, batches, neurons, options=options)
    elif verify:
        skipped["causal_check"] = f"skipped: {moe}"
    return SinkReport(
        model_name=model_name or type(model).__name__,
        n_sequences=int(sum(b.tokens.shape[0] for b in batches)),
        n_tokens=sum(sum(b.host_lengths()) for b in batches),
        prepend_bos=bool(batches[0].prepend_bos), sink_position=sink_position, sinks=sinks,
        variance=variance, massive=massive, neurons=neurons,
        weight_neurons=weight_neurons, normalized=got["normalized"], locking=got["locking"],
        value_drain=got["value_drain"], bos=describe_bos(model, batches[0]),
        attention="attention read from hook_pattern (extra hooks edit the attention scores or pattern)"
        if method == "pattern" else sink_reducer.plan.describe(sinks.attention_path),
        seconds=time.perf_counter() - start,
        settings={"batch_size": options.batch_size, "max_length": options.max_length,
                  "sink_threshold": sink_settings.sink_threshold, "abs_threshold": abs_threshold,
                  "rel_threshold": rel_threshold, "verify": verify,
                  "dtype": str(model_dtype(model)).removeprefix("torch."), "device": str(model_device(model))},
        causal=causal, skipped=skipped,
    )


def neuron_lines(report: SinkReport) -> list[str]:
    """Dimension paths, super neurons and the causal check (contributions in residual units)."""
    sn, why = report.neurons, report.skipped
    if sn is None:  # then so is the causal check: say why
        return [f"  super neurons and dimension paths {why.get('super_neurons', 'skipped')}",
                *(["", f"Causal check {why['causal_check']}"] if "causal_check" in why else [])]
    lines = [f"  attributed: dims {sn.dims}" + ("" if sn.n_massive is None else
             f", the {len(sn.dims)} largest of {sn.n_massive} dims whose |x| at the sink exceeds {sn.dim_threshold:g}x "
             f"the median |x| at some stream (max_dims={sn.max_dims})")]
    for path in sn.paths:
        first = path.first_massive_stream
        massive = ("never massive" if first is None else f"first massive at stream {first} (" +
                   ("the embedding)" if first == 0 else f"the output of block {first - 1})"))
        erased = f"erased most in block {path.erase_layer}" if path.erase_layer is not None else "never erased"
        lines.append(f"  dim {path.dim}: peak {path.peak_value:+.1f} at stream {path.peak_layer}, {massive}; largest step in "
                     f"block {path.write_layer} (attention share {path.attn_share:.2f}); {erased}")
        if path.total_effect:
            lines.append(f"    total effect (act x d dim/d act at the sink, through later blocks): {_top3(path.total_effect)}")
        lines.append(f"    direct (act x W_out): {_top3(path.top_neurons)}")
        for kind, steps in (("writers", path.writers), ("erasers", path.erasers)):
            if steps:
                lines.append(f"    {kind} (>= {100 * sn.path_share:.0f}% of the peak): " + "; ".join(
                    f"block {s.block} {s.delta:+.1f} (attn {s.attn:+.1f}, mlp {s.mlp:+.1f})"
                    + (f" L{s.top_neurons[0][0]}N{s.top_neurons[0][1]} {s.top_neurons[0][2]:+.1f}" if s.top_neurons else "")
                    + (f" L{s.block}H{s.top_heads[0][0]} {s.top_heads[0][1]:+.1f}" if s.top_heads and abs(s.attn) > abs(s.mlp) else "")
                    for s in steps))
    for kind, towards in (("writers", "towards"), ("erasers", "against")):
        supers = sn.super_neurons(kind)
        lines += ["", f"Super {kind} (contribution {towards} a massive dim's peak sign, |contribution| >= "
                      f"{100 * sn.super_share:.0f}% of the peak, residual units after any post-MLP norm): {len(supers)}"]
        for layer, neuron in supers[:8]:
            row = sn.neuron_row(layer, neuron)
            contrib = ", ".join(f"dim {d} {row[f'contribution_{d}']:+.1f}" for d in sn.dims)
            lines.append(f"  {neuron_name(layer, neuron)}: {contrib}; act at sink {row['sink_act']:+.2f} "
                         f"({times_elsewhere(row['position_ratio'])}), W_out kurtosis {row['row_kurtosis']:.0f}, "
                         f"top-{sn.row_top_k} mass {row['row_top_share']:.2f}")
    if report.causal is not None:
        lines += ["", "Causal check (zero at the sink what each massive dim is credited to):"]
        lines += report.causal.lines() or ["  no massive dimension to check"]
    return lines


def _top3(rows: Sequence[tuple[int, int, float]]) -> str:
    return ", ".join(f"L{l}N{n} ({c:+.1f})" for l, n, c in rows[:3])


def disparity_lines(report: SinkReport, dims: Sequence[int]) -> list[str]:
    """Normalised disparity of the first two massive dims, before and after the norm's gain."""
    if (nd := report.normalized) is None:  # a model without normalization: say why the section is missing
        return ["", f"Normalised disparity {report.skipped.get('normalized_disparity', 'skipped')}"]
    if not dims:
        return []
    lines = ["", "Normalised disparity mean |x_d| / mean(mean_{j!=d} |x_j|) over the sink tokens vs other tokens "
                 "(layer where the sink's ratio before the gain peaks):"]
    for d in list(dims)[:2]:
        i = int(nd.ratio_sink[:, d].argmax())
        lines.append(
            f"  dim {d}, layer {nd.layers[i]}: before gain {float(nd.ratio_sink[i, d]):.1f} vs {float(nd.ratio_other[i, d]):.2f} "
            f"(sinklens: {nd.norms[i]}.hook_normalized); after gain {float(nd.ratio_sink_after_gain[i, d]):.1f} vs "
            f"{float(nd.ratio_other_after_gain[i, d]):.2f} (the paper's: input layernorm output)")
    return lines


def layer_rows(report: SinkReport) -> list[list[str]]:
    """One row of formatted numbers per analysed layer (the summary's table)."""
    p = report.sink_position
    rate = report.sinks.sink_rate_by_layer(position=p)
    attn = torch.nanmean(report.sinks.received[:, :, p], dim=1)
    disc_z = report.variance.discrepancy(p).nanmedian(dim=1).values
    disc_r = report.variance.discrepancy(p, of="result").nanmedian(dim=1).values
    m, rows = report.massive, []
    for i, layer in enumerate(report.sinks.layers):
        r = m.streams.index(layer) if layer in m.streams else None
        norm, max_x = (math.nan, math.nan) if r is None else (float(m.norm_ratio[r, p]), float(m.max_abs_sink[r].max()))
        rows.append([str(layer), f"{float(rate[i]):.2f}", f"{float(attn[i]):.3f}", f"{float(disc_z[i]):.2f}",
                     f"{float(disc_r[i]):.2f}", f"{norm:.1f}", f"{max_x:.1f}"])
    return rows


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])
