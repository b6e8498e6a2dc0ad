"""The trainer's evaluation metrics: the sink rate named after Gu et al. is theirs; sinklens' variant has its own name."""

from __future__ import annotations

import json

import pytest
import torch

from sinklens.inputs import random_token_batches
from sinklens.testing import tiny_sinklm
from sinklens.sinklm.checkpoint import read_metrics
from sinklens.train.sink_metrics import evaluate


def _gu_sink_rate(pattern: torch.Tensor, eps: float) -> float:
    """Gu et al.'s code (sail-sg/Attention-Sink ``eval_sink_open_source.py``): key 0's importance is the attention
    it receives summed over queries and divided by the number of queries that see it (query 0 included);
    the rate is the share of (sequence, layer, head) above ``eps``. ``pattern [seq, layer, head, q, k]``."""
    seen_by = torch.arange(pattern.shape[-1], 0, -1, dtype=pattern.dtype)  # key k is seen by T - k queries
    importance = pattern.sum(dim=-2) / seen_by  # [seq, layer, head, key]
    return float((importance[..., 0] > eps).double().mean())


def _later_queries_rate(pattern: torch.Tensor, eps: float) -> float:
    """The same over the queries q >= 1 only (sinklens' variant)."""
    return float((pattern[..., 1:, 0].mean(dim=-1) > eps).double().mean())


def test_evaluate_logs_gu_et_al_sink_rate_and_the_variant_under_its_own_name():
    """On 8-token random sequences of a model at initialisation (attention near uniform, so key 0 gets ≈ 1/(t+1)
    from query t), counting query 0's forced weight 1 lifts the mean over the 8 queries above ε = 0.3 while the
    mean over the later 7 stays below it: the two definitions give 1 and 0, and each metric must be its own."""
    model = tiny_sinklm(seed=0)
    batches = random_token_batches(model, n_sequences=16, seq_len=8, batch_size=16, seed=1)
    tokens = torch.cat([b.tokens for b in batches])
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(model.cfg.n_layers)], 1).double()
    metrics = evaluate(model, batches, [torch.zeros_like(b.tokens) for b in batches], threshold=0.3)
    gu, variant = _gu_sink_rate(pattern, 0.3), _later_queries_rate(pattern, 0.3)
    assert abs(gu - variant) > 0.5  # the two definitions disagree here
    assert metrics.sink_rate == pytest.approx(gu, abs=1e-9)
    assert metrics.sinklens_sink_rate == pytest.approx(variant, abs=1e-9)
    scalars = metrics.scalars()
    assert scalars["sink_rate"] == metrics.sink_rate and scalars["sinklens_sink_rate"] == metrics.sinklens_sink_rate


def test_read_metrics_gives_an_older_runs_variant_its_own_name(tmp_path):
    """Metric lines written before Gu et al.'s rate was logged held sinklens' variant as ``sink_rate``; reading them
    returns it as ``sinklens_sink_rate`` so it is never shown as Gu et al.'s. New lines are returned as written."""
    old = {"kind": "eval", "step": 10, "val_loss": 2.0, "sink_rate": 0.25}
    new = {"kind": "eval", "step": 20, "val_loss": 1.9, "sink_rate": 0.5, "sinklens_sink_rate": 0.375}
    train_line = {"kind": "train", "step": 20, "loss": 1.8}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (old, train_line, new)))
    first, second, third = read_metrics(tmp_path)
    assert first == {"kind": "eval", "step": 10, "val_loss": 2.0, "sinklens_sink_rate": 0.25}
    assert second == train_line and third == new


# ---- every SinkMetrics field against plain run_with_cache code ------------------------------------------------
# Two right-padded batches of different widths (lengths 11, 6, 12, 3 and 9, 4, 7), so that padding, pooling over
# batches and the t >= 1 rule all matter. The references below read activations with ``run_with_cache`` and pool
# them by hand; nothing of sinklens is used but the model and the token layout.

def _padded_eval_batches():
    from sinklens.inputs import TokenBatch

    gen = torch.Generator().manual_seed(7)
    batches = []
    for lengths in ([11, 6, 12, 3], [9, 4, 7]):
        width = max(lengths)
        tokens = torch.randint(2, 512, (len(lengths), width), generator=gen)
        tokens[:, 0] = 0  # a BOS-like first token in every sequence
        valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        tokens[~valid] = 1  # padding id
        batches.append(TokenBatch(tokens, valid, prepend_bos=True))
    return batches


