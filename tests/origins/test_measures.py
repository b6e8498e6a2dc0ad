"""Token preference, contraction and positional discrepancy against hand computations and a planted direction."""

from __future__ import annotations

import math

import pytest
import torch

from sinklens.options import RunOptions
from sinklens.origins.contraction import activation_mean_at_zero, contraction
from sinklens.sinklm.init import sinklm_at_init
from sinklens.origins.positional import positional_discrepancy
from sinklens.origins.preference import TokenPreference, token_preference
from sinklens.sinklm.config import ModelConfig

pytestmark = pytest.mark.models
OPTS = RunOptions(batch_size=16, progress=False)


def _gpt2(seed=0, **over):
    cfg = dict(family="gpt2", n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, d_vocab=128) | over
    return sinklm_at_init(ModelConfig.from_dict(cfg), seed)


@pytest.fixture(scope="module")
def planted():
    """Last MLP's output bias = 50 · u: every final state points along LN(50 u), whatever the input."""
    model = _gpt2()
    g = torch.Generator().manual_seed(1)
    u = torch.randn(32, generator=g)
    u = u / u.norm()
    with torch.no_grad():
        model.blocks[1].mlp.b_out.copy_(50 * u)
        final = model.ln_final((50 * u)[None, None])[0, 0]
        expected = int((final @ model.W_U).argmax())
    return model, u, final, expected


def test_mean_distribution_equals_a_full_forward_average():
    model = _gpt2(seed=3)
    pref = token_preference(model, n_sequences=24, seq_len=8, seed=5, options=OPTS)
    from sinklens.inputs import random_token_batches

    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=24, seq_len=8, batch_size=24, seed=5)])
    with torch.no_grad():
        probs = torch.softmax(model(tokens).float(), dim=-1)
    torch.testing.assert_close(pref.mean_probs, probs.mean(0), atol=1e-6, rtol=1e-5)
    counts = torch.zeros(8, 128, dtype=torch.long)
    for t in range(8):
        counts[t] = torch.bincount(probs[:, t].argmax(-1), minlength=128)
    assert torch.equal(pref.argmax_counts, counts)
    p = probs.mean((0, 1))
    assert pref.max_median_ratio == pytest.approx(float(p.max() / p.median()), rel=1e-5)
    assert pref.top(1)[0]["rel_uniform"] == pytest.approx(float(p.max()) * 128, rel=1e-5)


def test_token_preference_soft_caps_logits_as_the_model_does():
    """Gemma 2 caps its output logits at 30 (``30 · tanh(x / 30)``); token preference used the raw product, so
    with logits past the cap its distribution was off the model's own by up to 0.23 (max/median 4 vs 1.7)."""
    from sinklens.inputs import random_token_batches
    from support.zoo import zoo_model

    model = zoo_model("gemma2")
    assert model.cfg.output_logits_soft_cap == 30.0
    with torch.no_grad():
        hf = getattr(model, "original_model", None)  # the bridge's HF model, or the HookedTransformer's own unembed
        (hf.lm_head.weight if hf is not None else model.unembed.W_U).mul_(2000.0)
    batches = random_token_batches(model, n_sequences=8, seq_len=6, batch_size=8, seed=0)
    with torch.no_grad():
        logits = model(batches[0].tokens).float()
    assert float(logits.abs().max()) > 25.0  # the cap is in play
    pref = token_preference(model, n_sequences=8, seq_len=6, seed=0, options=OPTS)
    torch.testing.assert_close(pref.mean_probs, torch.softmax(logits, dim=-1).mean(0), atol=1e-5, rtol=1e-4)


def test_argmax_entropy_and_gini_by_hand():
    counts = torch.zeros(2, 4, dtype=torch.long)
    counts[1] = torch.tensor([0, 1, 1, 2])
    pref = TokenPreference(torch.full((2, 4), 0.25), counts, 4, prepend_bos=True)  # row 0 (BOS) is left out
    q = torch.tensor([0.25, 0.25, 0.5])
    assert pref.argmax_entropy == pytest.approx(float(-(q * q.log()).sum()))
    c = [0, 1, 1, 2]
    gini = sum(abs(a - b) for a in c for b in c) / (2 * 4 * sum(c))
    assert pref.argmax_gini == pytest.approx(gini)


