"""The q/k path (sinklens.analysis.qk_attention) against the pattern path, on every family of the zoo."""

import pytest
import torch

from sinklens import RunOptions
from sinklens.analysis import qk_attention
from sinklens.analysis.qk_attention import attention_to_keys
from sinklens.analysis.qk_locking import QKLockingReducer, qk_locking_reason, query_key_locking
from sinklens.analysis.sinks import SinkReducer, find_sinks
from sinklens.analysis.value_drain import ValueDrainReducer, ValueDrainSettings, measure_value_drain
from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import PATTERN, SCORES
from sinklens.inputs import TokenBatch
from sinklens.streaming import forward, stream
from support.zoo import FAMILIES, FamilyUnavailableError, zoo_model

T = 300
OPTS = RunOptions(progress=False, batch_size=3)


def _family(family, **sizes):
    try:
        return zoo_model(family, n_ctx=T, **sizes)
    except FamilyUnavailableError as e:
        pytest.skip(str(e))


def _padded_batch(n=T, seed=0):
    """Three random-token sequences of n, 7n/8 and 3n/5 tokens (right padding)."""
    toks = torch.randint(5, 64, (3, n), generator=torch.Generator().manual_seed(seed))
    valid = torch.arange(n)[None] < torch.tensor([n, n * 7 // 8, n * 3 // 5])[:, None]
    return TokenBatch(toks, valid, True)


def _diff(a, b):
    return float((torch.nan_to_num(a) - torch.nan_to_num(b)).abs().max())


def _pattern_rows(model, batch, positions):
    """``hook_pattern[..., positions]`` of every layer: ``[layer, batch, head, query, position]`` (NaN at padding)."""
    rows = {}
    hooks = [(f"blocks.{l}.{PATTERN}", lambda p, hook, l=l: rows.__setitem__(l, p[..., positions].float()))
             for l in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        forward(model, batch, return_type=None)
    w = torch.stack([rows[l] for l in range(model.cfg.n_layers)])
    return w.masked_fill(~batch.valid[None, :, None, :, None], float("nan"))


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_path_equals_the_pattern_path(family, monkeypatch):
    """Received attention, both sink rates, query counts, the learned sinks' mass and the per-query attention to
    the first keys agree to 1e-5 in float32 with padding, sliding windows (4 tokens), GQA, soft caps, sink logits.
    find_sinks runs in chunks of 64 queries, attention_to_keys in one chunk."""
    model = _family(family)
    if family == "gemma2":  # scores far beyond the soft cap (50), so that capping matters
        with torch.no_grad():
            for layer in model.original_model.model.layers:
                layer.self_attn.q_proj.weight.mul_(100.0)
                layer.self_attn.k_proj.weight.mul_(100.0)
    batch = _padded_batch()
    a = find_sinks(model, [batch], method="pattern", options=OPTS)
    with monkeypatch.context() as m:
        m.setattr(qk_attention, "CHUNK_SCORES", 1)  # the smallest chunk: 64 queries
        b = find_sinks(model, [batch], method="qk", options=OPTS)
    assert (a.attention_path, b.attention_path) == ("pattern", "qk")
    assert _diff(a.received, b.received) < 1e-5
    assert torch.equal(a.n_queries, b.n_queries) and torch.equal(a.n_queries_by_layer, b.n_queries_by_layer)
    assert _diff(a.gu_seq_sink_frac, b.gu_seq_sink_frac) == 0 and _diff(a.seq_sink_frac, b.seq_sink_frac) == 0
    assert _diff(a.unattended, b.unattended) < 1e-5
    assert (a.virtual_sink is None) == (b.virtual_sink is None) == (family != "gptoss")
    assert a.sink_positions == b.sink_positions and a.sink_rate() == b.sink_rate()
    positions = [0, 1, 5, 150]
    profile = attention_to_keys(model, [batch], positions=positions, options=OPTS)
    assert profile.shape == (model.cfg.n_layers, 3, model.cfg.n_heads, T, len(positions))
    assert torch.equal(profile.isnan(), _pattern_rows(model, batch, positions).isnan())
    assert _diff(profile, _pattern_rows(model, batch, positions)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_locking_from_queries_and_keys_equals_the_scores(family, monkeypatch):
    """Query-key locking's score statistics made from queries and keys (chunks of 64 queries) equal those read
    from hook_attn_scores: shares of positive scores, mean scores and counts, with padding, windows and GQA."""
    model = _family(family)
    reason = qk_locking_reason(model)
    if reason is not None:
        pytest.skip(reason)
    if family == "gemma2":  # beyond the soft cap
        with torch.no_grad():
            for layer in model.original_model.model.layers:
                layer.self_attn.q_proj.weight.mul_(100.0)
    batch = _padded_batch()
    try:
        qk_attention.qk_plan(model, [0], "qk")
    except UnsupportedArchitectureError as e:
        pytest.skip(str(e))
    a = query_key_locking(model, [batch], method="pattern", options=OPTS)
    monkeypatch.setattr(qk_attention, "CHUNK_SCORES", 1)
    b = query_key_locking(model, [batch], method="qk", options=OPTS)
    names = [name for name, _ in QKLockingReducer(model, method="qk").fwd_hooks(batch).hooks]
    assert not any(n.endswith((SCORES, PATTERN)) for n in names)
    assert a.n_queries == b.n_queries > 0
    for name in ("pos_share_sink", "pos_share_other"):  # a score within rounding of 0 may flip its sign
        assert _diff(getattr(a, name), getattr(b, name)) < 1e-3, name
    for name in ("mean_score_sink", "mean_score_other"):
        scale = float(getattr(a, name).abs().max()) + 1.0
        assert _diff(getattr(a, name), getattr(b, name)) < 1e-5 * scale, name
    for name in ("key_query_energy", "key_pc_cosine", "pc_energy"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_qk_path_in_bfloat16():
    """In bfloat16 the q/k path (float32 from bf16 queries and keys) stays within 2e-3 of the bf16 pattern."""
    model = _family("gemma2").to(torch.bfloat16)
    batch = _padded_batch(128)
    a = find_sinks(model, [batch], method="pattern", options=OPTS)
    b = find_sinks(model, [batch], method="qk", options=OPTS)
    assert _diff(a.received, b.received) < 2e-3


def test_qk_path_attaches_no_pattern_hook_and_auto_switches_by_length(monkeypatch):
    model = _family("llama")
    batch = _padded_batch(40)
    names = [name for name, _ in SinkReducer(model, method="qk").fwd_hooks(batch).hooks]
    assert names and not any(n.endswith(PATTERN) for n in names) and any(n.endswith("hook_rot_q") for n in names)
    assert find_sinks(model, [batch], options=OPTS).attention_path == "pattern"  # auto, 40 <= QK_ABOVE
    monkeypatch.setattr(qk_attention, "QK_ABOVE", 39)
    result = find_sinks(model, [batch], options=OPTS)
    assert result.attention_path == "qk" and result.to_dict()["attention_path"] == "qk"


def _sinklm(variant):
    from sinklens.sinklm.config import ModelConfig
    from sinklens.sinklm.model import SinkLM

    torch.manual_seed(0)
    model = SinkLM(ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=64, d_vocab=32,
                               variant=variant)).eval()
    if variant == "sink_logit":
        with torch.no_grad():
            for block in model.blocks:
                block.attn.variant.sink.copy_(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    return model


@pytest.mark.parametrize("variant", ["baseline", "sink_logit"])
def test_qk_path_on_sinklens_models(variant):
    """sinklens' own models: plain softmax (the q/k path keeps its SDPA kernel) and learned sink logits."""
    model = _sinklm(variant)
    tokens = torch.randint(2, 32, (2, 50), generator=torch.Generator().manual_seed(1))
    a = find_sinks(model, tokens, method="pattern", options=OPTS)
    b = find_sinks(model, tokens, method="qk", options=OPTS)
    assert _diff(a.received, b.received) < 1e-5 and _diff(a.gu_seq_sink_frac, b.gu_seq_sink_frac) == 0
    if variant == "sink_logit":
        assert _diff(a.virtual_sink, b.virtual_sink) < 1e-5 and float(b.virtual_sink.min()) > 0.01
    else:
        assert a.virtual_sink is None and b.virtual_sink is None


def test_qk_path_refuses_attention_that_is_not_a_softmax():
    model = _sinklm("softpick")
    tokens = torch.randint(2, 32, (1, 8))
    with pytest.raises(UnsupportedArchitectureError, match="softpick"):
        find_sinks(model, tokens, method="qk", options=OPTS)
    assert find_sinks(model, tokens, options=OPTS).attention_path == "pattern"  # auto falls back


def test_extra_hooks_on_the_pattern_keep_the_pattern_path(monkeypatch):
    """An intervention on hook_pattern acts after queries and keys: auto reads the pattern, qk refuses."""
    from sinklens.errors import InvalidArgumentError

    model = _family("llama")
    batch = _padded_batch(40)
    monkeypatch.setattr(qk_attention, "QK_ABOVE", 8)
    uniform = [(f"blocks.0.{PATTERN}", lambda p, hook: torch.tril(torch.ones_like(p)) / torch.tril(torch.ones_like(p)).sum(-1, keepdim=True))]
    opts = OPTS.replace(extra_hooks=uniform)
    result = find_sinks(model, [batch], options=opts)
    assert result.attention_path == "pattern"
    # Layer 0 now has uniform causal rows: key k gets 1/(q+1) from each real query q >= max(k, 1).
    lengths = batch.valid.sum(dim=1).tolist()
    expected = [sum(1 / (q + 1) for n in lengths for q in range(max(k, 1), n)) / sum(max(0, n - max(k, 1)) for n in lengths)
                for k in range(40)]
    torch.testing.assert_close(result.received[0], torch.tensor(expected).expand(4, 40), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="method='qk'"):
        find_sinks(model, [batch], method="qk", options=opts)


@pytest.mark.parametrize("family", ["llama", "gemma2", "bert", "gptoss"])
def test_value_drain_from_queries_and_keys_equals_the_pattern_path(family, monkeypatch):
    """Value drain read from queries and keys (64-query chunks) equals the pattern path to 1e-5 with padding, GQA,
    windows, a post-attention norm (gemma2), a post-LN encoder (bert) and learned sink logits (gptoss)."""
    from tests.analysis._hf_reference import perturb_post_attention_norms

    model = _family(family)
    perturb_post_attention_norms(family, model.original_model)
    batch = _padded_batch(seed=1)
    monkeypatch.setattr(qk_attention, "CHUNK_SCORES", 1)
    pattern, qk = (ValueDrainReducer(model, settings=ValueDrainSettings(method=m)) for m in ("pattern", "qk"))
    assert not any(name.endswith(PATTERN) for name, _ in qk.fwd_hooks(batch).hooks)
    a, b = stream(model, [batch], [pattern, qk], options=OPTS)
    assert torch.equal(pattern.n_pairs, qk.n_pairs) and torch.equal(pattern.n_q, qk.n_q)
    assert a.post_norm_layers == b.post_norm_layers == ([0, 1] if family in ("gemma2", "bert") else [])
    for name in ("attn_sink", "attn_other", "write_sink", "write_other", "write_share"):
        got, want = getattr(b, name), getattr(a, name)
        assert _diff(got, want) <= 1e-5 * max(1.0, float(want.abs().max())), name
    assert b.kinds() == a.kinds() and float(a.attn_sink.max()) > 0


def test_value_drain_keeps_the_pattern_under_an_intervention(monkeypatch):
    from sinklens.errors import InvalidArgumentError

    monkeypatch.setattr(qk_attention, "QK_ABOVE", 8)  # auto would read queries and keys without the edit
    model = _family("llama")
    edit = [(f"blocks.0.{PATTERN}", lambda p, hook: p * 0.5)]
    batch = _padded_batch(40)
    with pytest.raises(InvalidArgumentError, match="method='qk'"):
        measure_value_drain(model, [batch], method="qk", options=OPTS.replace(extra_hooks=edit))
    halved = measure_value_drain(model, [batch], method="auto", options=OPTS.replace(extra_hooks=edit))
    plain = measure_value_drain(model, [batch], options=OPTS)
    torch.testing.assert_close(halved.attn_sink[0], plain.attn_sink[0] / 2)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gptoss"])
def test_variance_attention_squares_from_queries_and_keys(family, monkeypatch):
    """Σ_k A_qk² (attn_sq, and the prediction built on it) from queries and keys equals the pattern's to 1e-5."""
    from sinklens.analysis.variance import VarianceReducer

    model = _family(family)
    batch = _padded_batch(seed=2)
    monkeypatch.setattr(qk_attention, "CHUNK_SCORES", 1)
    pattern, qk = (VarianceReducer(model, method=m) for m in ("pattern", "qk"))
    assert not any(name.endswith(PATTERN) for name, _ in qk.fwd_hooks(batch).hooks)
    a, b = stream(model, [batch], [pattern, qk], options=OPTS)
    assert _diff(a.attn_sq, b.attn_sq) < 1e-5 and float(a.attn_sq.nan_to_num().max()) > 0.1
    assert _diff(a.pred_pattern, b.pred_pattern) <= 1e-5 * float(a.pred_pattern.nan_to_num().abs().max())
    torch.testing.assert_close(a.z_var, b.z_var, equal_nan=True)


def test_query_chunks_fit_the_cpu_cache_and_stay_large_on_gpus():
    """8 MiB of scores a chunk on the CPU (in cache), 64 MiB elsewhere, never under 64 queries."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert qk_attention.query_chunk(1, 9, 2048, cpu) == 2**21 // (9 * 2048) == 113
    assert qk_attention.query_chunk(1, 9, 2048, gpu) == 2**24 // (9 * 2048) == 910
    assert qk_attention.query_chunk(8, 32, 32768, gpu) == 64
