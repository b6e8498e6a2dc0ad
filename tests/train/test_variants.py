"""Attention variants of SinkLM: registry, fast vs explicit path, and each variant's definition."""

from __future__ import annotations

import math

import pytest
import torch

from sinklens.sinklm.model import SinkLM, calibrate_headwise_gains
from sinklens.sinklm.config import ModelConfig
from sinklens.sinklm.variants import (
    AttentionVariant,
    attention_variants,
    get_attention_variant,
    register_attention_variant,
)

VARIANTS = ["baseline", "headwise_rms", "gated", "qk_norm", "sigmoid", "sink_logit", "softpick"]
TINY = dict(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=16, d_vocab=32)


def build(variant="baseline", family="llama", seed=0, **overrides) -> SinkLM:
    torch.manual_seed(seed)
    return SinkLM(ModelConfig(family=family, variant=variant, **{**TINY, **overrides}))


def tokens(batch=3, pos=12, seed=1):
    return torch.randint(0, 32, (batch, pos), generator=torch.Generator().manual_seed(seed))


def cached(model, toks, *sites):
    _, cache = model.run_with_cache(toks, names_filter=lambda n: any(n.endswith(s) for s in sites))
    return cache


# ---------------------------------------------------------------- registry


def test_registry_lists_every_variant_and_rejects_duplicates():
    assert set(VARIANTS) <= set(attention_variants())
    with pytest.raises(ValueError, match="'gated' is already registered"):
        register_attention_variant("gated", AttentionVariant)
    with pytest.raises(ValueError, match=r"Unknown attention variant 'nope'; known variants are \[.*'softpick'"):
        get_attention_variant("nope")
    with pytest.raises(TypeError):
        register_attention_variant("test_not_a_variant", int)


@pytest.mark.parametrize(
    "variant, options, message",
    [
        ("headwise_rms", {"gain": "per_dim"}, r"gain must be one of \['per_head', 'shared'\]"),
        ("headwise_rms", {"init": "zeros"}, r"init must be one of \['first_token', 'ones'\]"),
        ("gated", {"granularity": "channel"}, r"granularity must be one of \['elementwise', 'headwise'\]"),
        ("sigmoid", {"bias": "log_n"}, "bias must be 'neg_log_n' or a number"),
        ("softpick", {"temperature": 2}, r"Unknown option\(s\) \['temperature'\]"),
    ],
)
def test_bad_variant_options(variant, options, message):
    with pytest.raises(ValueError, match=message):
        build(variant, variant_options=options)


# ------------------------------------------------------- fast vs explicit


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_path_equals_explicit_path(variant, family):
    model = build(variant, family)
    attn = model.blocks[0].attn
    assert attn.needs_explicit() == (variant in ("sigmoid", "sink_logit", "softpick"))
    toks = tokens()
    fast_logits, fast_loss = model(toks, return_type="both")
    fast_loss.backward()
    fast_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    noop = [(f"blocks.{l}.attn.hook_pattern", lambda pattern, hook: None) for l in range(2)]
    with model.hooks(fwd_hooks=noop):
        assert attn.needs_explicit()
        slow_logits, slow_loss = model(toks, return_type="both")
        slow_loss.backward()
    torch.testing.assert_close(fast_logits, slow_logits, rtol=0, atol=1e-5)
    for fast, p in zip(fast_grads, model.parameters()):
        torch.testing.assert_close(fast, p.grad, rtol=1e-4, atol=1e-6)
    assert not model.blocks[0].attn.needs_explicit() or variant in ("sigmoid", "sink_logit", "softpick")


@pytest.mark.parametrize("mode", ["amplify", "attenuate"])
def test_variance_calibration_fast_path_sees_edits_of_the_rotated_keys(mode):
    """The fast path recomputed s_t from the queries and keys before RoPE, so an edit at hook_rot_k changed the
    pattern but not the factor (1.29 where uniform attention gives sqrt(2) = 1.41)."""
    model = build("variance_calibrated", variant_options={"mode": mode})
    seen: dict[str, torch.Tensor] = {}
    hooks = [("blocks.0.attn.hook_rot_k", lambda k, hook: k * 0.0),  # every logit 0: uniform causal attention
             ("blocks.0.attn.hook_z", lambda z, hook: seen.__setitem__("z", z.detach().clone())),
             ("blocks.0.attn.hook_z_calibrated", lambda z, hook: seen.__setitem__("zc", z.detach().clone()))]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        assert not model.blocks[0].attn.needs_explicit()
        model(tokens())
    factor = (seen["zc"] / seen["z"])[:, :, :, 0]  # (batch, pos, head)
    expected = torch.arange(1, 13, dtype=torch.float32).sqrt() / (math.sqrt(16) if mode == "attenuate" else 1.0)
    torch.testing.assert_close(factor, expected[None, :, None].expand_as(factor), rtol=1e-4, atol=1e-5)


