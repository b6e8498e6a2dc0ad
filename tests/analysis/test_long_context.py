"""context_sweep (sinklens.analysis.long_context) against the attention pattern, its text source, and a planted sink."""

import pytest
import torch

from sinklens import RunOptions
from sinklens.analysis import long_context
from sinklens.analysis.long_context import context_sweep
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import PATTERN, hook_name
from sinklens.prompts import stdlib_source_tokens
from sinklens.testing import planted_model, tiny_model, word_tokenizer

OPTS = RunOptions(progress=False)


def test_stdlib_source_tokens_give_exactly_the_count_asked_and_repeat():
    tok = word_tokenizer(64)
    ids = stdlib_source_tokens(tok, 5000)
    assert len(ids) == 5000 and ids == stdlib_source_tokens(tok, 5000)
    assert stdlib_source_tokens(tok, 37) == ids[:37]


def test_sweep_equals_the_pattern_at_two_lengths(monkeypatch):
    model, _ = planted_model(qk_layer=1)  # head (1, 1) attends to BOS: a sink rate of 1/8
    text = torch.randint(2, 64, (63,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(long_context, "stdlib_source_tokens", lambda tok, n: text[:n])
    sweep = context_sweep(model, [16, 64], options=OPTS)
    for point in sweep.points:
        tokens = torch.tensor([[0] + text[: point.length - 1]])
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(PATTERN))
        pattern = torch.stack([cache[hook_name(i, PATTERN)][0] for i in range(2)])  # [layer, head, query, key]
        to_first = pattern[..., 0]  # [layer, head, query]
        assert point.sink_attention == pytest.approx(float(to_first[..., 1:].mean()), abs=1e-5)
        assert point.sink_rate == pytest.approx(float((to_first.mean(-1) > 0.3).float().mean()), abs=1e-5)
        assert 0 < point.sink_rate < 1


def test_residual_sinks_are_dims_massive_on_most_tokens():
    model, spec = planted_model()  # massive in spec.dim at position 0 only, from stream spec.layer + 1

    def loud(x, hook):
        x = x.clone()
        x[:, :, 3] = 1000.0  # every token
        x[:, 1:9, 4] = 1000.0  # 8 of the 31 tokens after the first
        return x

    sweep = context_sweep(model, [32], abs_threshold=None, rel_threshold=50.0, most_tokens=0.2,
                          options=OPTS.replace(extra_hooks=[(hook_name(1, "hook_resid_pre"), loud)]))
    found = {(r["stream"], r["dim"]): r["share"] for r in sweep.points[0].residual_sinks}
    assert found[(1, 3)] == 1.0 and found[(1, 4)] == pytest.approx(8 / 31)
    assert (spec.layer + 1, spec.dim) not in found  # massive at position 0 only


def test_planted_secondary_sink_is_found_at_its_position():
    model, at = tiny_model("gpt2"), 20

    def same_query(q, hook):  # every query points along (1, ..., 1)
        return torch.ones_like(q)

    def loud_key(k, hook):  # the key at `at` points there too, 20 times over: every later query attends to it
        k = k.clone()
        k[:, at] = 20.0
        return k

    hooks = [(hook_name(i, s), f) for i in range(2) for s, f in (("attn.hook_q", same_query), ("attn.hook_k", loud_key))]
    planted = context_sweep(model, [48], options=OPTS.replace(extra_hooks=hooks)).points[0]
    assert planted.secondary_sinks[0]["position"] == at and planted.secondary_sinks[0]["head_share"] == 1.0
    assert at not in [s["position"] for s in context_sweep(model, [48], options=OPTS).points[0].secondary_sinks]


def test_lengths_outside_the_context_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match=r"length 65 is outside 2\.\.64, the model's context"):
        context_sweep(tiny_model(), [16, 65], options=OPTS)
