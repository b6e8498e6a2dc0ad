"""Exact definitions that the rest of the suite left unpinned (found by mutation testing).

Each test checks one documented definition against an independent computation (scipy, a hand formula or a
hand-built mask), on inputs chosen so that the nearby wrong definitions (mean for median, ``1/(n-1)`` for ``1/n``,
a one-sided for a two-sided window) give different numbers.
"""

import math

import pytest
import torch

from sinklens.analysis.neurons import row_sparsity
from sinklens.analysis.sinks import SinkResult, SinkSettings, TokenSinkStats
from sinklens.analysis.weight_super_neurons import super_neurons_from_weights
from sinklens.testing import tiny_model, transformer_lens_major
from sinklens.visibility import Visibility

# ---- Visibility: sliding windows, causal and bidirectional ---------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_sliding_window_visibility_is_a_one_sided_band_causally_and_a_two_sided_band_bidirectionally(window):
    """A window of ``w`` tokens: a causal query ``q`` sees ``q - w < k <= q``; a bidirectional one sees
    ``|q - k| < w`` (Gemma 3's bidirectional window overlay in transformers: ``abs(q_idx - kv_idx) < sliding_window``).
    Full-attention layers: ``k <= q`` causally, everything bidirectionally."""
    n = 9
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    band = [[abs(i - j) < window for j in range(n)] for i in range(n)]
    causal_band = [[0 <= i - j < window for j in range(n)] for i in range(n)]
    both = Visibility(causal=False, windows=(None, window))
    causal = Visibility(causal=True, windows=(None, window))
    assert both.visible(1, n).tolist() == band
    assert causal.visible(1, n).tolist() == causal_band
    assert both.visible(0, n).all() and torch.equal(causal.visible(0, n), k <= q)
    # Counted per key over real queries: a bidirectional key sees min(k, w-1) queries before it and
    # min(len-1-k, w-1) after it, plus itself.
    valid = torch.tensor([[True] * n, [True] * 5 + [False] * (n - 5)])
    expected = torch.tensor([[sum(1 for i in range(length) if abs(i - j) < window) if j < length else 0
                              for j in range(n)] for length in (n, 5)])
    assert torch.equal(both.batch_mask(1, valid).sum(dim=1), expected)


# ---- row_sparsity: Pearson kurtosis with 1/n moments ----------------------------------------------------------


