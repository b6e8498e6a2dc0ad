"""Variance interventions against their formulas: α = 1 is the identity, x ← μ + α(x − μ), calibration."""

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.inputs import random_token_batches
from sinklens.interventions import amplify, calibrate, clear_reference_cache, reference_mean

pytestmark = pytest.mark.models

Z0 = "blocks.0.attn.hook_z"


@pytest.mark.parametrize("site", ["attn.hook_z", "attn.hook_v", "hook_attn_out", "hook_resid_pre"])
@pytest.mark.parametrize("reference", ["random", "batch"])
def test_alpha_one_is_identity(tiny, toks, site, reference):
    reference_kw = dict(n_sequences=4, seq_len=16) if reference == "random" else {}  # reference_mean options
    hooks = amplify(tiny, positions=[3, 7], alpha=1.0, site=site, reference=reference, **reference_kw)
    with torch.inference_mode():
        assert torch.equal(tiny.run_with_hooks(toks, fwd_hooks=hooks), tiny(toks))


def test_reference_mean_matches_full_cache_and_is_cached(tiny):
    clear_reference_cache(tiny)
    means = reference_mean(tiny, site="attn.hook_z", n_sequences=6, seq_len=10, seed=2)
    assert reference_mean(tiny, site="attn.hook_z", n_sequences=6, seq_len=10, seed=2) is means
    (batch,) = random_token_batches(tiny, n_sequences=6, seq_len=10, seed=2, batch_size=6)
    _, cache = tiny.run_with_cache(batch.tokens, names_filter=lambda n: n.endswith("attn.hook_z"))
    for layer in range(tiny.cfg.n_layers):
        ref = cache[f"blocks.{layer}.attn.hook_z"][:, 1:].double().mean(dim=(0, 1)).float()
        torch.testing.assert_close(means[layer], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.5, 4.0])
def test_amplify_formula(tiny, toks, capture, alpha):
    mu = torch.randn(tiny.cfg.n_heads, tiny.cfg.d_model // tiny.cfg.n_heads)
    clean = capture(tiny, toks, [Z0])[Z0]
    got = capture(tiny, toks, [Z0], amplify(tiny, positions=4, alpha=alpha, layers=[0], reference={0: mu}))[Z0]
    torch.testing.assert_close(got[:, 4], mu + alpha * (clean[:, 4] - mu), rtol=1e-5, atol=1e-6)
    others = [p for p in range(toks.shape[1]) if p != 4]
    assert torch.equal(got[:, others], clean[:, others])


def test_amplify_heads_and_batch_reference(tiny, toks, capture):
    clean = capture(tiny, toks, [Z0])[Z0]
    got = capture(tiny, toks, [Z0], amplify(tiny, positions=4, alpha=3.0, layers=[0], heads=[2], reference="batch"))[Z0]
    keep = [p for p in range(1, toks.shape[1]) if p != 4]
    mu = clean[:, keep].mean(dim=1)
    torch.testing.assert_close(got[:, 4, 2], mu[:, 2] + 3.0 * (clean[:, 4, 2] - mu[:, 2]), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, 4, [0, 1, 3]], clean[:, 4, [0, 1, 3]])


def test_calibrate_gives_the_sink_typical_deviation(tiny, toks, capture):
    clean = capture(tiny, toks, [Z0])[Z0]
    got = capture(tiny, toks, [Z0], calibrate(tiny, positions=0, layers=[0]))[Z0]
    others = clean[:, 1:]
    mu = others.mean(dim=1)  # [batch, head, d_head]
    rms = (others - mu[:, None]).norm(dim=-1).pow(2).mean(dim=1).sqrt()  # [batch, head]
    dev = got[:, 0] - mu
    torch.testing.assert_close(dev.norm(dim=-1), rms, rtol=1e-4, atol=1e-6)
    cos = torch.nn.functional.cosine_similarity(dev, clean[:, 0] - mu, dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos), rtol=1e-4, atol=1e-4)
    assert torch.equal(got[:, 1:], clean[:, 1:])


def test_hook_does_not_mutate_input(tiny):
    ((_, fn),) = amplify(tiny, positions=1, alpha=2.0, layers=[0], reference="batch")
    act = torch.randn(2, 5, tiny.cfg.n_heads, 4)
    before = act.clone()
    out = fn(act, hook=type("H", (), {"name": Z0})())
    assert torch.equal(act, before) and not torch.equal(out, act)


def test_errors(tiny, toks):
    for bad in (0, -1.0, 0.0):
        with pytest.raises(ValueError, match="alpha must be a number > 0"):
            amplify(tiny, positions=1, alpha=bad, reference="batch")
    with pytest.raises(InvalidArgumentError, match="did you mean"):
        amplify(tiny, positions=1, alpha=2.0, site="attn.hook_zz", reference="batch")
    with pytest.raises(InvalidArgumentError):
        calibrate(tiny, site="hook_nothing")
    with pytest.raises(ValueError, match="out of range"):
        amplify(tiny, positions=999, alpha=2.0, reference="batch")
    with pytest.raises((ValueError, TypeError)):  # ValueError; under pytest the Literal type check fires first
        amplify(tiny, positions=1, alpha=2.0, reference="mean")
    with pytest.raises(ValueError, match="heads= needs a per-head site"):
        tiny.run_with_hooks(toks, fwd_hooks=amplify(tiny, positions=1, alpha=2.0, site="hook_resid_pre", heads=[0], reference="batch"))


def test_reference_cache_follows_in_place_weight_edits(toks, capture):
    """The cached random-token mean is keyed by a weight fingerprint: an in-place edit recomputes it."""
    from sinklens.testing import tiny_model

    model = tiny_model("llama", seed=7)  # its own model: the edits below must not leak into other tests
    kw = dict(site="attn.hook_z", n_sequences=4, seq_len=10, seed=1)
    first = reference_mean(model, **kw)
    assert reference_mean(model, **kw) is first  # same weights: a cache hit
    with torch.no_grad():  # like an optimizer step: in place, through the parameter (bumps its version)
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(1.5)
    second = reference_mean(model, **kw)
    fresh = reference_mean(model, cache=False, **kw)
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(second[layer], fresh[layer])
        assert not torch.allclose(second[layer], first[layer])
    for p in model.parameters():  # through a .data alias: no version bump, caught by the checksum
        if p.ndim == 2:
            p.data.mul_(0.5)
    third = reference_mean(model, **kw)
    torch.testing.assert_close(third[0], reference_mean(model, cache=False, **kw)[0])
    assert not torch.allclose(third[0], second[0])
    # amplify(reference="random") built after the edit uses the recomputed mean
    clean = capture(model, toks, [Z0])[Z0]
    got = capture(model, toks, [Z0], amplify(model, positions=4, alpha=3.0, layers=[0], **kw))[Z0]
    mu = third[0]
    torch.testing.assert_close(got[:, 4], mu + 3.0 * (clean[:, 4] - mu), rtol=1e-5, atol=1e-6)
