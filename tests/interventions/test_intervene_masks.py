"""Mask interventions change exactly the intended hook_pattern entries (renormalised over what stays)."""

import pytest
import torch

from sinklens.interventions import block_keys, custom_mask, restart, self_only

pytestmark = pytest.mark.models

P0 = "blocks.0.attn.hook_pattern"
P1 = "blocks.1.attn.hook_pattern"


def renormalised(clean, allowed):
    """The analytic post-mask pattern: clean softmax restricted to allowed keys, renormalised."""
    kept = clean * allowed
    return kept / kept.sum(dim=-1, keepdim=True)


def check(capture, model, toks, hooks, allowed0):
    clean = capture(model, toks, [P0])[P0]
    got = capture(model, toks, [P0, P1], hooks)
    torch.testing.assert_close(got[P0], renormalised(clean, allowed0), rtol=1e-5, atol=1e-6)
    assert torch.all(got[P0][~allowed0.expand_as(got[P0])] == 0)  # masked entries exactly 0
    for name in (P0, P1):
        torch.testing.assert_close(got[name].sum(-1), torch.ones_like(got[name].sum(-1)))
    return got


def test_self_only(tiny, toks, capture):
    n = toks.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[5] = False
    allowed[5, 5] = True
    got = check(capture, tiny, toks, self_only(tiny, positions=5, layers=[0]), allowed)
    assert torch.all(got[P0][:, :, 5, 5] == 1)


def test_restart(tiny, toks, capture):
    n, k = toks.shape[1], 4
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[k:, :k] = False
    got = check(capture, tiny, toks, restart(tiny, positions=k, layers=0), allowed)
    assert float(got[P0][:, :, k:, :k].abs().max()) == 0.0
    # query k now attends only to itself, like a first token
    assert torch.all(got[P0][:, :, k, k] == 1)


def test_block_keys_removes_sink(tiny, toks, capture):
    n = toks.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[1:, 0] = False
    check(capture, tiny, toks, block_keys(tiny, positions=0, layers=[0]), allowed)


def test_heads_restricts_to_those_heads(tiny, toks, capture):
    clean = capture(tiny, toks, [P0])[P0]
    got = capture(tiny, toks, [P0], block_keys(tiny, positions=0, layers=[0], heads=[1]))[P0]
    torch.testing.assert_close(got[:, [0, 2, 3]], clean[:, [0, 2, 3]])
    assert float(got[:, 1, 1:, 0].abs().max()) == 0.0


def test_custom_mask_matches_analytic(tiny, toks, capture):
    n = toks.shape[1]
    gen = torch.Generator().manual_seed(3)
    allowed = torch.rand(n, n, generator=gen) > 0.4
    allowed |= torch.eye(n, dtype=torch.bool)
    check(capture, tiny, toks, custom_mask(tiny, allowed, layers=[0]), allowed & torch.ones(n, n, dtype=torch.bool).tril())
    per_head = allowed.expand(tiny.cfg.n_heads, n, n).clone()
    per_head[0] = torch.ones(n, n, dtype=torch.bool)
    got = capture(tiny, toks, [P0], custom_mask(tiny, per_head, layers=[0]))[P0]
    torch.testing.assert_close(got[:, 0], capture(tiny, toks, [P0])[P0][:, 0])


def test_hooks_do_not_mutate_their_input(tiny):
    ((name, fn),) = self_only(tiny, positions=2, layers=[0])
    scores = torch.randn(1, tiny.cfg.n_heads, 6, 6)
    before = scores.clone()
    out = fn(scores, hook=None)
    assert torch.equal(scores, before) and out is not scores
    assert name == "blocks.0.attn.hook_attn_scores"


def test_kv_cache_shaped_scores_use_absolute_positions(tiny):
    """With 1 query over 6 keys (generation), the query is position 5."""
    ((_, fn),) = block_keys(tiny, positions=0, layers=[0])
    out = fn(torch.zeros(1, tiny.cfg.n_heads, 1, 6), hook=None)
    assert torch.isinf(out[..., 0]).all() and torch.isfinite(out[..., 1:]).all()


def test_errors(tiny, toks):
    with pytest.raises(ValueError, match="out of range"):
        self_only(tiny, positions=tiny.cfg.n_ctx)
    with pytest.raises(ValueError, match="out of range"):
        restart(tiny, positions=-1)
    with pytest.raises(ValueError, match="(?i)layer 5 is out of range"):
        block_keys(tiny, positions=0, layers=[5])
    with pytest.raises(ValueError, match="(?i)head 9"):
        block_keys(tiny, positions=0, heads=[9])
    with pytest.raises(ValueError, match="sequence of 12 tokens"):
        tiny.run_with_hooks(toks, fwd_hooks=self_only(tiny, positions=20))
    with pytest.raises(ValueError, match="bool tensor"):
        custom_mask(tiny, torch.ones(12, 12))
    with pytest.raises(ValueError, match="shape"):
        custom_mask(tiny, torch.ones(12, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        custom_mask(tiny, torch.ones(3, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="12 positions"):
        tiny.run_with_hooks(toks, fwd_hooks=custom_mask(tiny, torch.ones(8, 8, dtype=torch.bool)))
    no_row = torch.ones(12, 12, dtype=torch.bool)
    no_row[3, :4] = False
    with pytest.raises(ValueError, match="no visible key"):
        tiny.run_with_hooks(toks, fwd_hooks=custom_mask(tiny, no_row))


def test_a_mask_under_kv_cached_generation_acts_or_refuses(tiny_llama):
    """The TransformerLens 4.x bridge shows a cached generate() step's hook_attn_scores only the new key ([.., 1, 1]):
    block_keys(0) then left every cached step unmasked, in silence (restart at 4 said 'out of range for a sequence
    of 1 tokens'). A bridge now refuses; TransformerLens 3.x, whose scores hold every cached key, masks them."""
    from sinklens.errors import InvalidArgumentError

    tokens = torch.tensor([[0, 5, 9, 17, 33, 41]])
    kw = dict(max_new_tokens=4, do_sample=False, verbose=False, prepend_bos=False, stop_at_eos=False)
    with tiny_llama.hooks(fwd_hooks=block_keys(tiny_llama, positions=0)):
        masked = tiny_llama.generate(tokens, use_past_kv_cache=False, **kw)
    logits = tiny_llama.run_with_hooks(tokens, fwd_hooks=block_keys(tiny_llama, positions=0))
    assert int(masked[0, 6]) == int(logits[0, -1].argmax())  # each step sees the whole masked prefix
    with tiny_llama.hooks(fwd_hooks=block_keys(tiny_llama, positions=0)):
        if getattr(tiny_llama, "original_model", None) is not None:  # a bridge
            with pytest.raises(InvalidArgumentError, match=r"one query and one key after a forward of 6 keys: a "
                                                           r"generate\(\) step with a KV cache.*use_past_kv_cache=False"):
                tiny_llama.generate(tokens, use_past_kv_cache=True, **kw)
        else:
            assert torch.equal(tiny_llama.generate(tokens, use_past_kv_cache=True, **kw), masked)