def test_row_sparsity_kurtosis_is_pearsons_with_population_moments():
    """``row_sparsity``'s kurtosis is Pearson's ``m4 / m2²`` with ``1/n`` moments (scipy's
    ``kurtosis(fisher=False, bias=True)``); a one-hot row of ``d`` entries has ``(d² − 3d + 3) / (d − 1)``."""
    from scipy.stats import kurtosis

    gen = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(6, 7, generator=gen), torch.randn(6, 7, generator=gen) ** 3])  # light and heavy tails
    kurt, share = row_sparsity(rows)
    ref = kurtosis(rows.double().numpy(), axis=-1, fisher=False, bias=True)
    torch.testing.assert_close(kurt.double(), torch.from_numpy(ref), rtol=1e-5, atol=0)
    sq = rows.double() ** 2
    torch.testing.assert_close(share.double(), sq.amax(-1) / sq.sum(-1), rtol=1e-6, atol=0)
    for d in (2, 5, 16):
        one_hot = torch.zeros(1, d)
        one_hot[0, d // 2] = -3.0
        assert float(row_sparsity(one_hot)[0]) == pytest.approx((d * d - 3 * d + 3) / (d - 1), rel=1e-6)


# ---- super_neurons_from_weights: norm ratios to the layer's median neuron ------------------------------------


def _mlp_weights(model, layer):
    """Writable ``W_in``, ``W_gate`` ``[d_model, d_mlp]`` and ``W_out`` ``[d_mlp, d_model]`` views of a llama MLP."""
    if transformer_lens_major() >= 4:
        mlp = model.original_model.model.layers[layer].mlp
        return mlp.up_proj.weight.T, mlp.gate_proj.weight.T, mlp.down_proj.weight.T
    mlp = model.blocks[layer].mlp
    return mlp.W_in, mlp.W_gate, mlp.W_out


@pytest.mark.models
def test_weight_norm_ratios_divide_by_the_median_neuron():
    """With ``W_in[:, n] = a_n e_0``, ``W_gate[:, n] = b_n e_1``, ``W_out[n] = c_n e_2`` the norms are ``a_n``, ``b_n``,
    ``c_n``; each ``*_norm_ratio`` is that over the median of the layer's 33 neurons (an odd count: one middle value),
    for skewed profiles whose mean is far from their median. ``score`` is the product of the three ratios, and every
    ``W_out`` row is one-hot, so its kurtosis is ``(d² − 3d + 3) / (d − 1)`` and its top share 1."""
    d_mlp, d_model = 33, 16
    model = tiny_model("llama", n_layers=2, d_model=d_model, n_heads=4, d_mlp=d_mlp, seed=3)
    n = torch.arange(d_mlp, dtype=torch.float64)
    profiles = {
        0: ((n + 1) ** 2, (n + 1).sqrt(), 1 + (n % 7) ** 2 * 10),
        1: ((n + 1) ** 3, 2.0 ** (n / 4), 5 + (n * 11 % 13) ** 2),
    }
    with torch.no_grad():
        for layer, (a, b, c) in profiles.items():
            w_in, w_gate, w_out = _mlp_weights(model, layer)
            for w, col in ((w_in, a), (w_gate, b)):
                w.zero_()
                w[0 if w is w_in else 1] = col.to(w.dtype)
            w_out.zero_()
            w_out[:, 2] = c.to(w_out.dtype)
    got = super_neurons_from_weights(model)
    for layer, (a, b, c) in profiles.items():
        ratios = [x / x.sort().values[d_mlp // 2] for x in (a, b, c)]
        assert all(abs(float(x.mean() / x.sort().values[d_mlp // 2]) - 1) > 0.05 for x in (a, b, c))  # mean ≠ median
        torch.testing.assert_close(got.in_norm[layer].double(), a, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.in_norm_ratio[layer].double(), ratios[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(got.gate_norm_ratio[layer].double(), ratios[1], rtol=1e-6, atol=0)
        torch.testing.assert_close(got.out_norm_ratio[layer].double(), ratios[2], rtol=1e-6, atol=0)
        torch.testing.assert_close(got.score[layer].double(), ratios[0] * ratios[1] * ratios[2], rtol=1e-5, atol=0)
        one_hot_kurt = (d_model**2 - 3 * d_model + 3) / (d_model - 1)
        torch.testing.assert_close(got.out_kurtosis[layer].double(), torch.full((d_mlp,), one_hot_kurt, dtype=torch.float64),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(got.out_top_share[layer].double(), torch.ones(d_mlp, dtype=torch.float64))
    # The top neuron is the one with the largest product of the three ratios.
    products = {(layer, i): float(math.prod(float(x[i] / x.sort().values[d_mlp // 2]) for x in prof))
                for layer, prof in profiles.items() for i in range(d_mlp)}
    assert got.top(1)[0][:2] == max(products, key=products.get)


# ---- SinkResult.outlier_ratio / detect_sinks: the median over candidate positions -----------------------------


def _empty_token_stats():
    return TokenSinkStats(torch.zeros(0, dtype=torch.long), [], torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0))


def _hand_sink_result(profile_heads, n_queries, *, seq_sink_frac=None, **settings):
    """A one-layer SinkResult with ``received[0, h, k] = profile_heads[h][k]``, one sequence at every key."""
    received = torch.tensor(profile_heads, dtype=torch.float32)[None]  # [1, head, key]
    n_keys = received.shape[-1]
    frac = torch.zeros_like(received) if seq_sink_frac is None else torch.tensor(seq_sink_frac, dtype=torch.float32)[None]
    return SinkResult(
        received=received, n_queries=torch.tensor(n_queries, dtype=torch.float32), seq_sink_frac=frac,
        n_sequences_at=torch.ones(n_keys), layers=[0], settings=SinkSettings(**settings), n_sequences=1,
        prepend_bos=True, first_tokens=_empty_token_stats(), later_tokens=_empty_token_stats(), gu_seq_sink_frac=frac,
    )


def test_outlier_ratio_divides_by_the_median_of_the_candidate_profile():
    """Keys 0-4 are candidates (seen by >= 4 counted queries), 5-7 are not. The head-mean profile over the
    candidates is 0.6, 0.1, 0.05, 0.02, 0.01 (a NaN head entry counts as 0): median 0.05, mean 0.156. Key 0's
    ratio is 12 against the median (3.85 against the mean), so with no sink heads at all the outlier rule alone
    makes key 0 a sink at the default factor 5, and at factor 11 but not 13."""
    nan = float("nan")
    heads = [[0.7, 0.15, 0.06, 0.04, 0.02, 0.9, 0.9, nan],
             [0.5, 0.05, 0.04, 0.00, 0.00, 0.9, nan, nan]]
    result = _hand_sink_result(heads, [8, 7, 6, 5, 4, 3, 2, 1], min_query_count=4)
    assert result.candidates == [0, 1, 2, 3, 4]
    profile = torch.tensor([0.6, 0.1, 0.05, 0.02, 0.01])
    median = float(profile.sort().values[2])
    ratio = result.outlier_ratio()
    torch.testing.assert_close(ratio[:5], profile / median, rtol=1e-6, atol=0)
    assert torch.isnan(ratio[5:]).all()
    assert float(ratio[0]) == pytest.approx(12.0, rel=1e-6)
    assert float(result.sink_rate_by_position(method="sinklens").max()) == 0.0  # the share rule never fires
    assert result.detect_sinks() == [0] and result.sink_positions == [0]
    assert result.detect_sinks(outlier_factor=11.0) == [0]
    assert result.detect_sinks(outlier_factor=13.0) == []
    # The share rule alone (no outlier: a flat candidate profile) fires where a quarter of the heads are sinks.
    flat = _hand_sink_result([[0.1] * 5, [0.1] * 5], [8, 7, 6, 5, 4],
                             seq_sink_frac=[[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], min_query_count=4)
    assert torch.allclose(flat.outlier_ratio(), torch.ones(5))
    assert flat.detect_sinks() == [2] and flat.detect_sinks(min_head_share=0.6) == []
