"""Normalised disparity before the norm's gain (sinklens) and after it (the paper's site), vs a full cache."""

import pytest
import torch

from sinklens.analysis.normalized_disparity import normalized_disparity
from sinklens.testing import QUIET
from sinklens.testing.zoo import FamilyUnavailableError, zoo_model

pytestmark = pytest.mark.models

PROMPTS = ["t5 t9 t13 t17", "t30 t8 t8 t40 t2", "t11 t12 t3"]


def _ratios(x):
    a = x.abs()
    return a / ((a.sum(-1, keepdim=True) - a) / (a.shape[-1] - 1))


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
    sums = {k: torch.zeros(L, d) for k in ("before", "after", "before_o", "after_o")}
    max_after, n_other = torch.zeros(L, d), 0
    for prompt in PROMPTS:
        _, cache = model.run_with_cache(model.to_tokens(prompt), names_filter=lambda n: ".ln1.hook_" in n)
        for layer in range(L):
            before = _ratios(cache[f"blocks.{layer}.ln1.hook_normalized"][0])
            if f"blocks.{layer}.ln1.hook_out" in cache:  # the norm's own output: after the gain
                after = _ratios(cache[f"blocks.{layer}.ln1.hook_out"][0])
            else:  # TransformerLens 3.x exposes no ln1.hook_out: the gain applied by hand
                ln1 = model.blocks[layer].ln1
                after = _ratios(cache[f"blocks.{layer}.ln1.hook_normalized"][0] * ln1.w + getattr(ln1, "b", 0.0))
            sums["before"][layer] += before[0]
            sums["after"][layer] += after[0]
            sums["before_o"][layer] += before[1:].sum(0)
            sums["after_o"][layer] += after[1:].sum(0)
            max_after[layer] = torch.maximum(max_after[layer], after[1:].amax(0))
        n_other += cache["blocks.0.ln1.hook_normalized"].shape[1] - 1
    n = len(PROMPTS)
    torch.testing.assert_close(found.ratio_sink, sums["before"] / n, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_sink_after_gain, sums["after"] / n, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other, sums["before_o"] / n_other, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other_after_gain, sums["after_o"] / n_other, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.ratio_other_max_after_gain, max_after, rtol=1e-4, atol=1e-5)
    assert (found.ratio_sink - found.ratio_sink_after_gain).abs().max() > 0.1  # the gain changes the answer
    data = found.to_dict(dims=[0])
    assert "hook_normalized" in data["sources"]["before_gain"] and "paper" in data["sources"]["after_gain"]
    assert data["rows"][0]["ratio_sink_after_gain"] == pytest.approx(float(sums["after"][0, 0] / n), rel=1e-4)