def test_planted_direction_is_found(planted):
    model, u, final, expected = planted
    pref = token_preference(model, n_sequences=32, seq_len=8, options=OPTS)
    assert pref.argmax_counts.sum(0)[expected] == 32 * 8  # every prediction is the planted token
    assert pref.argmax_entropy == pytest.approx(0.0, abs=1e-9)
    assert pref.argmax_gini == pytest.approx(1 - 1 / 128)
    assert pref.top(1)[0]["token"] == expected
    res = contraction(model, n_sequences=32, seq_len=8, options=OPTS)
    assert res.site("mlp 1").inter_mean > 0.99 and res.site("mlp 1").intra > 0.99
    assert res.site("embed").inter_mean < 0.8  # token + position embeddings: far from the planted concentration
    assert abs(float(res.site("mlp 1").direction @ u)) > 0.99
    assert float(res.site("final").direction @ (final / final.norm())) > 0.99
    assert res.site("mlp 1").direction_stability > 0.99 and res.site("mlp 1").direction_share > 0.95
    share = res.share("inter_mean")
    assert float(share[1, 1]) > 0.5  # the planted MLP carries most of the concentration
    assert float(share.sum()) == pytest.approx(1.0)
    v = res.site("final").direction
    cos = (v @ model.W_U) / model.W_U.norm(dim=0) / v.norm()
    torch.testing.assert_close(res.alignment, cos.detach(), atol=1e-5, rtol=1e-5)
    assert res.alignment_rank(int(res.alignment.argmax())) == 0


def test_concentration_matches_pairwise_cosines_from_a_full_cache():
    model = _gpt2(seed=4)
    res = contraction(model, n_sequences=12, seq_len=6, prepend_bos=True, seed=2, options=OPTS)
    from sinklens.inputs import random_token_batches

    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=12, seq_len=6, batch_size=12,
                                                               prepend_bos=True, seed=2)])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.0.hook_resid_mid")
    h = torch.nn.functional.normalize(cache["blocks.0.hook_resid_mid"].double(), dim=-1)  # (12, 6, d)
    eye = torch.eye(12, dtype=torch.bool)
    inter = torch.stack([(h[:, t] @ h[:, t].T)[~eye].mean() for t in range(6)])
    torch.testing.assert_close(res.site("attn 0").inter, inter.float(), atol=1e-5, rtol=1e-5)
    assert res.site("attn 0").inter_mean == pytest.approx(float(inter[1:].mean()), abs=1e-6)  # BOS left out
    off = ~torch.eye(5, dtype=torch.bool)
    intra = torch.stack([(h[n, 1:] @ h[n, 1:].T)[off].mean() for n in range(12)]).mean()
    assert res.site("attn 0").intra == pytest.approx(float(intra), abs=1e-6)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.hook_resid_post")
    rows = cache["blocks.1.hook_resid_post"][:, 1:].reshape(-1, 32).double()  # direction: top singular vector
    svd = torch.linalg.svd(rows, full_matrices=False)
    assert abs(float(svd.Vh[0].float() @ res.site("mlp 1").direction)) > 0.999
    assert res.site("mlp 1").direction_share == pytest.approx(float(svd.S[0] ** 2 / (svd.S ** 2).sum()), rel=1e-4)


def test_activation_asymmetry_values():
    assert activation_mean_at_zero("gelu") == pytest.approx(1 / (2 * math.sqrt(math.pi)), abs=1e-6)
    assert activation_mean_at_zero("relu") == pytest.approx(1 / math.sqrt(2 * math.pi), abs=1e-6)
    assert activation_mean_at_zero("tanh") == pytest.approx(0.0, abs=1e-9)
    z = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert activation_mean_at_zero("silu") == pytest.approx(float(torch.nn.functional.silu(z).mean()), abs=2e-3)


