"""Learned sink logits (gpt-oss "sinks"): the attention mass a head gives to no key is its virtual sink."""

import pytest
import torch
from _hf_reference import hf_attentions, real_sequences

from sinklens.analysis.sinks import find_sinks
from sinklens.inputs import as_batches
from sinklens.testing import QUIET, transformer_lens_major
from support.zoo import zoo_hf_model, zoo_model

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(transformer_lens_major() < 4, reason="gpt-oss is a TransformerLens 4 zoo family"),
]

PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t14 t15 t16", "t17 t18 t19 t20 t21 t22 t23 t24 t25 t26 t27"]


def test_virtual_sink_equals_hf_row_shortfall():
    model = zoo_model("gptoss")
    hf = zoo_hf_model("gptoss")
    short = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    n = 0
    for ids in real_sequences(as_batches(model, PROMPTS)):
        for layer, att in enumerate(hf_attentions(hf, ids)):
            short[layer] += (1.0 - att.sum(dim=-1)).sum(dim=-1)  # [head], summed over queries
        n += ids.numel()
    ref = short / n
    got = find_sinks(model, PROMPTS, options=QUIET.replace(batch_size=2))
    assert got.virtual_sink is not None
    assert float(ref.min()) > 0.01  # the sink logits really take mass
    torch.testing.assert_close(got.virtual_sink.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got.to_dict()["virtual_sink"], dtype=torch.float64), ref, rtol=1e-5, atol=1e-6)


def test_virtual_sink_follows_the_sinks_parameter():
    """A huge sink logit takes (almost) all the mass; absent sink logits give None."""
    model = zoo_model("gptoss")
    layer0 = [p for name, p in model.original_model.named_parameters() if name.startswith("model.layers.0.") and name.endswith(".sinks")]
    assert len(layer0) == 1
    with torch.no_grad():
        layer0[0].fill_(30.0)
    got = find_sinks(model, PROMPTS, options=QUIET)
    torch.testing.assert_close(got.virtual_sink[0], torch.ones(model.cfg.n_heads), rtol=0, atol=1e-6)
    assert float(got.virtual_sink[1].max()) < 0.99
    assert find_sinks(zoo_model("llama"), PROMPTS, options=QUIET).virtual_sink is None
