"""Received attention averages over exactly the queries that can see each key (sliding windows, encoders).

Reference: the plain Hugging Face model (``output_attentions=True``), one unpadded sequence at a time, with the
visible queries written out by hand from the HF config (:mod:`_hf_reference`).
"""

import pytest
import torch
from _hf_reference import hf_attentions, real_sequences, visible_by_hand

from sinklens.analysis.qk_locking import QKLockingReducer
from sinklens.analysis.sinks import find_sinks
from sinklens.inputs import as_batches, is_encoder
from sinklens.loading import load_model
from sinklens.streaming import stream
from sinklens.testing import QUIET, transformer_lens_major
from support.zoo import zoo_dir, zoo_hf_model, zoo_model
from sinklens.visibility import attention_visibility

pytestmark = pytest.mark.models
tl4_only = pytest.mark.skipif(transformer_lens_major() < 4, reason="zoo_model is HF-weighted only on TransformerLens 4")

# Longer than the zoo's window of 4 tokens, of different lengths (so batches are padded).
PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t14 t15 t16", "t17 t18 t19 t20 t21 t22 t23 t24 t25 t26 t27",
           "t28 t29 t30 t31 t32 t33"]


def _reference_received(family: str, model, min_query: int):
    hf = zoo_hf_model(family)
    encoder = family == "bert"
    seqs = real_sequences(as_batches(model, PROMPTS, batch_size=8))
    width = max(s.numel() for s in seqs)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    sums = torch.zeros(n_layers, n_heads, width, dtype=torch.float64)
    counts = torch.zeros(n_layers, width, dtype=torch.float64)
    for ids in seqs:
        n = ids.numel()
        for layer, att in enumerate(hf_attentions(hf, ids)):
            seen = visible_by_hand(hf.config, layer, n, encoder=encoder)
            seen[:min_query] = False
            sums[layer, :, :n] += (att * seen[None]).sum(dim=1)
            counts[layer, :n] += seen.sum(dim=0)
    return sums / counts[:, None], counts


@tl4_only
@pytest.mark.parametrize("family", ["mistral", "gemma2", "bert"])
@pytest.mark.parametrize("min_query", [0, 1])
def test_received_attention_averages_over_exactly_the_visible_queries(family, min_query):
    model = zoo_model(family)
    got = find_sinks(model, PROMPTS, min_query=min_query, options=QUIET.replace(batch_size=3))
    ref, counts = _reference_received(family, model, min_query)
    torch.testing.assert_close(got.received.double(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got.n_queries_by_layer.double(), counts)
    if family == "bert":  # every real query counts for every key
        lengths = torch.tensor([s.numel() for s in real_sequences(as_batches(model, PROMPTS))])
        every = torch.stack([((lengths > k) * (lengths - min_query)).sum() for k in range(lengths.max())])
        assert torch.equal(got.n_queries.long(), every)


@tl4_only
def test_visibility_is_read_from_the_model():
    assert attention_visibility(zoo_model("mistral")).windows == (4, 4)
    assert attention_visibility(zoo_model("gemma2")).windows == (4, None)
    bert = attention_visibility(zoo_model("bert"))
    assert not bert.causal and bert.windows == (None, None)


@tl4_only
def test_qk_locking_counts_only_queries_that_see_the_sink():
    """Mistral (window 4): of a sequence of n tokens only queries 1..3 see the sink at 0 (not n - 1 of them).
    (BERT, whose queries before and after the sink would count, is refused by the TransformerLens 4.x bridge:
    tests/zoo/test_zoo_interventions.py.)"""
    model = zoo_model("mistral")
    batches = as_batches(model, PROMPTS, batch_size=2)
    (got,) = stream(model, batches, [QKLockingReducer(model, sink_position=0)], options=QUIET)
    lengths = [s.numel() for s in real_sequences(batches)]
    assert got.n_queries == sum(min(n - 1, 3) for n in lengths)


@pytest.mark.parametrize("min_query", [0, 1])
def test_an_encoder_whose_config_says_causal_is_read_as_the_encoder_it_is(min_query):
    """TransformerLens 3.9's ``TransformerBridge`` leaves BERT at ``cfg.attention_dir="causal"``: sinklens then
    counted only earlier queries, read the attention to later keys as a sink logit's mass (a "virtual sink" of
    0.47) and gave the encoder a next-token loss. The direction is checked against the model's own attention."""
    model = load_model(str(zoo_dir("bert")))
    model.cfg.attention_dir = "causal"  # as 3.9's bridge leaves it (4.x's says bidirectional)
    assert not attention_visibility(model).causal and is_encoder(model)
    got = find_sinks(model, PROMPTS, min_query=min_query, options=QUIET.replace(batch_size=3))
    assert got.virtual_sink is None and got.special_tokens == ("[CLS]", "[SEP]")
    ref, counts = _reference_received("bert", model, min_query)
    torch.testing.assert_close(got.received.double(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got.n_queries_by_layer.double(), counts)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gptoss"])
def test_a_causal_model_stays_causal(family):
    """The probe reads query 0's attention to key 1: exactly 0 under a causal mask, sliding windows and sink
    logits included."""
    model = load_model(str(zoo_dir(family)))
    assert attention_visibility(model).causal and not is_encoder(model)
