"""Normalised disparity before the norm's gain (sinklens) and after it (the paper's site), vs a full cache."""

import pytest
import torch

from sinklens.analysis.normalized_disparity import normalized_disparity
from sinklens.testing import QUIET
from support.zoo import FamilyUnavailableError, zoo_model

pytestmark = pytest.mark.models

PROMPTS = ["t5 t9 t13 t17", "t30 t8 t8 t40 t2", "t11 t12 t3"]


def _magnitudes(x):
    """``(|x_d|, m_d = mean_{j != d} |x_j|)`` per token of ``x [pos, d_model]``."""
    a = x.abs()
    return a, (a.sum(-1, keepdim=True) - a) / (a.shape[-1] - 1)


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_before_and_after_gain_match_full_cache_references(family):
    try:
        model = zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a gain far from 1 and uneven over dims, so that before and after differ
        if hasattr(model, "original_model"):  # TransformerBridge: the HF norm (Gemma multiplies by 1 + w)
            gains = [block.input_layernorm.weight for block in model.original_model.model.layers]
            offset = 1.0 if family == "gemma2" else 0.0
        else:  # HookedTransformer 3.x: ln1.w is the gain itself
            gains, offset = [block.ln1.w for block in model.blocks], 0.0
        for w in gains:
            w.copy_(torch.rand(w.shape, generator=gen) * 4.0 - offset)
    found = normalized_disparity(model, PROMPTS, options=QUIET.replace(batch_size=2))
    L, d = model.cfg.n_layers, model.cfg.d_model
    # The paper's estimator (attention_sink.ipynb cell 16): a ratio of averages over tokens, Σ|x_d| / Σ m_d.
    sums = {(site, where, part): torch.zeros(L, d) for site in ("before", "after") for where in ("sink", "other")
            for part in ("abs", "rest")}
    max_after = torch.zeros(L, d)
    for prompt in PROMPTS:
        _, cache = model.run_with_cache(model.to_tokens(prompt), names_filter=lambda n: ".ln1.hook_" in n)
        for layer in range(L):
            normalized = cache[f"blocks.{layer}.ln1.hook_normalized"][0]
            if f"blocks.{layer}.ln1.hook_out" in cache:  # the norm's own output: after the gain
                output = cache[f"blocks.{layer}.ln1.hook_out"][0]
            else:  # TransformerLens 3.x exposes no ln1.hook_out: the gain applied by hand
                ln1 = model.blocks[layer].ln1
                output = normalized * ln1.w + getattr(ln1, "b", 0.0)
            for site, x in (("before", normalized), ("after", output)):
                for part, value in zip(("abs", "rest"), _magnitudes(x)):
                    sums[site, "sink", part][layer] += value[0]
                    sums[site, "other", part][layer] += value[1:].sum(0)
            a, rest = _magnitudes(output)
            max_after[layer] = torch.maximum(max_after[layer], (a / rest)[1:].amax(0))
    ratio = {(site, where): sums[site, where, "abs"] / sums[site, where, "rest"]
             for site in ("before", "after") for where in ("sink", "other")}
    torch.testing.assert_close(found.ratio_sink, ratio["before", "sink"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_sink_after_gain, ratio["after", "sink"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other, ratio["before", "other"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other_after_gain, ratio["after", "other"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other_max_after_gain, max_after, rtol=1e-4, atol=1e-5)
    assert (found.ratio_sink - found.ratio_sink_after_gain).abs().max() > 0.1  # the gain changes the answer
    data = found.to_dict(dims=[0])
    assert "hook_normalized" in data["sources"]["before_gain"] and "paper" in data["sources"]["after_gain"]
    assert data["rows"][0]["ratio_sink_after_gain"] == pytest.approx(float(ratio["after", "sink"][0, 0]), rel=1e-4)


def test_sinklm_with_trained_gains_gives_the_papers_ratio_from_its_residual():
    """On sinklens' own SinkLM with gains away from 1 (as after training) and no BOS (a different first token per
    sequence, where a mean of per-sequence ratios differs from the paper's ratio of averages): after the gain,
    the paper's number computed by hand from ``hook_resid_pre`` through ``w ⊙ x / rms(x)``; before it, ``x / rms(x)``."""
    from sinklens.testing import tiny_sinklm

    model = tiny_sinklm(seed=1)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for block in model.blocks:
            block.ln1.w.copy_(torch.rand(block.ln1.w.shape, generator=gen) * 4.0)
    tokens = torch.randint(0, 512, (6, 9), generator=gen)
    found = normalized_disparity(model, tokens, options=QUIET.replace(batch_size=4, prepend_bos=False))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_pre"))
    for layer, block in enumerate(model.blocks):
        x = cache[f"blocks.{layer}.hook_resid_pre"][:, 0].double()  # the sink position of every sequence
        normalized = x / (x.pow(2).mean(-1, keepdim=True) + block.ln1.eps).sqrt()
        for got, vector in ((found.ratio_sink[layer], normalized), (found.ratio_sink_after_gain[layer], normalized * block.ln1.w.double())):
            a, rest = _magnitudes(vector)
            torch.testing.assert_close(got.double(), a.mean(0) / rest.mean(0), rtol=1e-4, atol=1e-6)
        a, rest = _magnitudes(normalized * block.ln1.w.double())
        assert float(((a / rest).mean(0) - a.mean(0) / rest.mean(0)).abs().max()) > 1e-2  # the estimators differ here
