"""Query-key locking (sinklens.analysis.qk_locking)."""

import json

import pytest
import torch

from sinklens.analysis.qk_locking import QKLockingReducer, query_key_locking
from sinklens.inputs import as_batches
from sinklens.streaming import stream
from sinklens.testing import QUIET
from support.checks import PLANTED_PROMPTS

pytestmark = pytest.mark.models

PROMPTS = PLANTED_PROMPTS


def test_query_key_locking_planted(planted_mechanisms):
    model, spec = planted_mechanisms
    lock = query_key_locking(model, PROMPTS, options=QUIET.replace(batch_size=2))
    for name in ("key_query_energy", "key_pc_cosine", "pc_energy", "pos_share_sink", "pos_share_other"):
        t = getattr(lock, name)
        assert t.shape == (3, model.cfg.n_heads)
        assert torch.isfinite(t).all() and (t >= 0).all() and (t <= 1 + 1e-5).all(), name
    L, h = spec.qk_layer, spec.qk_head
    assert lock.pos_share_sink[L, h] == 1.0
    assert lock.pos_share_sink[L, h] > lock.pos_share_other[L, h]
    assert lock.mean_score_sink[L, h] > 5 * lock.mean_score_other[L, h].abs()
    assert lock.key_pc_cosine[L, h] > 0.9
    assert lock.key_query_energy[L, h] > 0.8
    assert lock.mean_score_sink[L, h] > lock.mean_score_other[L, h]
    assert len(lock.rows()) == 3 * model.cfg.n_heads
    json.dumps(lock.to_dict(), allow_nan=False)


def test_query_key_locking_streaming_equals_full_cache(tiny):
    batches = as_batches(tiny, PROMPTS, batch_size=2)
    (got,) = stream(tiny, batches, [QKLockingReducer(tiny, n_components=2)], options=QUIET)
    rotary = "blocks.0.attn.hook_rot_q" in tiny.hook_dict
    qn, kn = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
    L, H, dh = tiny.cfg.n_layers, tiny.cfg.n_heads, tiny.cfg.d_head
    gram, key_sum = torch.zeros(L, H, dh, dh, dtype=torch.float64), torch.zeros(L, H, dh, dtype=torch.float64)
    along, total = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    pos_s, pos_o, n_s, n_o = torch.zeros(L, H), torch.zeros(L, H), 0, 0
    for prompt in PROMPTS:
        _, cache = tiny.run_with_cache(tiny.to_tokens(prompt))
        for layer in range(L):
            q = cache[f"blocks.{layer}.attn.{qn}"][0].double()  # [pos, head, d_head]
            k = cache[f"blocks.{layer}.attn.{kn}"][0].double()
            k = k.repeat_interleave(H // k.shape[1], dim=1)
            scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][0]  # [head, q, k]
            for h in range(H):
                k0 = k[0, h]
                key_sum[layer, h] += k0
                for t in range(1, q.shape[0]):
                    gram[layer, h] += torch.outer(q[t, h], q[t, h])
                    along[layer, h] += (q[t, h] @ k0 / k0.norm()) ** 2
                    total[layer, h] += q[t, h] @ q[t, h]
                    pos_s[layer, h] += float(scores[h, t, 0] > 0)
                    pos_o[layer, h] += float((scores[h, t, 1 : t + 1] > 0).sum())
        n = cache["blocks.0.attn.hook_pattern"].shape[-1]
        n_s += n - 1
        n_o += sum(range(1, n))
    torch.testing.assert_close(got.key_query_energy, (along / total).float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.pos_share_sink, pos_s / n_s)
    torch.testing.assert_close(got.pos_share_other, pos_o / n_o)
    evals, evecs = torch.linalg.eigh(gram)
    unit = key_sum / key_sum.norm(dim=-1, keepdim=True)
    cos = torch.einsum("lhi,lhir->lhr", unit, evecs[..., -2:]).norm(dim=-1)
    torch.testing.assert_close(got.key_pc_cosine, cos.float(), rtol=1e-3, atol=1e-4)
    assert got.n_queries == n_s


@pytest.mark.parametrize("family, sink_position", [("llama", 1), ("gemma2", 0)])
def test_mean_scores_leave_queries_that_cannot_see_the_sink_out(family, sink_position):
    """TransformerLens 3.x writes -inf into hook_attn_scores where a query cannot see a key (query 0 against key 1,
    a query past gemma2's sliding window), and ``-inf * 0`` made mean_score_sink NaN for every head there."""
    from support.zoo import zoo_model

    model = zoo_model(family)
    s = sink_position
    lock = query_key_locking(model, PROMPTS, sink_position=s, options=QUIET.replace(batch_size=3))
    L, H = model.cfg.n_layers, model.cfg.n_heads
    total, count = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, dtype=torch.float64)
    skipped = 0
    for prompt in PROMPTS:
        _, cache = model.run_with_cache(model.to_tokens(prompt))
        for layer in range(L):
            scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][0].double()  # [head, q, k]
            for t in range(s + 1, scores.shape[1]):
                if bool((scores[:, t, s] < -1e30).all()):  # masked: -inf on 3.x, the dtype's minimum on 4.x
                    skipped += 1
                    continue
                total[layer] += scores[:, t, s]
                count[layer] += 1
    assert skipped > 0 or s > 0  # the case at stake: some query cannot see the sink (window), or query 0 (s = 1)
    assert bool(torch.isfinite(lock.mean_score_sink).all())
    torch.testing.assert_close(lock.mean_score_sink.double(), total / count[:, None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_components=0), "n_components"),
        (dict(sink_position=5), "sink_position=5"),
        (dict(layers=[9]), "out of range"),
    ],
)
def test_bad_inputs_raise_clear_errors(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        query_key_locking(tiny_llama, ["t3 t4 t5"], options=QUIET, **kwargs)
