"""The text layout of a :class:`~sinklens.analysis.report.SinkReport`: a summary a reader can scan.

Pure functions of the report's public fields; nothing here computes a new number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sinklens.hooks import Z

if TYPE_CHECKING:
    from sinklens.analysis.report import SinkReport


def format_summary(report: SinkReport, *, timing: bool = True) -> str:
    """A readable text report: top sinks, sink rate and variance by layer, massive dimensions, super neurons.

    ``timing=False`` leaves out the wall time, so the text is reproducible (tutorials, tests).
    """
    p = report.sink_position
    h = report.headline()
    lines = [
        f"sinklens report — {report.model_name}",
        f"{report.n_sequences} sequences, {report.n_tokens} tokens, {report.sinks.describe_start()}"
        + (f"; analysed in {report.seconds:.1f} s" if timing else ""),
        "",
        "Sink positions: " + (", ".join(f"{k} ({report.sinks.token_at(k)!r})" if report.sinks.token_at(k) is not None
                                         else f"{k} (token varies)" for k in h["sink_positions"]) or "none"),
        f"Sink rate at position {p} (sink_threshold={report.sinks.sink_threshold}): {h['sink_rate']:.3f} (Gu et al.'s code: "
        f"every query that sees the key, its own included), {report.sinks.sink_rate(position=p, method='sinklens'):.3f} "
        f"(sinklens: queries from min_query={report.sinks.min_query})   mean attention received: {h['mean_attention_to_sink']:.3f}",
    ]
    if report.sinks.virtual_sink is not None:
        vs = report.sinks.virtual_sink
        lines.append(f"Virtual sink (learned sink logits; mass given to no key, mean over real queries): "
                     f"mean {float(vs.mean()):.3f}, max {float(vs.max()):.3f} over heads")
    top = report.sinks.top_sinks(5)
    if top:
        lines.append("Top sink tokens at later positions: " + ", ".join(
            f"{r['token']!r} ({r['mean_received']:.3f})" if r.get("token") is not None else f"id {r['token_id']}"
            for r in top))
    lines += ["", table(
        ["layer", "Gu sink rate", "attn to sink", "var ratio z", "var ratio zW_O", "norm ratio", "max |x| sink"],
        layer_rows(report),
    )]
    lines.append(variance_sources_line(report))
    dims = h["massive_dims"]
    rule = " and ".join(
        ([f"|x| > {report.massive.abs_threshold:g}"] if report.massive.abs_threshold is not None else [])
        + ([f"|x| > {report.massive.rel_threshold:g}x the median |x|"] if report.massive.rel_threshold is not None else [])
    )
    lines += ["", f"Massive dimensions at position {p}: {dims or 'none'} ({rule})"]
    lines += neuron_lines(report)
    lines += disparity_lines(report, dims)
    if report.value_drain is not None:
        lines += ["", value_drain_line(report)]
    elif "value_drain" in report.skipped:
        lines += ["", f"Value drain {report.skipped['value_drain']}"]
    lock = report.locking
    lines += [
        "",
        f"Query-key locking (head median): share of positive scores against the sink "
        f"{float(lock.pos_share_sink.nanmedian()):.2f} vs other keys {float(lock.pos_share_other.nanmedian()):.2f}; "
        f"sink key in the top query directions: cosine {float(lock.key_pc_cosine.nanmedian()):.2f}"
        if lock is not None else f"Query-key locking {report.skipped.get('query_key_locking', 'skipped')}",
    ]
    return "\n".join(lines)


def neuron_lines(report: SinkReport) -> list[str]:
    """Dimension paths, super neurons and the causal check (contributions in residual units)."""
    if report.neurons is None:
        lines = [f"  super neurons and dimension paths {report.skipped.get('super_neurons', 'skipped')}"]
        if "causal_check" in report.skipped:  # --verify was asked for: say why it did not run
            lines += ["", f"Causal check {report.skipped['causal_check']}"]
        return lines
    lines = []
    for path in report.neurons.paths:
        neurons = ", ".join(f"L{l}N{n} ({c:+.1f})" for l, n, c in path.top_neurons[:3])
        erased = f"erased in block {path.erase_layer}" if path.erase_layer is not None else "never erased"
        lines.append(
            f"  dim {path.dim}: peak {path.peak_value:+.1f} at stream {path.peak_layer}, written in block "
            f"{path.write_layer} (attention share {path.attn_share:.2f}), {erased}; top neurons: {neurons}"
        )
        share = report.neurons.path_share
        for kind, steps in (("writers", path.writers), ("erasers", path.erasers)):
            if steps:
                lines.append(f"    {kind} (>= {100 * share:.0f}% of the peak): " + "; ".join(
                    f"block {s.block} {s.delta:+.1f} (attn {s.attn:+.1f}, mlp {s.mlp:+.1f})"
                    + (f" L{s.top_neurons[0][0]}N{s.top_neurons[0][1]} {s.top_neurons[0][2]:+.1f}" if s.top_neurons else "")
                    + (f" L{s.block}H{s.top_heads[0][0]} {s.top_heads[0][1]:+.1f}" if s.top_heads and abs(s.attn) > abs(s.mlp) else "")
                    for s in steps))
    supers = report.neurons.super_neurons()
    units = "residual units, after any post-MLP norm"
    lines += ["", f"Super neurons (|contribution| >= {100 * report.neurons.super_share:.0f}% of a massive dim's peak, "
                  f"{units}): {len(supers)}"]
    for layer, neuron in supers[:8]:
        row = report.neurons.neuron_row(layer, neuron)
        contrib = ", ".join(f"dim {d} {row[f'contribution_{d}']:+.1f}" for d in report.neurons.dims)
        lines.append(
            f"  L{layer} N{neuron}: {contrib}; act at sink {row['sink_act']:+.2f} ({row['position_ratio']:.0f}x its RMS "
            f"elsewhere), W_out kurtosis {row['row_kurtosis']:.0f}, top-{report.neurons.row_top_k} mass {row['row_top_share']:.2f}"
        )
    if report.causal is not None:
        lines += ["", "Causal check (zero each massive dim's top writers at the sink):"]
        lines += report.causal.lines() or ["  no massive dimension to check"]
    elif "causal_check" in report.skipped:
        lines += ["", f"Causal check {report.skipped['causal_check']}"]
    return lines


def disparity_lines(report: SinkReport, dims: Sequence[int]) -> list[str]:
    """Normalised disparity of the first massive dims, before and after the input layernorm's gain, each labelled."""
    nd = report.normalized
    if nd is None:  # a model without normalization: say why the section is missing
        return ["", f"Normalised disparity {report.skipped.get('normalized_disparity', 'skipped')}"]
    if not dims or nd.ratio_sink_after_gain is None:
        return []
    lines = ["", "Normalised disparity mean |x_d| / mean(mean_{j!=d} |x_j|) over the sink tokens vs other tokens "
                 "(layer where the sink's ratio before the gain peaks):"]
    for d in list(dims)[:2]:
        i = int(nd.ratio_sink[:, d].argmax())
        norm = nd.norms[i] if nd.norms else f"blocks.{nd.layers[i]}.ln1"
        lines.append(
            f"  dim {d}, layer {nd.layers[i]}: before gain {float(nd.ratio_sink[i, d]):.1f} vs {float(nd.ratio_other[i, d]):.2f} "
            f"(sinklens: {norm}.hook_normalized); after gain {float(nd.ratio_sink_after_gain[i, d]):.1f} vs "
            f"{float(nd.ratio_other_after_gain[i, d]):.2f} (the paper's: input layernorm output)")
    return lines


