"""Super neurons from weights (sinklens.analysis.weight_super_neurons)."""

import json

import pytest

from sinklens.analysis.weight_super_neurons import sink_inputs, super_neurons_from_weights
from sinklens.testing import QUIET
from support.checks import PLANTED_PROMPTS

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


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "neox"])
def test_layer_weight_is_the_stacked_slice(family):
    """``layer_weight`` (one block's weight, no stack) equals the stacked property's slice for every weight."""
    import torch

    from sinklens.hooks import layer_weight, weight
    from support.zoo import zoo_model

    model = zoo_model(family)
    for name in ("W_in", "W_gate", "W_out", "W_Q", "W_K", "W_V", "W_O"):
        try:
            stacked = weight(model, name)
        except AttributeError:
            continue
        for layer in range(model.cfg.n_layers):
            torch.testing.assert_close(layer_weight(model, name, layer), stacked[layer], rtol=0, atol=0)


def test_weight_statistics_cache_sees_in_place_edits():
    """Weight-only statistics are cached per model; an in-place weight edit must invalidate them."""
    import torch

    from sinklens.testing import tiny_model

    tiny_llama = tiny_model("llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=64, d_vocab=64)

    from sinklens.analysis.neurons import row_sparsity
    from sinklens.analysis.post_attention import attention_output_grams
    from sinklens.hooks import weight

    def fresh():  # independent of the cache: from the stacked properties
        w_out, w_in, w_o = (weight(tiny_llama, n).detach().float() for n in ("W_out", "W_in", "W_O"))
        kurt, share = row_sparsity(w_out)
        return kurt, share, w_out.norm(dim=-1), w_in.norm(dim=1), (w_o.double() @ w_o.double().transpose(-1, -2))

    first = super_neurons_from_weights(tiny_llama)
    gram, _ = attention_output_grams(tiny_llama, list(range(tiny_llama.cfg.n_layers)))
    with torch.no_grad():  # in place, through the block's own parameter views
        tiny_llama.blocks[0].mlp.W_out[3].mul_(0.0).add_(torch.arange(tiny_llama.cfg.d_model, dtype=torch.float32))
        tiny_llama.blocks[1].mlp.W_in[:, 5].mul_(4.0)
        tiny_llama.blocks[0].attn.W_O.mul_(2.0)  # a view of the o_proj weight on a bridge
    later = super_neurons_from_weights(tiny_llama)
    kurt, share, out_norm, in_norm, gram_fresh = fresh()
    assert not torch.allclose(first.out_kurtosis[0, 3], kurt[0, 3])  # the edit moved it
    torch.testing.assert_close(later.out_kurtosis, kurt)
    torch.testing.assert_close(later.out_top_share, share)
    torch.testing.assert_close(later.out_norm, out_norm)
    torch.testing.assert_close(later.in_norm, in_norm)
    assert float(later.in_norm[1, 5]) == pytest.approx(4 * float(first.in_norm[1, 5]), rel=1e-5)
    gram_later, _ = attention_output_grams(tiny_llama, list(range(tiny_llama.cfg.n_layers)))
    torch.testing.assert_close(gram_later, gram_fresh)
