"""Writing a :class:`~sinklens.analysis.report.SinkReport` to a folder: ``report.json``, ``summary.txt``, figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sinklens.analysis.report import SinkReport
from sinklens.export import staged_outputs, write_json, write_text_atomic
from sinklens.plotting import disparity, neurons, sinks, value_drain, variance
from sinklens.plotting.style import save_figure
from sinklens.validate import writable_dir


#: Every figure a report may have and what it shows (``{p}``: sink position, ``{n}``: sequences).
FIGURE_FILES = {
    "attention_to_sink.png": "mean attention each layer x head gives position {p}, over queries and {n} sequences "
                             "(dots: above sink_threshold)",
    "sink_rate.png": "Gu et al.'s sink rate for position {p}: share of the {n} sequences in which each head's attention "
                     "to it exceeds sink_threshold (left), and its mean over the layer's heads (right)",
    "attention_by_position.png": "mean attention received by each key position, one line per layer (log y); a later "
                                 "position averages only the sequences that reach it",
    "variance_by_position.png": "variance of z over the {n} sequences at each position (log-log), with the attention "
                                "pattern's prediction and the uniform 1/(t+1) law",
    "variance_discrepancy.png": "per layer x head, variance over sequences at position {p} / the other positions' "
                                "(red > 1: position {p} varies more; blue < 1: less), for z and z·W_O",
    "massive_activations.png": "largest |activation| entering each block at position {p} and at every other position, "
                               "over the {n} sequences (log y)",
    "super_neurons.png": "the neurons writing most into the first massive dimension at position {p}, in residual units "
                         "(red: super neurons)",
    "massive_dim_path.png": "the first massive dimension at position {p} along the residual stream, with each block's "
                            "attention and MLP write",
    "w_out_sparsity.png": "every MLP neuron's W_out row: kurtosis against the share of its mass in the top dimensions "
                          "(red: super neurons)",
    "value_drain.png": "per head, attention to position {p} against the share of the head's write that comes from it, "
                       "by class",
}


def save_report(report: SinkReport, out_dir: str | Path, *, figures: bool = True) -> list[Path]:
    """Write ``report.json``, ``summary.txt`` and (unless ``figures=False``) PNG figures with ``index.md``; return the
    paths. All are staged and renamed in at the end: an error leaves an earlier report as it was, and an earlier
    report's figures this one does not draw are removed."""
    out = writable_dir(out_dir, what="out_dir")
    data = report.to_dict()  # computed before anything is written
    text = report.summary() + "\n"
    with staged_outputs(out, marker="report.json", owned=(*FIGURE_FILES, "index.md")) as stage:
        staged = [write_json(stage / "report.json", data, digits=None, indent=1), write_text_atomic(stage / "summary.txt", text)]
        if figures:
            staged += [save_figure(draw(), stage / name) for name, draw in figure_makers(report).items()]
            staged.append(write_text_atomic(stage / "index.md", index_text(report, [path.name for path in staged])))
    return [out / path.name for path in staged]


def index_text(report: SinkReport, names: list[str]) -> str:
    """The report folder's ``index.md``: the model and inputs, then one line per file in ``names``."""
    what = {"report.json": "every number of the report (strict JSON)", "summary.txt": "the text report `sinklens analyze` "
            "printed", **{name: text.format(p=report.sink_position, n=report.n_sequences) for name, text in FIGURE_FILES.items()}}
    return "\n".join([f"# sinklens report: {report.model_name}", "",
                      f"{report.n_sequences} sequences, {report.n_tokens} tokens; sink position {report.sink_position}.",
                      "", *(f"- `{name}`: {what[name]}." for name in names)]) + "\n"


def figure_makers(report: SinkReport) -> dict[str, Callable[[], Any]]:
    """File name -> function drawing that figure of the report (a matplotlib Figure)."""
    p = report.sink_position
    makers: dict[str, Callable[[], Any]] = {
        "attention_to_sink.png": lambda: sinks.plot_sink_heatmap(report.sinks, position=p),
        "sink_rate.png": lambda: sinks.plot_sink_rate(report.sinks, position=p),
        "attention_by_position.png": lambda: sinks.plot_received_by_position(report.sinks),
        "variance_by_position.png": lambda: variance.plot_variance_by_position(report.variance),
        "variance_discrepancy.png": lambda: variance.plot_discrepancy(report.variance, position=p),
        "massive_activations.png": lambda: disparity.plot_massive_by_layer(report.massive),
    }
    if report.neurons is not None and report.neurons.dims:
        makers["super_neurons.png"] = lambda: neurons.plot_contributions(report.neurons)
        makers["massive_dim_path.png"] = lambda: neurons.plot_dim_path(report.neurons)
    if report.neurons is not None:
        makers["w_out_sparsity.png"] = lambda: neurons.plot_row_sparsity(report.neurons)
    if report.value_drain is not None:
        makers["value_drain.png"] = lambda: value_drain.plot_value_drain(report.value_drain)
    return makers