def test_run_with_cache_of_patterns_takes_the_explicit_path():
    model = build("headwise_rms")
    seen = []
    original = type(model.blocks[0].attn).aggregate

    def spy(self, q, k, v, *, explicit):
        seen.append(explicit)
        return original(self, q, k, v, explicit=explicit)

    type(model.blocks[0].attn).aggregate = spy
    try:
        model(tokens())
        cached(model, tokens(), "blocks.1.attn.hook_pattern")
    finally:
        type(model.blocks[0].attn).aggregate = original
    assert seen == [False, False, False, True]


# ------------------------------------------------------------ head-wise RMSNorm


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_headwise_rms_output_rms_equals_each_heads_gain(family):
    # no GQA, so every head gets its own gain; init_std 0.2 makes mean(z²) >> eps
    model = build("headwise_rms", family, n_kv_heads=4, init_std=0.2)
    cache = cached(model, tokens(), "attn.hook_z", "attn.hook_z_normed")
    for layer in range(2):
        gain = model.blocks[layer].attn.variant.gain.detach()  # [head, d_head], constant per head
        assert gain.shape == (4, 4) and (gain == gain[:, :1]).all() and gain[:, 0].unique().numel() == 4
        normed = cache[f"blocks.{layer}.attn.hook_z_normed"]
        rms = normed.pow(2).mean(-1).sqrt()  # [batch, pos, head]
        # RMS = gain · sqrt(ms / (ms + eps)), ms = mean square of the raw z: the gain up to eps = 1e-6
        z = cache[f"blocks.{layer}.attn.hook_z"]
        ms = z.pow(2).mean(-1)
        torch.testing.assert_close(rms, gain[:, 0] * (ms / (ms + 1e-6)).sqrt())
        torch.testing.assert_close(rms, gain[:, 0].expand_as(rms), rtol=1e-3, atol=0)
        # the raw aggregation stays at hook_z, and hook_z_normed is its RMS normalisation
        expected = z / (z.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * gain
        torch.testing.assert_close(normed, expected)
    assert model.head_output_site == "attn.hook_z_normed"


def test_headwise_rms_random_gains_and_shared_gain():
    model = build("headwise_rms", variant_options={"gain": "shared", "init": "ones"})
    gain = model.blocks[1].attn.variant.gain
    assert gain.shape == (4,) and (gain == 1).all()
    with torch.no_grad():
        gain.copy_(torch.tensor([0.5, 2.0, 1.0, 3.0]))
    cache = cached(model, tokens(), "blocks.1.attn.hook_z", "blocks.1.attn.hook_z_normed")
    z = cache["blocks.1.attn.hook_z"]
    expected = z / (z.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * torch.tensor([0.5, 2.0, 1.0, 3.0])
    torch.testing.assert_close(cache["blocks.1.attn.hook_z_normed"], expected)


def _expected_first_token_gains(model, n_sequences, seed):
    """The authors' definition, recomputed by hand: z[0] = v[0] = x[0] W_V (+ b_V) for x ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    T, out = min(64, model.cfg.n_ctx), []
    for layer in range(model.cfg.n_layers):
        x = torch.randn(n_sequences, T, model.cfg.d_model, generator=gen)
        v0 = torch.einsum("nd,hdk->nhk", x[:, 0], model.W_V[layer]) + model.b_V[layer]
        v0 = v0.repeat_interleave(model.cfg.n_heads // model.cfg.n_kv_heads, dim=1)  # query head h -> kv h // rep
        out.append(v0.std(dim=-1, unbiased=False).mean(dim=0))
    return torch.stack(out)  # [layer, head]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_first_token_calibration_matches_the_definition(family):
    model = build("headwise_rms", family)
    expected = _expected_first_token_gains(model, n_sequences=8, seed=0)
    for layer in range(2):
        torch.testing.assert_close(model.blocks[layer].attn.variant.gain.detach(), expected[layer][:, None].expand(4, 4))
    # with W_V init std 0.02 and unit-variance inputs, each gain is about 0.02·sqrt(d_model)
    assert 0.5 * 0.02 * 4 < expected.mean() < 1.5 * 0.02 * 4

    got = calibrate_headwise_gains(model, n_sequences=1, seed=7)
    torch.testing.assert_close(got, _expected_first_token_gains(model, 1, 7))

    shared = build("headwise_rms", family, variant_options={"gain": "shared"})
    expected = _expected_first_token_gains(shared, 8, 0)
    for layer in range(2):
        gain = shared.blocks[layer].attn.variant.gain.detach()
        torch.testing.assert_close(gain, expected[layer].mean().expand(4))


def test_calibration_refuses_a_model_without_headwise_gains():
    with pytest.raises(ValueError, match="needs a headwise_rms model"):
        calibrate_headwise_gains(build("baseline"))


def test_models_built_after_the_same_seed_are_identical():
    a, b = build("headwise_rms", seed=5), build("headwise_rms", seed=5)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


# --------------------------------------------------------- pattern semantics


def _scores_from_qk(cache, layer, scale_bias=0.0):
    q, k = cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_k"]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]) + scale_bias
    T = s.shape[-1]
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


def test_softmax_rows_sum_to_one_and_are_causal():
    pattern = cached(build("baseline"), tokens(), "hook_pattern")["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 4, 12))
    assert (pattern.triu(1) == 0).all()


@pytest.mark.parametrize("bias, b", [("neg_log_n", -math.log(16)), (0.0, 0.0), (-1.5, -1.5)])
def test_sigmoid_pattern_is_elementwise_sigmoid_with_bias(bias, b):
    model = build("sigmoid", "gpt2", n_kv_heads=4, variant_options={"bias": bias})
    cache = cached(model, tokens(), "hook_q", "hook_k", "hook_attn_scores", "hook_pattern")
    for layer in range(2):
        scores = _scores_from_qk(cache, layer, b)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_attn_scores"], scores)
        expected = torch.sigmoid(scores)
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected)
        assert (pattern.triu(1) == 0).all()
    # unnormalised: row t sums to about (t + 1) * sigmoid(b) at init (scores are near 0)
    sums = pattern.sum(-1)
    torch.testing.assert_close(sums, torch.arange(1, 13.0).expand_as(sums) / (1 + math.exp(-b)), rtol=0.05, atol=0)


def test_sink_logit_rows_lose_exactly_the_sink_share():
    model = build("sink_logit", "gpt2", n_kv_heads=4, variant_options={"init": 1.5})
    with torch.no_grad():
        model.blocks[0].attn.variant.sink.copy_(torch.tensor([-2.0, 0.0, 1.5, 4.0]))
    cache = cached(model, tokens(), "hook_q", "hook_k", "hook_pattern")
    for layer, sink in [(0, torch.tensor([-2.0, 0.0, 1.5, 4.0])), (1, torch.full((4,), 1.5))]:
        scores = _scores_from_qk(cache, layer)
        sink_col = sink.view(1, 4, 1, 1).expand(3, 4, 12, 1)
        expected = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected)
        assert (pattern.sum(-1) < 1).all()
    # the sink's share grows with its logit: head 3 (s=4) keeps the least mass
    mass = cache["blocks.0.attn.hook_pattern"].sum(-1).mean(dim=(0, 2))
    assert mass[0] > mass[1] > mass[2] > mass[3]


def test_softpick_matches_its_formula_and_rows_can_be_empty():
    model = build("softpick", "gpt2", n_kv_heads=4)
    cache = cached(model, tokens(), "hook_q", "hook_k", "hook_pattern")
    for layer in range(2):
        x = _scores_from_qk(cache, layer).double()
        e = torch.where(torch.isfinite(x), torch.expm1(x), torch.zeros_like(x))  # e^x - 1 in the window
        m = x.amax(-1, keepdim=True).clamp(min=0)
        expected = torch.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6 * torch.exp(m))
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected.float(), rtol=1e-4, atol=1e-6)
        assert (pattern.sum(-1) <= 1 + 1e-6).all()

    def all_negative(scores, hook):
        return torch.where(torch.isfinite(scores), -1.0 - scores.abs(), scores)

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_attn_scores", all_negative)]):
        cache = cached(model, tokens(), "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z")
    assert (cache["blocks.0.attn.hook_pattern"] == 0).all()
    assert (cache["blocks.0.attn.hook_z"] == 0).all()


@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_gate_is_sigmoid_of_attention_input(granularity):
    model = build("gated", variant_options={"granularity": granularity})
    with torch.no_grad():  # the gate reads the norm's output, w ⊙ hook_normalized
        for block in model.blocks:
            block.ln1.w.uniform_(0.5, 2.0)
    cache = cached(model, tokens(), "ln1.hook_normalized", "attn.hook_z", "attn.hook_gate", "attn.hook_z_gated")
    for layer in range(2):
        x = cache[f"blocks.{layer}.ln1.hook_normalized"] * model.blocks[layer].ln1.w
        W_G = model.blocks[layer].attn.variant.W_G
        if granularity == "elementwise":
            gate = torch.sigmoid(torch.einsum("bpd,hdk->bphk", x, W_G))
            gated = cache[f"blocks.{layer}.attn.hook_z"] * gate
        else:
            gate = torch.sigmoid(torch.einsum("bpd,hd->bph", x, W_G))
            gated = cache[f"blocks.{layer}.attn.hook_z"] * gate[..., None]
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_gate"], gate)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_z_gated"], gated)
    assert model.head_output_site == "attn.hook_z_gated"


def test_qk_norm_normalises_each_head_before_rope():
    model = build("qk_norm")
    cache = cached(model, tokens(), "attn.hook_q", "attn.hook_q_normed", "attn.hook_k_normed", "attn.hook_rot_q")
    q = cache["blocks.0.attn.hook_q"]
    normed = cache["blocks.0.attn.hook_q_normed"]
    torch.testing.assert_close(normed, q / (q.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    torch.testing.assert_close(cache["blocks.1.attn.hook_k_normed"].pow(2).mean(-1), torch.ones(3, 12, 2), rtol=5e-3, atol=0)
    # RoPE is a rotation: it keeps each head's norm
    torch.testing.assert_close(cache["blocks.0.attn.hook_rot_q"].norm(dim=-1), normed.norm(dim=-1))


def test_custom_variant_plugs_in():
    class Uniform(AttentionVariant):
        """Uniform attention over the causal window (ignores q·k)."""

        uses_sdpa = False

        def normalize(self, scores):
            window = torch.isfinite(scores).float()
            return window / window.sum(-1, keepdim=True)

    if "test_uniform" not in attention_variants():
        register_attention_variant("test_uniform", Uniform)
    model = build("test_uniform")
    pattern = cached(model, tokens(), "blocks.0.attn.hook_pattern")["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(pattern[0, 0], torch.ones(12, 12).tril() / torch.arange(1, 13.0)[:, None])


@pytest.mark.parametrize("variant", [*VARIANTS, "variance_calibrated"])
def test_a_float64_model_is_float64_throughout(variant):
    """``dtype="float64"`` ran its norms, RoPE tables, sigmoid/softpick and calibration in float32 (float64 rms_norm
    off by 5.6e-7, gradcheck failing). Now its gradient passes ``torch.autograd.gradcheck`` at float64 tolerances."""
    model = build(variant, n_layers=1, dtype="float64")
    toks = tokens(batch=1, pos=5)
    x0 = torch.randn(1, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def logits(x):
        with model.hooks(fwd_hooks=[("hook_embed", lambda a, hook: x)]):
            return model(toks)

    assert logits(x0).dtype == torch.float64
    assert torch.autograd.gradcheck(logits, (x0,), eps=1e-6, atol=1e-7, rtol=1e-6)
    attn = model.blocks[0].attn  # the RoPE tables are float64-exact (they were rounded to float32 first: 1.5e-8)
    freq = 1.0 / (model.cfg.rope_base ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4))
    angles = torch.arange(16, dtype=torch.float64)[:, None] * freq
    torch.testing.assert_close(attn.rope_cos, torch.cat([angles.cos(), angles.cos()], dim=-1), rtol=0, atol=1e-15)
    torch.testing.assert_close(attn.rope_sin, torch.cat([angles.sin(), angles.sin()], dim=-1), rtol=0, atol=1e-15)