def _cached(model, batch, names):
    model.eval()
    with torch.inference_mode():
        _, cache = model.run_with_cache(batch.tokens, names_filter=lambda n: n in names)
    return cache


def _reference_norm_ratio(model, batches):
    """``mean_b ||resid_post[b, l, 0]|| / mean_{b, t >= 1 valid} ||resid_post[b, l, t]||`` per layer."""
    n_layers = model.cfg.n_layers
    first, later = torch.zeros(n_layers, dtype=torch.float64), torch.zeros(n_layers, dtype=torch.float64)
    n_seq, n_later = 0, 0
    for batch in batches:
        cache = _cached(model, batch, {f"blocks.{l}.hook_resid_post" for l in range(n_layers)})
        n_seq += batch.tokens.shape[0]
        n_later += int(batch.valid[:, 1:].sum())
        for layer in range(n_layers):
            norms = cache[f"blocks.{layer}.hook_resid_post"].double().norm(dim=-1)  # [b, t]
            first[layer] += norms[:, 0].sum()
            later[layer] += norms[:, 1:][batch.valid[:, 1:]].sum()
    return (first / n_seq) / (later / n_later)


def _reference_discrepancy(model, batches, site):
    """``var(position 0) / var(t >= 1)`` with ``var`` the mean over coordinates of ``(x − m)²`` pooled over the
    sequences valid there, ``m`` the mean of ``x`` over every valid (sequence, position): the ``z_var`` definition of
    :mod:`sinklens.analysis.variance` and :meth:`VarianceResult.discrepancy` (the rest weighted by valid tokens)."""
    n_layers = model.cfg.n_layers
    out = []
    for layer in range(n_layers):
        name = f"blocks.{layer}.{site}"
        acts, valids = [], []
        for batch in batches:
            x = _cached(model, batch, {name})[name].double()
            acts.append(x if site == "attn.hook_z" else x[:, :, None, :])  # [b, t, head (or 1), coord]
            valids.append(batch.valid)
        pooled = torch.cat([a[v] for a, v in zip(acts, valids)])  # every valid token: [n, head, coord]
        mean = pooled.mean(dim=0)
        firsts = torch.cat([a[:, 0] for a in acts])  # position 0 of every sequence
        rests = torch.cat([a[:, 1:][v[:, 1:]] for a, v in zip(acts, valids)])
        out.append(((firsts - mean) ** 2).mean(dim=(0, -1)) / ((rests - mean) ** 2).mean(dim=(0, -1)))
    return torch.stack(out)


def _reference_attention_to_first(model, batches):
    """Mean over sequences and valid queries ``q >= 1`` of ``pattern[b, h, q, 0]``, per (layer, head)."""
    n_layers = model.cfg.n_layers
    total, count = torch.zeros(n_layers, model.cfg.n_heads, dtype=torch.float64), 0
    for batch in batches:
        cache = _cached(model, batch, {f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)})
        q_valid = batch.valid[:, 1:]
        count += int(q_valid.sum())
        for layer in range(n_layers):
            to_first = cache[f"blocks.{layer}.attn.hook_pattern"][:, :, 1:, 0].double()  # [b, head, q]
            total[layer] += (to_first * q_valid[:, None, :]).sum(dim=(0, 2))
    return total / count


