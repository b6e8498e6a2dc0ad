"""Super neurons from weights (sinklens.analysis.weight_super_neurons)."""

import json

import pytest

from sinklens.analysis.weight_super_neurons import sink_inputs, super_neurons_from_weights
from sinklens.testing import PLANTED_PROMPTS, QUIET

pytestmark = pytest.mark.models

PROMPTS = PLANTED_PROMPTS


def test_weight_only_link_finds_planted_neuron(planted_mechanisms):
    model, spec = planted_mechanisms
    weights = super_neurons_from_weights(model, dims=[spec.dim])
    assert weights.top(1)[0][:2] == (spec.layer, spec.neuron)
    assert weights.align_in is None
    row = weights.neuron_row(spec.layer, spec.neuron)
    assert row["out_top_share"] == pytest.approx(1.0) and row["out_weight_5"] > 0
    # With one forward: the sink's normalised MLP input points along the planted read vector.
    linked = super_neurons_from_weights(model, dims=[spec.dim], sink_input=sink_inputs(model, PROMPTS[:2], options=QUIET))
    r = linked.layers.index(spec.layer)
    assert linked.align_in[r, spec.neuron] > 0.7
    assert linked.align_in[r].abs().argmax() == spec.neuron
    if linked.align_gate is not None:
        assert linked.align_gate[r, spec.neuron] > 0.7
    assert linked.align_in.abs().max() <= 1 + 1e-5
    json.dumps(linked.to_dict(k=3), allow_nan=False)


def test_weight_only_bad_dims(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        super_neurons_from_weights(tiny_llama, dims=[99])


def test_bad_sink_input_layers(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        sink_inputs(tiny_llama, ["t3 t4 t5"], layers=[2], options=QUIET)
