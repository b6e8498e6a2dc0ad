"""Every public figure function refuses a result of the wrong kind by name, and checks its indices."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import matplotlib
import pytest

import sinklens.plotting
from sinklens.errors import InvalidArgumentError

matplotlib.use("Agg")


def _result_plots():
    """(name, function, expected class) of every ``plot_*`` whose first parameter is ``result``."""
    found = []
    for info in pkgutil.iter_modules(sinklens.plotting.__path__):
        module = importlib.import_module(f"sinklens.plotting.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("plot_") and fn.__module__ == module.__name__:
                first = next(iter(inspect.signature(fn).parameters.values()))
                if first.name == "result":
                    found.append((name, inspect.unwrap(fn), inspect.get_annotations(fn, eval_str=True)["result"]))
    return found


RESULT_PLOTS = _result_plots()


def test_every_result_plot_is_found():
    assert len(RESULT_PLOTS) >= 17, [name for name, _, _ in RESULT_PLOTS]
    assert all(isinstance(kind, type) for _, _, kind in RESULT_PLOTS)


@pytest.mark.parametrize("name, plot, kind", RESULT_PLOTS, ids=[name for name, _, _ in RESULT_PLOTS])
def test_a_result_of_another_kind_is_refused_by_name(name, plot, kind):
    wrong = object.__new__(next(k for _, _, k in RESULT_PLOTS if k is not kind))
    with pytest.raises(TypeError, match=rf"^{name} needs a {kind.__name__}, got a {type(wrong).__name__}\.$"):
        plot(wrong)


def test_rank_probability_needs_a_labelled_mapping():
    from sinklens.origins.preference import token_preference
    from sinklens.plotting.origins import plot_rank_probability
    from sinklens.testing import tiny_model

    pref = token_preference(tiny_model(), n_sequences=4, seq_len=4)
    with pytest.raises(TypeError, match=r"needs \{label: TokenPreference\}, got TokenPreference"):
        inspect.unwrap(plot_rank_probability)(pref)
    assert len(plot_rank_probability({"tiny": pref}).axes[0].get_lines()) == 2  # the model and uniform 1/V


def test_indices_of_the_neuron_and_dimension_figures_are_checked():
    from sinklens import find_massive_activations, find_super_neurons
    from sinklens.options import RunOptions
    from sinklens.plotting.neurons import plot_dim_path
    from sinklens.testing.planted import planted_model

    model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
    quiet = RunOptions(progress=False)
    neurons = find_super_neurons(model, "t3 t4 t5 t6", options=quiet)
    massive = find_massive_activations(model, "t3 t4 t5 t6", options=quiet)
    d_model = model.cfg.d_model
    with pytest.raises(InvalidArgumentError, match=rf"dim must be a residual dimension in 0\.\.{d_model - 1}, got {d_model}"):
        plot_dim_path(neurons, dim=d_model)
    line = plot_dim_path(neurons, dim=3).axes[0].get_lines()[0]  # any residual dimension may be drawn
    assert list(line.get_ydata()) == pytest.approx(neurons.resid_sink[:, 3].tolist())
    with pytest.raises(InvalidArgumentError, match=r"k must be an integer >= 1, got 0"):
        massive.top_dims(massive.streams[-1], 0)
    with pytest.raises(InvalidArgumentError, match=r"k must be an integer >= 1, got -2"):
        neurons.top(5, -2)


def test_layer_rows_are_labelled_with_the_analysed_layers():
    """``plot_sink_rate`` on ``layers=[1, 3]`` labelled its heatmap rows -0.5 ... 1.5 (row numbers), not 1 and 3."""
    import matplotlib.pyplot as plt

    from sinklens import RunOptions, find_sinks, measure_value_drain
    from sinklens.inputs import random_token_batches
    from sinklens.plotting.sinks import plot_sink_heatmap, plot_sink_rate
    from sinklens.plotting.value_drain import plot_value_drain
    from sinklens.testing import tiny_model

    model = tiny_model(n_layers=4)
    inputs = random_token_batches(model, n_sequences=4, seq_len=10, prepend_bos=True, seed=0)
    sinks = find_sinks(model, inputs, layers=[1, 3], options=RunOptions(progress=False))
    for fig, ax in ((plot_sink_rate(sinks), 0), (plot_sink_heatmap(sinks), 0),
                    (plot_value_drain(measure_value_drain(model, inputs, layers=[1, 3], options=RunOptions(progress=False))), 1)):
        rows = fig.axes[ax]
        assert list(rows.get_yticks()) == [0, 1] and [t.get_text() for t in rows.get_yticklabels()] == ["1", "3"]
        plt.close(fig)
    fig = plot_sink_rate(sinks)
    assert list(fig.axes[1].get_yticks()) == [1, 3]  # the by-layer bars stand at the layers themselves
    plt.close(fig)


def test_positional_over_training_titles_the_position_it_plots():
    """After a prepended BOS the curves are position 1's (``first_counted``); the title said position 0."""
    import matplotlib.pyplot as plt

    from sinklens.origins import PositionalTrajectory, positional_discrepancy
    from sinklens.plotting.training import plot_positional_over_training
    from sinklens.testing import tiny_model

    results = [positional_discrepancy(tiny_model(seed=s), n_sequences=8, seq_len=8, prepend_bos=True) for s in (0, 1)]
    fig = plot_positional_over_training({"run": PositionalTrajectory(steps=[0, 10], results=results)})
    assert fig.axes[0].get_title() == "run: attn_out_var at position 1 / later half"
    plotted = list(fig.axes[0].get_lines()[0].get_ydata())
    assert plotted == [float(r.relative("attn_out_var")[0, 1]) for r in results]
    plt.close(fig)