def test_evaluate_metrics_equal_hand_computed_references_on_padded_batches():
    """``norm_ratio`` is the first-token norm ratio of ``hook_resid_post`` (not ``hook_resid_mid``; later positions are
    ``t >= 1``, not ``t <= T - 2``), ``variance_ratio`` / ``attn_out_variance_ratio`` the discrepancy at position 0 (not 1)
    of ``hook_z`` / ``hook_attn_out``, and ``attention_to_first`` the mean attention on key 0 from valid queries
    ``q >= 1`` — each recomputed from ``run_with_cache`` activations, pooled by hand over two padded batches."""
    from sinklens.analysis.sinks import find_sinks
    from sinklens.testing import QUIET

    model = tiny_sinklm(seed=0)
    batches = _padded_eval_batches()
    metrics = evaluate(model, batches, [torch.zeros_like(b.tokens) for b in batches], threshold=0.3)

    norm_ratio = _reference_norm_ratio(model, batches)
    torch.testing.assert_close(metrics.norm_ratio.double(), norm_ratio, rtol=1e-5, atol=0)
    z_ratio = _reference_discrepancy(model, batches, "attn.hook_z")
    torch.testing.assert_close(metrics.variance_ratio.double(), z_ratio, rtol=1e-4, atol=0)
    out_ratio = _reference_discrepancy(model, batches, "hook_attn_out")[:, 0]
    torch.testing.assert_close(metrics.attn_out_variance_ratio.double(), out_ratio, rtol=1e-4, atol=0)
    to_first = _reference_attention_to_first(model, batches)
    torch.testing.assert_close(metrics.attention_to_first.double(), to_first, rtol=1e-5, atol=1e-7)
    # The same field as find_sinks' received[:, :, 0] on the same batches.
    sinks = find_sinks(model, batches, sink_threshold=0.3, min_query=1, top_k=0, options=QUIET)
    torch.testing.assert_close(metrics.attention_to_first, sinks.received[:, :, 0])
    scalars = metrics.scalars()
    assert scalars["first_token_norm_ratio"] == pytest.approx(float(norm_ratio.max()), rel=1e-5)
    assert scalars["variance_ratio"] == pytest.approx(float(z_ratio.mean()), rel=1e-4)
    assert scalars["attn_out_variance_ratio"] == pytest.approx(float(out_ratio.max()), rel=1e-4)


def test_an_older_runs_sink_rate_is_plotted_under_its_own_name(tmp_path):
    """compare's figure keeps an older run's sink-rate curve: its variant (read as ``sinklens_sink_rate``) gets its
    own panel, with every evaluation plotted, beside Gu et al.'s panel, which the run never logged."""
    from sinklens.plotting.training import plot_training

    lines = [{"kind": "train", "step": s, "loss": 3.0 - 0.1 * s} for s in range(6)]
    lines += [{"kind": "eval", "step": s, "val_loss": 3.0, "sink_rate": r} for s, r in ((0, 0.0), (3, 0.25), (5, 0.5))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    fig = plot_training({"old": read_metrics(tmp_path)})
    titles = {ax.get_title(): ax for ax in fig.axes}
    variant = next(ax for title, ax in titles.items() if title.startswith("sinklens sink rate"))
    (curve,) = variant.get_lines()
    assert list(curve.get_xdata()) == [0, 3, 5] and list(curve.get_ydata()) == [0.0, 0.25, 0.5]
    gu = next(ax for title, ax in titles.items() if "Gu et al." in title)
    assert all(len(line.get_xdata()) == 0 for line in gu.get_lines())


@pytest.mark.parametrize("variant", ["baseline", "sink_logit", "softpick"])
def test_evaluate_reads_sinks_from_queries_and_keys_where_the_variant_allows(variant, monkeypatch):
    """A softmax SinkLM's sink metrics come from queries and keys and equal the pattern path's; a plain softmax
    keeps its SDPA kernel (no layer builds a pattern). Softpick (not a softmax) and an intervention on the pattern
    keep the pattern."""
    from sinklens.analysis.sinks import find_sinks
    from sinklens.sinklm.model import Attention
    from sinklens.testing import QUIET

    model = tiny_sinklm(variant, seed=0)
    batches = _padded_eval_batches()
    targets = [torch.zeros_like(b.tokens) for b in batches]
    evaluate(model, batches, targets)  # the first call also runs the model's one-off layout probes
    explicit = []
    needs = Attention.needs_explicit
    monkeypatch.setattr(Attention, "needs_explicit", lambda self: explicit.append(needs(self)) or explicit[-1])
    metrics = evaluate(model, batches, targets, threshold=0.3)
    monkeypatch.undo()
    assert metrics.attention_path == ("pattern" if variant == "softpick" else "qk")
    assert explicit and (not any(explicit) if variant == "baseline" else all(explicit))  # sink logits: never SDPA
    sinks = find_sinks(model, batches, sink_threshold=0.3, min_query=1, top_k=0, method="pattern", options=QUIET)
    torch.testing.assert_close(metrics.attention_to_first, sinks.received[:, :, 0], rtol=0, atol=1e-5)
    assert metrics.sink_rate == sinks.sink_rate(position=0, method="gu")
    assert metrics.sinklens_sink_rate == sinks.sink_rate(position=0, method="sinklens")
    edit = [("blocks.0.attn.hook_pattern", lambda p, hook: p)]
    assert evaluate(model, batches, targets, extra_hooks=edit).attention_path == "pattern"
