import json

import matplotlib.figure
import pytest
import torch

from sinklens.analysis.sinks import SinkReducer, find_sinks
from sinklens.inputs import TokenBatch, as_batches
from sinklens.plotting.sinks import plot_received_by_position, plot_sink_heatmap, plot_sink_rate
from sinklens.streaming import stream
from sinklens.testing import QUIET
from support.checks import VARIED_PROMPTS

pytestmark = pytest.mark.models

PROMPTS = VARIED_PROMPTS


def _causal_scores(scores, boost_keys=None, boost=30.0):
    """Scores that are 0 on the causal part (plus ``boost`` at boost_keys[b, k]) and masked above it."""
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    new = torch.zeros_like(scores)
    if boost_keys is not None:
        new = new + boost * boost_keys[:, None, None, :n].to(scores.dtype)
    return torch.where(causal, new, torch.full_like(scores, torch.finfo(scores.dtype).min))


def _reference(model, prompts, eps, min_queries, min_query=1):
    """Per-prompt full-cache loop: per-sequence α, Gu indicators and token tables."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    width = max(model.to_tokens(p).shape[1] for p in prompts)
    hits = torch.zeros(n_layers, n_heads, width, dtype=torch.float64)
    seqs = torch.zeros(width, dtype=torch.float64)
    later: dict[int, list[float]] = {}
    first: dict[int, list[float]] = {}
    for prompt in prompts:
        toks = model.to_tokens(prompt)
        _, cache = model.run_with_cache(toks, names_filter=lambda name: name.endswith("hook_pattern"))
        n = toks.shape[1]
        alpha = torch.zeros(n_layers, n_heads, n, dtype=torch.float64)
        n_q = torch.zeros(n)
        for k in range(n):
            queries = list(range(max(k, min_query), n))
            n_q[k] = len(queries)
            if not queries:
                continue
            seqs[k] += 1
            for layer in range(n_layers):
                pat = cache[f"blocks.{layer}.attn.hook_pattern"][0].double()
                alpha[layer, :, k] = pat[:, queries, k].mean(dim=1)
        hits[:, :, :n] += ((alpha > eps) & (n_q > 0)).double()
        for k in range(n):
            if n_q[k] >= min_queries:
                table = first if k == 0 else later
                table.setdefault(int(toks[0, k]), []).append(float(alpha[:, :, k].mean()))
    return hits / seqs.clamp(min=1), seqs, first, later


def test_streamed_sinks_equal_full_cache(tiny):
    eps, min_queries = 0.15, 3
    got = find_sinks(tiny, PROMPTS, sink_threshold=eps, min_query_count=min_queries, options=QUIET.replace(batch_size=2))
    frac, seqs, first, later = _reference(tiny, PROMPTS, eps, min_queries)
    assert frac.sum() > 0  # the threshold is low enough that some heads count as sink heads
    torch.testing.assert_close(got.seq_sink_frac, frac.float())
    torch.testing.assert_close(got.n_sequences_at, seqs.float())
    assert got.n_sequences == len(PROMPTS)
    for table, stats in ((first, got.first_tokens), (later, got.later_tokens)):
        assert stats.token_ids.tolist() == sorted(table)
        for i, tok in enumerate(stats.token_ids.tolist()):
            values = torch.tensor(table[tok], dtype=torch.float64)
            assert int(stats.count[i]) == len(values)
            torch.testing.assert_close(float(stats.mean_received[i]), float(values.mean()), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(float(stats.max_received[i]), float(values.max()), rtol=1e-5, atol=1e-6)
    all_later = sorted((v for vs in later.values() for v in vs), reverse=True)
    assert [o.received for o in got.top_occurrences] == pytest.approx(all_later[: len(got.top_occurrences)], rel=1e-5)
    assert got.top_occurrences[0].token == tiny.tokenizer.decode([got.top_occurrences[0].token_id])
    # Both rates are the mean over heads and layers of a per-sequence indicator: sinklens' counts queries
    # from min_query=1 on; Gu et al.'s (the default) every query that sees the key, its own included.
    assert got.sink_rate(position=0, method="sinklens") == pytest.approx(float(frac[:, :, 0].mean()), rel=1e-5)
    gu_frac, *_ = _reference(tiny, PROMPTS, eps, min_queries, min_query=0)
    torch.testing.assert_close(got.gu_seq_sink_frac, gu_frac.float())
    assert got.sink_rate(position=0) == pytest.approx(float(gu_frac[:, :, 0].mean()), rel=1e-5)


@pytest.mark.parametrize("sink", [0, 5])
def test_planted_sink_position_is_found(tiny, sink):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 64, (12, 16), generator=gen)
    tokens[:, 0] = 0
    boost = torch.zeros(1, 16, dtype=torch.bool)  # the same key in every sequence of every batch
    boost[:, sink] = True

    def plant(scores, hook):
        return _causal_scores(scores, boost)

    result = find_sinks(
        tiny, tokens, options=QUIET.replace(extra_hooks=[("blocks.0.attn.hook_attn_scores", plant)], batch_size=5)
    )
    assert result.sink_positions == [sink]
    torch.testing.assert_close(result.sink_rate_by_layer(position=sink), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(result.sink_rate_by_layer(0.3, sink, method="mean"), torch.tensor([1.0, 0.0]))
    assert result.sink_rate(position=sink) == pytest.approx(0.5)
    # Layer 0 sends (almost) all attention of queries that see the sink to it.
    assert float(result.received[0, :, sink].min()) > 0.99
    if sink:
        assert result.sink_rate(position=0) == 0.0
        assert {o.position for o in result.top_occurrences[:12]} == {sink}  # one per sequence


def test_uniform_attention_has_no_sink(tiny_llama):
    tokens = torch.randint(2, 64, (8, 16), generator=torch.Generator().manual_seed(2))

    def uniform(scores, hook):
        return _causal_scores(scores)

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", uniform) for layer in range(2)]
    result = find_sinks(tiny_llama, tokens, options=QUIET.replace(extra_hooks=hooks))
    assert result.sink_positions == []
    assert result.sink_rate(position=0) == 0.0
    # received[k] under uniform attention is the mean of 1/(q+1) over queries q >= max(k, 1).
    expected = torch.tensor([sum(1 / (q + 1) for q in range(max(k, 1), 16)) / (16 - max(k, 1)) for k in range(16)])
    torch.testing.assert_close(result.received, expected.expand(2, 4, 16), rtol=1e-5, atol=1e-6)


def test_position_independent_sink_token(tiny_llama):
    """A token id that attracts all attention wherever it stands is found by the token tables,
    not by the position profile."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(8, 64, (16, 16), generator=gen)
    tokens[:, 0] = 0
    where = torch.randint(1, 11, (16,), generator=gen)
    tokens[torch.arange(16), where] = 7

    def plant(scores, hook):
        return _causal_scores(scores, tokens == 7)

    batch = TokenBatch(tokens, torch.ones_like(tokens, dtype=torch.bool), True)
    result = find_sinks(tiny_llama, [batch], options=QUIET.replace(extra_hooks=[("blocks.0.attn.hook_attn_scores", plant)]))
    top = result.top_sinks(3)
    assert top[0]["token_id"] == 7 and top[0]["token"] == "t7"
    assert top[0]["count"] == 16
    assert top[0]["mean_received"] > 2 * top[1]["mean_received"]
    assert all(o.token_id == 7 for o in result.top_occurrences[:16])