def variance_sources_line(report: SinkReport) -> str:
    """One line under the table: what "var ratio" means (sinklens' across-sequence definition) and Li et al.'s
    per-position feature-std ratio of the o_proj input beside it, by layer."""
    p = report.sink_position
    var = report.variance
    site = "" if var.output_site == Z else f", z for zW_O read at {var.output_site} (what W_O reads in this model)"
    head = (f"var ratio z / zW_O (sinklens): variance over sequences around the all-position mean, position {p} "
            f"over the rest; zW_O in residual units (through any post-attention norm){site}")
    if var.feature_std is None:
        return head
    ratio = var.discrepancy(p, of="feature_std")
    return (head + f"\nfeature std ratio (Li et al.'s code: std over the o_proj input's features per token, mean "
            f"over sequences), position {p} / rest, by layer: " + " ".join(f"{float(r):.2f}" for r in ratio))


def value_drain_line(report: SinkReport) -> str:
    """One line: how many sink heads are no-op / broadcast / partial, with the thresholds that made them."""
    drain = report.value_drain
    counts = drain.counts()
    n_sink = counts["no-op"] + counts["broadcast"] + counts["partial"]
    return (
        f"Value drain at position {drain.sink_position}: {n_sink} sink heads (attention to it >= "
        f"{drain.sink_head_threshold:g}): {counts['no-op']} no-op (sink's write share < {drain.no_op_share:g}), "
        f"{counts['broadcast']} broadcast (>= {drain.broadcast_share:g}), {counts['partial']} partial; "
        "writes in residual units" + (f" through the post-attention norm in layers {drain.post_norm_layers}"
                                      if drain.post_norm_layers else "")
    )


def layer_rows(report: SinkReport) -> list[list[str]]:
    """One row of formatted numbers per analysed layer (the summary's table)."""
    p = report.sink_position
    rate = report.sinks.sink_rate_by_layer(position=p)
    attn = torch.nanmean(report.sinks.received[:, :, p], dim=1)
    disc_z = report.variance.discrepancy(p).nanmedian(dim=1).values
    disc_r = report.variance.discrepancy(p, of="result").nanmedian(dim=1).values
    rows = []
    for i, layer in enumerate(report.sinks.layers):
        stream_row = report.massive.streams.index(layer) if layer in report.massive.streams else None
        norm = float(report.massive.norm_ratio[stream_row, p]) if stream_row is not None else float("nan")
        max_x = float(report.massive.max_abs_sink[stream_row].max()) if stream_row is not None else float("nan")
        rows.append([str(layer), f"{float(rate[i]):.2f}", f"{float(attn[i]):.3f}", f"{float(disc_z[i]):.2f}",
                     f"{float(disc_r[i]):.2f}", f"{norm:.1f}", f"{max_x:.1f}"])
    return rows


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])
