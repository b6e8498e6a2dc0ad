"""Results do not depend on the batch size or the padding side (padded batches are right-aligned; encoders run them
with an attention mask, causal models without one: their pads follow every real token)."""

import pytest
import torch

from sinklens.analysis.qk_locking import qk_locking_reason, query_key_locking
from sinklens.analysis.sinks import find_sinks
from sinklens.errors import InvalidArgumentError
from sinklens.inputs import TokenBatch, as_batches, right_align
from sinklens.testing import QUIET, transformer_lens_major
from support.zoo import FamilyUnavailableError, zoo_model

pytestmark = pytest.mark.models

PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t14 t15 t16", "t17 t18 t19 t20 t21 t22 t23 t24 t25 t26 t27",
           "t28 t29 t30 t31 t32 t33", "t34 t35", "t36 t37 t38 t39 t40 t41 t42", "t43 t44 t45 t46"]


def _left_padded(batch: TokenBatch, pad_id: int = 1) -> TokenBatch:
    """The same sequences with their padding moved to the left (as a left-padding tokenizer gives them)."""
    n = batch.tokens.shape[1]
    tokens = torch.full_like(batch.tokens, pad_id)
    valid = torch.zeros_like(batch.valid)
    for i, length in enumerate(batch.lengths.tolist()):
        tokens[i, n - length :] = batch.tokens[i, :length]
        valid[i, n - length :] = True
    return TokenBatch(tokens, valid, batch.prepend_bos, batch.special_tokens)


def _numbers(model, batches):
    """Sink numbers, and query-key locking's where the model allows it (the TransformerLens 4.x BERT bridge
    fires hook_attn_scores after the fact: tests/zoo/test_zoo_interventions.py)."""
    sinks = find_sinks(model, batches, sink_threshold=0.25, options=QUIET)
    numbers = {
        "received": sinks.received, "gu": sinks.gu_seq_sink_frac, "sinklens": sinks.seq_sink_frac,
        "n_queries": sinks.n_queries_by_layer, "first_tokens": sinks.first_tokens.mean_received,
        "unattended": sinks.unattended,
    }
    if qk_locking_reason(model) is None:
        lock = query_key_locking(model, batches, sink_position=0, options=QUIET)
        numbers |= {"pos_share_sink": lock.pos_share_sink, "mean_score_sink": lock.mean_score_sink,
                    "mean_score_other": lock.mean_score_other, "key_query_energy": lock.key_query_energy}
    return numbers


def _family(name):
    try:
        return zoo_model(name)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("family", ["llama", "gemma2", "bert"])
def test_results_do_not_depend_on_batch_size_or_padding_side(family):
    model = _family(family)
    reference = _numbers(model, as_batches(model, PROMPTS, batch_size=1))
    for batch_size in (3, 8):
        right = as_batches(model, PROMPTS, batch_size=batch_size)
        assert any(not bool(b.valid.all()) for b in right)  # really padded
        for side, batches in (("right", right), ("left", [_left_padded(b) for b in right])):
            got = _numbers(model, batches)
            for name, value in reference.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, equal_nan=True,
                                           msg=lambda m, n=name, s=side, bs=batch_size: f"{n} ({s} padding, batch {bs}): {m}")


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_float64_sliding_window_model_gives_the_same_numbers_padded(family):
    """With an attention mask, a pad query past the window sees no key; in float64 the attention turns that row
    into NaN, whose values then reach real queries through the additive mask (gemma2 Gu rate 0.875 → 0.375,
    received NaN). A causal model now runs a right-aligned batch without a mask: its pads follow every real token."""
    model = _family(family).to(torch.float64)
    reference = _numbers(model, as_batches(model, PROMPTS, batch_size=1))
    got = _numbers(model, as_batches(model, PROMPTS, batch_size=8))
    assert bool(torch.isfinite(reference["received"]).all())
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


def test_right_align_moves_left_padding_and_refuses_holes():
    b = as_batches(zoo_model("llama"), PROMPTS[:3], batch_size=3)[0]
    aligned = right_align(_left_padded(b))
    assert torch.equal(aligned.valid, b.valid)
    assert torch.equal(aligned.tokens[aligned.valid], b.tokens[b.valid])
    assert right_align(b) is b
    holed = TokenBatch(b.tokens, b.valid.clone(), True)
    holed.valid[0, 1] = False
    with pytest.raises(InvalidArgumentError, match="hole"):
        right_align(holed)


@pytest.mark.skipif(transformer_lens_major() < 4, reason="BERT is a TransformerLens 4 zoo family")
def test_encoder_real_queries_never_attend_to_padding():
    """In BERT a padded batch without the mask would let real queries attend to [PAD] keys."""
    model = zoo_model("bert")
    sinks = find_sinks(model, PROMPTS, options=QUIET.replace(batch_size=8))
    lengths = [b.lengths for b in as_batches(model, PROMPTS, batch_size=8)][0]
    # Every real key's received attention is finite and the real queries' rows sum to 1 over real keys only.
    assert float(sinks.unattended.abs().max()) < 1e-5
    assert int(sinks.n_queries[0]) == int(lengths.sum()) - len(PROMPTS)  # min_query=1 drops each query 0


@pytest.mark.parametrize("variant", ["baseline", "sink_logit"])
def test_sinklens_own_model_runs_padded_batches_without_a_mask(variant):
    """SinkLM takes no attention_mask: causal and right-aligned, its pads come after every real token."""
    from sinklens.sinklm.config import ModelConfig
    from sinklens.sinklm.model import SinkLM

    torch.manual_seed(0)
    model = SinkLM(ModelConfig(family="llama", variant=variant, n_layers=2, d_model=16, n_heads=4, n_kv_heads=2,
                               d_mlp=32, n_ctx=16, d_vocab=32)).eval()
    rows = [torch.randint(2, 32, (n,)) for n in (9, 3, 12, 5)]
    width = max(r.numel() for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, width - r.numel():], valid[i, width - r.numel():] = r, True  # left-padded
    padded = find_sinks(model, TokenBatch(tokens, valid, False), options=QUIET)
    singles = find_sinks(model, [TokenBatch(r[None], torch.ones(1, r.numel(), dtype=torch.bool), False) for r in rows],
                         options=QUIET)
    torch.testing.assert_close(padded.received, singles.received, rtol=0, atol=1e-6, equal_nan=True)
    assert (padded.virtual_sink is not None) == (variant == "sink_logit")
    if variant == "sink_logit":
        torch.testing.assert_close(padded.virtual_sink, singles.virtual_sink, rtol=0, atol=1e-6)
        assert float(padded.virtual_sink.min()) > 0.0
