"""Disparity after normalisation (sinklens.analysis.normalized_disparity)."""

import json

import pytest
import torch

from sinklens.analysis.normalized_disparity import NormalizedDisparityReducer, normalized_disparity
from sinklens.inputs import as_batches
from sinklens.streaming import stream
from sinklens.testing import QUIET
from support.checks import PLANTED_PROMPTS

pytestmark = pytest.mark.models

PROMPTS = PLANTED_PROMPTS


def test_normalized_disparity_large_at_sink_only(planted_mechanisms):
    model, spec = planted_mechanisms
    nd = normalized_disparity(model, PROMPTS, options=QUIET.replace(batch_size=2))
    for layer in (1, 2):  # blocks after the writer read the massive dimension
        assert nd.top_dim(layer) == spec.dim
        # LayerNorm's mean removal caps a one-hot vector's ratio at d_model - 1 = 15; RMSNorm does not.
        assert nd.ratio_sink[layer, spec.dim] > 10
        assert nd.ratio_other[layer, spec.dim] < 1  # planted: nothing writes dim at other tokens
    assert nd.ratio_sink[0, spec.dim] < 1  # before the writer: nothing special
    # At other tokens no dimension is far above the rest, except the planted common direction.
    rest = [d for d in range(model.cfg.d_model) if d != spec.common_dim]
    assert nd.ratio_other[:, rest].max() < 10
    assert nd.ratio_other[0, spec.common_dim] > 5  # straight from the embedding
    rows = nd.rows()
    assert rows[1]["dim"] == spec.dim and rows[1]["contrast"] > 10
    json.dumps(nd.to_dict(dims=[spec.dim]))


def test_normalized_disparity_streaming_equals_full_cache(tiny):
    batches = as_batches(tiny, PROMPTS, batch_size=2)
    (got,) = stream(tiny, batches, [NormalizedDisparityReducer(tiny)], options=QUIET)
    L, D = tiny.cfg.n_layers, tiny.cfg.d_model
    # Σ |x_d| and Σ mean_{j != d} |x_j| over the sink tokens / the other tokens (a ratio of averages, as the paper)
    sums = {key: torch.zeros(L, D) for key in ("sink_abs", "sink_rest", "other_abs", "other_rest")}
    for prompt in PROMPTS:
        _, cache = tiny.run_with_cache(tiny.to_tokens(prompt), names_filter=lambda n: n.endswith("ln1.hook_normalized"))
        for layer in range(L):
            x = cache[f"blocks.{layer}.ln1.hook_normalized"][0].abs()
            for p in range(x.shape[0]):
                for d in range(D):
                    where = "sink" if p == 0 else "other"
                    sums[f"{where}_abs"][layer, d] += x[p, d]
                    sums[f"{where}_rest"][layer, d] += torch.cat([x[p, :d], x[p, d + 1 :]]).mean()
    torch.testing.assert_close(got.ratio_sink, sums["sink_abs"] / sums["sink_rest"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.ratio_other, sums["other_abs"] / sums["other_rest"], rtol=1e-4, atol=1e-5)


def test_bad_sink_position(tiny_llama):
    with pytest.raises(ValueError, match="sink_position"):
        normalized_disparity(tiny_llama, ["t3 t4 t5"], sink_position=-1, options=QUIET)
