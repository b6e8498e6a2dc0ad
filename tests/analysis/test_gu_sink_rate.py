"""``SinkResult.sink_rate(method="gu")`` is Gu et al.'s number exactly as their code computes it.

Gu et al., "When Attention Sink Emerges in Language Models" (ICLR 2025), github.com/sail-sg/Attention-Sink,
``eval_sink_open_source.py::compute_attention_sink``: with ``A [sample, layer, head, query, key]`` of
equal-length sequences, ``importance = (A / ratios).sum(dim=-2)`` where ``ratios[k] = T - k`` (the number
of queries that see key ``k``, the key's own query included) and the rate of token ``k`` is
``(importance > ε).float().mean(dim=(0, 1, 2))``. Written out here from plain Hugging Face attentions.
"""

import pytest
import torch
from _hf_reference import hf_attentions, real_sequences, visible_by_hand

from sinklens.analysis.sink_result import RATE_DEFINITIONS
from sinklens.analysis.sinks import find_sinks
from sinklens.inputs import as_batches
from sinklens.testing import QUIET, transformer_lens_major
from support.zoo import zoo_hf_model, zoo_model

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(transformer_lens_major() < 4, reason="zoo_model is HF-weighted only on TransformerLens 4"),
]

EQUAL = ["t5 t6 t7 t8 t9 t10 t11", "t12 t13 t14 t15 t16 t17 t18", "t20 t21 t22 t23 t24 t25 t26",
         "t30 t31 t32 t33 t34 t35 t36", "t40 t41 t42 t43 t44 t45 t46"]
UNEQUAL = ["t5 t6 t7 t8 t9 t10 t11 t12 t13 t14", "t12 t13", "t20 t21 t22 t23 t24", "t30 t31 t32 t33 t34 t35 t36"]
EPS = 0.25


def _split(values: torch.Tensor) -> float:
    """The midpoint of the widest gap between sorted values near the median (a threshold no value is close to)."""
    v = values.flatten().sort().values
    mid = v.numel() // 2
    lo = max(1, mid - v.numel() // 4)
    gaps = v[lo : mid + v.numel() // 4] - v[lo - 1 : mid + v.numel() // 4 - 1]
    i = lo + int(gaps.argmax())
    return float((v[i - 1] + v[i]) / 2)


def test_gu_sink_rate_equals_their_code_on_equal_length_sequences():
    model = zoo_model("llama")
    hf = zoo_hf_model("llama")
    seqs = real_sequences(as_batches(model, EQUAL))
    A = torch.stack([torch.stack(hf_attentions(hf, ids)) for ids in seqs])  # [sample, layer, head, q, k]
    T = A.shape[-1]
    ratios = torch.arange(T, 0, -1)[None, None, None, :].expand(A.shape[:-1] + (T,)).to(A)
    importance = (A / ratios).sum(dim=-2)
    eps = _split(importance[..., 0])  # a threshold that splits key 0's heads, away from every value
    metric1 = (importance > eps).to(torch.float).mean(dim=(0, 1, 2))
    assert 0.2 < float(metric1[0]) < 0.8

    got = find_sinks(model, EQUAL, sink_threshold=eps, options=QUIET.replace(batch_size=2))
    torch.testing.assert_close(got.sink_rate_by_position(method="gu"), metric1, rtol=0, atol=1e-6)
    assert got.sink_rate(position=0) == pytest.approx(float(metric1[0]), abs=1e-6)  # "gu" is the default

    # sinklens' variant leaves out key 0's own query (min_query=1): the mean over queries 1..T-1, lower.
    own0 = (A[..., 1:, 0].mean(dim=-1) > eps).float().mean()
    assert float(own0) < float(metric1[0])
    assert got.sink_rate(position=0, method="sinklens") == pytest.approx(float(own0), abs=1e-6)
    assert got.to_dict()["sink_rate_definitions"]["gu_sink_rate"] == RATE_DEFINITIONS["gu"]


@pytest.mark.parametrize("family", ["llama", "mistral", "bert"])
def test_gu_sink_rate_per_sequence_with_padding_and_windows(family):
    """Unequal lengths (padded batches) and sliding windows / encoders: per sequence, the mean over the
    queries that can see the key (own included), thresholded, averaged over the sequences containing it."""
    model = zoo_model(family)
    hf = zoo_hf_model(family)
    seqs = real_sequences(as_batches(model, UNEQUAL))
    width = max(s.numel() for s in seqs)
    hits = torch.zeros(width, dtype=torch.float64)
    present = torch.zeros(width, dtype=torch.float64)
    for ids in seqs:
        n = ids.numel()
        att = hf_attentions(hf, ids)
        for layer, a in enumerate(att):
            seen = visible_by_hand(hf.config, layer, n, encoder=family == "bert").double()
            alpha = (a * seen).sum(dim=1) / seen.sum(dim=0)  # [head, key]
            hits[:n] += (alpha > EPS).double().sum(dim=0)
        present[:n] += len(att) * model.cfg.n_heads
    ref = hits / present
    got = find_sinks(model, UNEQUAL, sink_threshold=EPS, options=QUIET.replace(batch_size=3))
    torch.testing.assert_close(got.sink_rate_by_position(method="gu").double(), ref, rtol=0, atol=1e-6)
