import json

import pytest
import torch

from sinklens.analysis.normalized_disparity import NormalizedDisparityReducer, normalized_disparity
from sinklens.analysis.qk_locking import QKLockingReducer, query_key_locking
from sinklens.analysis.weight_super_neurons import sink_inputs, super_neurons_from_weights
from sinklens.inputs import as_batches
from sinklens.streaming import stream
from sinklens.testing import PLANTED_PROMPTS, QUIET
from sinklens.testing.planted import planted_model

pytestmark = pytest.mark.models

PROMPTS = PLANTED_PROMPTS


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def planted(request):
    kv = 2 if request.param == "llama" else None
    return planted_model(request.param, n_layers=3, n_kv_heads=kv, layer=0, neuron=7, dim=5, bos_dim=2,
                         qk_layer=2, qk_head=1, common_dim=9)


def test_weight_only_link_finds_planted_neuron(planted):
    model, spec = planted
    weights = super_neurons_from_weights(model, dims=[spec.dim])
    assert weights.top(1)[0][:2] == (spec.layer, spec.neuron)
    assert weights.align_in is None
    row = weights.neuron_row(spec.layer, spec.neuron)
    assert row["out_top_share"] == pytest.approx(1.0) and row["out_weight_5"] > 0
    # With one forward: the sink's normalised MLP input points along the planted read vector.
    linked = super_neurons_from_weights(model, dims=[spec.dim], sink_input=sink_inputs(model, PROMPTS[:2], options=QUIET))
    r = linked.layers.index(spec.layer)
    assert linked.align_in[r, spec.neuron] > 0.7
    assert linked.align_in[r].abs().argmax() == spec.neuron
    if linked.align_gate is not None:
        assert linked.align_gate[r, spec.neuron] > 0.7
    assert linked.align_in.abs().max() <= 1 + 1e-5
    json.dumps(linked.to_dict(k=3), allow_nan=False)


def test_normalized_disparity_large_at_sink_only(planted):
    model, spec = planted
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
    sink, other, n_other = torch.zeros(L, D), torch.zeros(L, D), 0
    for prompt in PROMPTS:
        _, cache = tiny.run_with_cache(tiny.to_tokens(prompt), names_filter=lambda n: n.endswith("ln1.hook_normalized"))
        for layer in range(L):
            x = cache[f"blocks.{layer}.ln1.hook_normalized"][0].abs()
            for p in range(x.shape[0]):
                for d in range(D):
                    r = x[p, d] / torch.cat([x[p, :d], x[p, d + 1 :]]).mean()
                    (sink if p == 0 else other)[layer, d] += r
        n_other += x.shape[0] - 1
    torch.testing.assert_close(got.ratio_sink, sink / len(PROMPTS), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.ratio_other, other / n_other, rtol=1e-4, atol=1e-5)


def test_query_key_locking_planted(planted):
    model, spec = planted
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


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (query_key_locking, dict(n_components=0), "n_components"),
        (query_key_locking, dict(sink_position=5), "sink_position=5"),
        (query_key_locking, dict(layers=[9]), "out of range"),
        (normalized_disparity, dict(sink_position=-1), "sink_position"),
        (sink_inputs, dict(layers=[2]), "out of range"),
    ],
)
def test_bad_inputs_raise_clear_errors(tiny_llama, fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(tiny_llama, ["t3 t4 t5"], **kwargs)


def test_weight_only_bad_dims(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        super_neurons_from_weights(tiny_llama, dims=[99])