def test_uniform_attention_shrinks_head_variance_as_one_over_t_plus_one():
    model = _gpt2(seed=6, d_vocab=2048)
    with torch.no_grad():
        model.blocks[0].attn.W_Q.zero_()  # zero queries: uniform causal attention
        model.blocks[0].attn.b_Q.zero_()
    pd = positional_discrepancy(model, n_sequences=512, seq_len=8, options=RunOptions(batch_size=128, progress=False))
    law = pd.head_var[0] * torch.arange(1, 9)  # σ²/(t+1) · (t+1) = σ² at every t
    ratio = law / law.mean(dim=-1, keepdim=True)
    assert float((ratio - 1).abs().max()) < 0.2, ratio
    assert float(pd.first_token_ratio("attn_out_var")[0]) > 3  # position 0 varies most


def test_with_a_bos_the_first_token_ratio_reads_the_first_random_token():
    """The BOS is the same token in every sequence (variance 0 across them): the ratio read it, so ``--bos``
    always printed 0 for every layer."""
    model = _gpt2(seed=6, d_vocab=2048)
    pd = positional_discrepancy(model, n_sequences=64, seq_len=8, prepend_bos=True, options=OPTS)
    assert float(pd.attn_out_var[:, 0].max()) < 1e-10 and pd.first_counted == 1
    torch.testing.assert_close(pd.first_token_ratio("attn_out_var"), pd.relative("attn_out_var")[:, 1])
    assert float(pd.first_token_ratio("attn_out_var").min()) > 0.1
    assert pd.summary()["position"] == 1
    plain = positional_discrepancy(model, n_sequences=64, seq_len=8, options=OPTS)
    assert plain.first_counted == 0 and plain.summary()["position"] == 0


@pytest.mark.parametrize("measure", [token_preference, contraction, positional_discrepancy])
def test_one_random_token_after_a_bos_is_refused(measure):
    """seq_len=2 with a BOS left one counted position: contraction reported intra 0.000 (undefined), the
    positional ratio 1 by construction."""
    from sinklens.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"seq_len=2 with prepend_bos=True leaves 1 random token after the BOS"):
        measure(_gpt2(), n_sequences=4, seq_len=2, prepend_bos=True, options=OPTS)
    measure(_gpt2(), n_sequences=4, seq_len=3, prepend_bos=True, options=OPTS)


def test_positional_measures_match_a_full_cache():
    model = _gpt2(seed=8)
    pd = positional_discrepancy(model, n_sequences=16, seq_len=6, seed=3, options=RunOptions(batch_size=5, progress=False))
    from sinklens.inputs import random_token_batches

    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=16, seq_len=6, batch_size=16, seed=3)])
    names = {"blocks.1.hook_attn_out", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_z"}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    a = cache["blocks.1.hook_attn_out"].double()
    torch.testing.assert_close(pd.attn_out_var[1], a.var(dim=0, unbiased=False).mean(-1).float(), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(pd.attn_out_norm[1], a.norm(dim=-1).mean(0).float(), rtol=1e-5, atol=1e-9)
    r = cache["blocks.1.hook_resid_mid"].double()
    torch.testing.assert_close(pd.resid_var[1], r.var(dim=0, unbiased=False).mean(-1).float(), rtol=1e-4, atol=1e-9)
    z = cache["blocks.1.attn.hook_z"].double()  # (n, t, h, dh)
    torch.testing.assert_close(pd.head_var[1], z.var(dim=0, unbiased=False).mean(-1).T.float(), rtol=1e-4, atol=1e-9)
    rel = pd.relative("attn_out_var")[1]
    assert float(rel[3:].mean()) == pytest.approx(1.0)


def test_persistence_tracks_the_init_after_a_few_steps():
    from _origins_cfg import origins_cfg

    from sinklens.origins.persistence import persistence
    from sinklens.train.loop import train

    cfg = origins_cfg(5, steps=3, optim={"lr": 1e-4, "warmup_steps": 1})  # Adam steps of ~1e-4 vs weights of std 0.02
    trained = train(cfg, progress=False).model.eval()
    own = persistence(trained, sinklm_at_init(cfg.model, 5), n_sequences=32, seq_len=8)
    other = persistence(trained, sinklm_at_init(cfg.model, 6), n_sequences=32, seq_len=8)
    assert own["preference_corr"] > 0.8 and own["direction_cos"] > 0.8, own
    assert other["preference_corr"] < 0.5 and other["direction_cos"] < own["direction_cos"], other