def test_padding_matches_one_sequence_at_a_time(tiny):
    together = find_sinks(tiny, PROMPTS, sink_threshold=0.15, options=QUIET.replace(batch_size=5))
    alone = [b for p in PROMPTS for b in as_batches(tiny, [p])]
    (single,) = stream(tiny, alone, [SinkReducer(tiny, sink_threshold=0.15)], options=QUIET)
    for name in ("received", "n_queries", "seq_sink_frac", "n_sequences_at"):
        torch.testing.assert_close(getattr(together, name), getattr(single, name), equal_nan=True, rtol=1e-5, atol=1e-6)
    for name in ("first_tokens", "later_tokens"):
        a, b = getattr(together, name), getattr(single, name)
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.mean_received, b.mean_received, rtol=1e-5, atol=1e-6)
    assert together.sink_positions == single.sink_positions


def test_exports_and_plots(tiny_llama, tmp_path):
    result = find_sinks(tiny_llama, PROMPTS, sink_threshold=0.15, options=QUIET)
    payload = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert payload["settings"]["sink_threshold"] == 0.15 and len(payload["received"]) == 2
    assert len(result.rows()) == result.received.numel()
    assert {r["position"] for r in result.summary_rows()} >= {0}
    for plot, name in ((plot_sink_heatmap, "heat.png"), (plot_sink_rate, "rate.png"), (plot_received_by_position, "recv.png")):
        fig = plot(result, path=tmp_path / name)
        assert isinstance(fig, matplotlib.figure.Figure)
        assert (tmp_path / name).stat().st_size > 0
    pos = (result.sink_positions or [0])[0]  # the figures show the first detected sink
    heat = plot_sink_heatmap(result).axes[0].images[0].get_array()
    torch.testing.assert_close(torch.as_tensor(heat.data), torch.nan_to_num(result.received[:, :, pos], nan=0.0))
    rate = plot_sink_rate(result, position=2)
    torch.testing.assert_close(torch.as_tensor(rate.axes[0].images[0].get_array().data), result.seq_sink_frac[:, :, 2])
    widths = [bar.get_width() for bar in rate.axes[1].patches]
    assert widths == pytest.approx(result.sink_rate_by_layer(position=2).tolist())
    lines = plot_received_by_position(result).axes[0].get_lines()
    for row, line in enumerate(lines[: len(result.layers)]):
        torch.testing.assert_close(torch.as_tensor(line.get_ydata()), result.received[row].nanmean(dim=0))
    torch.testing.assert_close(torch.as_tensor(lines[len(result.layers)].get_ydata()), result.mean_received())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sink_threshold=0.0), r"sink_threshold must be in \(0, 1\), got 0"),
        (dict(sink_threshold=1.5), r"sink_threshold must be in \(0, 1\), got 1.5"),
        (dict(layers=[7]), "out of range"),
        (dict(min_query=-1), "min_query"),
        (dict(min_head_share=0.0), "min_head_share"),
        (dict(outlier_factor=0.5), "outlier_factor"),
    ],
)
def test_bad_arguments(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_sinks(tiny_llama, PROMPTS[:1], options=QUIET, **kwargs)


def test_bad_queries(tiny_llama):
    result = find_sinks(tiny_llama, PROMPTS[:2], options=QUIET)
    with pytest.raises(ValueError, match="recorded at sink_threshold=0.3"):
        result.sink_rate(0.5)
    assert 0.0 <= result.sink_rate(0.5, method="mean") <= 1.0
    with pytest.raises(ValueError, match="out of range"):
        result.sink_rate(position=99)
    with pytest.raises((ValueError, TypeError), match="method"):  # TypeError: runtime type checks under pytest
        result.sink_rate(method="median")


def test_settings_as_keywords(tiny_llama):
    reducer = SinkReducer(tiny_llama, sink_threshold=0.2, min_query=0, top_k=4)  # the constructor other areas call
    assert (reducer.settings.sink_threshold, reducer.settings.min_query, reducer.settings.top_k) == (0.2, 0, 4)
    assert find_sinks(tiny_llama, PROMPTS, sink_threshold=0.15, options=QUIET).sink_threshold == 0.15
    with pytest.raises(TypeError, match="unexpected keyword"):
        find_sinks(tiny_llama, PROMPTS, epsilon=0.2, options=QUIET)


def test_keys_seen_by_few_queries_are_not_sinks_at_long_context():
    """4,096 keys, one sequence (key k seen by 4096 - k queries). Key 0 and key 2000 are sinks in 2 of 4 heads;
    the last 300 keys get 0.4 from their few queries in 2 heads (local attention), as a long text does. Only
    keys seen by at least min_query_share (0.1) of the best-seen key's queries are candidates: 0 and 2000 stay,
    the late keys go (with min_query_share=0 every one of them is listed)."""
    from sinklens.analysis.sink_result import SinkResult, SinkSettings, TokenSinkStats

    n = 4096
    received = torch.full((1, 4, n), 1.0 / n)
    hit = torch.zeros(1, 4, n)
    for keys in (torch.tensor([0, 2000]), torch.arange(n - 300, n)):
        received[0, :2, keys] = 0.4
        hit[0, :2, keys] = 1.0
    empty = TokenSinkStats(torch.zeros(0, dtype=torch.long), [], *(torch.zeros(0),) * 4)

    def result(**settings):
        return SinkResult(received=received, n_queries=(n - torch.arange(n)).float(), seq_sink_frac=hit,
                          n_sequences_at=torch.ones(n), layers=[0], settings=SinkSettings(**settings), n_sequences=1,
                          prepend_bos=True, first_tokens=empty, later_tokens=empty, gu_seq_sink_frac=hit)

    assert result().sink_positions == [0, 2000]
    assert max(result().candidates) == n - 410  # seen by 410 >= 0.1 * 4096 queries
    assert result(min_query_share=0.0).sink_positions == [0, 2000, *range(n - 300, n - 3)]
