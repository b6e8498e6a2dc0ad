"""Variance calibration: the σ²/(t+1) law cancelled; hooks, trainer variant, fast and explicit paths agree."""

from __future__ import annotations

import pytest
import torch

from sinklens.interventions import registry
from sinklens.interventions.calibration import calibration_factor, variance_calibration
from sinklens.options import RunOptions
from sinklens.sinklm.init import sinklm_at_init
from sinklens.origins.positional import positional_discrepancy
from sinklens.sinklm.config import ModelConfig

pytestmark = pytest.mark.models


def _model(variant="baseline", family="gpt2", seed=6, **over):
    cfg = dict(family=family, n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, d_vocab=2048, variant=variant)
    return sinklm_at_init(ModelConfig.from_dict(cfg | over), seed)


def test_calibrated_head_variance_is_equal_at_every_position_under_uniform_attention():
    model = _model()
    with torch.no_grad():
        model.blocks[0].attn.W_Q.zero_()  # uniform causal attention in layer 0
        model.blocks[0].attn.b_Q.zero_()
    opts = RunOptions(batch_size=128, progress=False)
    raw = positional_discrepancy(model, n_sequences=512, seq_len=8, options=opts).head_var[0]
    hooks = registry.build(model, "variance_calibration", layers=[0])  # a spec: amplify, causal
    cal = positional_discrepancy(model, n_sequences=512, seq_len=8, options=opts.replace(extra_hooks=hooks)).head_var[0]
    flat = cal / cal.mean(dim=-1, keepdim=True)
    assert float((flat - 1).abs().max()) < 0.2, flat  # position-independent after calibration
    assert float((raw[:, 0] / raw[:, -1]).min()) > 5  # ~8 = (t+1) before it
    torch.testing.assert_close(cal[:, 0], raw[:, 0], rtol=1e-5, atol=1e-8)  # position 0 is untouched (factor 1)


def test_factors_by_mode():
    A = torch.softmax(torch.randn(2, 3, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")), -1)
    amp, att = calibration_factor(A, "amplify"), calibration_factor(A, "attenuate")
    s = A.pow(2).sum(-1).transpose(1, 2)
    torch.testing.assert_close(amp, s.rsqrt())
    torch.testing.assert_close(att, (s.amin(dim=1, keepdim=True) / s).sqrt())
    assert bool((amp >= 1 - 1e-6).all()) and bool((att <= 1 + 1e-6).all())


MODES = ["amplify", "attenuate", "position_amplify", "position_attenuate"]
N_CTX = 16  # _model's n_ctx


def _expected_factor(mode, pattern):
    """The mode's multiplier of z, ``[batch, pos, head, 1]``, written out from the variant's docstring table."""
    s = pattern.pow(2).sum(-1).transpose(1, 2)[..., None]  # (B, T, H, 1)
    t1 = torch.arange(1, pattern.shape[-1] + 1, dtype=torch.float32)[None, :, None, None].expand_as(s)
    return {"amplify": 1 / s.sqrt(), "attenuate": (1 / N_CTX / s).sqrt(),
            "position_amplify": t1.sqrt(), "position_attenuate": (t1 / N_CTX).sqrt()}[mode]


@pytest.mark.parametrize("family,mode", [("llama", m) for m in MODES] + [("gpt2", "amplify"), ("gpt2", "position_attenuate")])
def test_variant_fast_path_equals_explicit_path_and_the_hooks(family, mode):
    gqa = {"n_kv_heads": 2} if family == "llama" else {}  # grouped-query attention on the llama side
    model = _model("variance_calibrated", family=family, variant_options={"mode": mode}, **gqa)
    tokens = torch.randint(0, 2048, (3, 12), generator=torch.Generator().manual_seed(0))
    fast = model(tokens)
    assert not model.blocks[0].attn.needs_explicit()
    names = {f"blocks.{l}.attn.{s}" for l in range(2) for s in ("hook_pattern", "hook_z", "hook_z_calibrated")}
    with torch.no_grad():
        explicit, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)
    for layer in range(2):
        pattern, z = cache[f"blocks.{layer}.attn.hook_pattern"], cache[f"blocks.{layer}.attn.hook_z"]
        expected = z * _expected_factor(mode, pattern)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_z_calibrated"], expected, atol=1e-6, rtol=1e-5)
    # gradients agree between the paths
    model.zero_grad()
    model(tokens, return_type="loss").backward()
    g_fast = model.blocks[0].attn.W_K.grad.clone()
    model.zero_grad()
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda a, hook: None)]):
        model(tokens, return_type="loss").backward()
    torch.testing.assert_close(model.blocks[0].attn.W_K.grad, g_fast, atol=1e-6, rtol=1e-4)
    assert model.head_output_site == "attn.hook_z_calibrated"
    if mode == "amplify":  # a baseline model with the same weights plus the amplify hooks computes the same logits
        base = _model("baseline", family=family, **gqa)
        base.load_state_dict(model.state_dict())
        with torch.no_grad():
            hooked = base.run_with_hooks(tokens, fwd_hooks=variance_calibration(base))
        torch.testing.assert_close(hooked, fast.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_cancels_the_uniform_attention_law(mode):
    """Layer 0 with W_Q = 0 attends uniformly, so Var(z_t) = σ²/(t+1); every mode makes it flat, at its level."""
    model = _model("variance_calibrated", family="llama", variant_options={"mode": mode})
    with torch.no_grad():
        model.blocks[0].attn.W_Q.zero_()
    tokens = torch.randint(0, 2048, (1024, N_CTX), generator=torch.Generator().manual_seed(1))
    names = {"blocks.0.attn.hook_z", "blocks.0.attn.hook_z_calibrated"}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    raw = cache["blocks.0.attn.hook_z"].var(dim=0).mean(-1)  # (pos, head): variance over sequences, mean over d_head
    cal = cache["blocks.0.attn.hook_z_calibrated"].var(dim=0).mean(-1)
    assert float((raw[0] / raw[-1]).min()) > 10  # ~16 = n_ctx before calibration
    level = raw[0] if mode.endswith("amplify") else raw[0] / N_CTX  # σ² (first token's) or σ²/n_ctx (last one's)
    ratio = cal / level
    assert float((ratio - 1).abs().max()) < 0.2, ratio


@pytest.mark.parametrize("mode", MODES)
def test_calibration_is_causal(mode):
    """Changing the tokens after position 5 leaves every calibrated head output at positions <= 5 unchanged."""
    model = _model("variance_calibrated", family="llama", variant_options={"mode": mode})
    a = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(2))
    b = a.clone()
    b[:, 6:] = torch.randint(0, 2048, (2, 6), generator=torch.Generator().manual_seed(3))
    name = "blocks.1.attn.hook_z_calibrated"
    with torch.no_grad():
        za = model.run_with_cache(a, names_filter=lambda n: n == name)[1][name]
        zb = model.run_with_cache(b, names_filter=lambda n: n == name)[1][name]
    torch.testing.assert_close(za[:, :6], zb[:, :6], atol=1e-6, rtol=1e-5)
    assert float((za[:, 6:] - zb[:, 6:]).abs().max()) > 1e-3  # and the later ones do change


def test_unknown_mode_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="'sideways'.*|position_amplify"):
        _model("variance_calibrated", variant_options={"mode": "sideways"})
