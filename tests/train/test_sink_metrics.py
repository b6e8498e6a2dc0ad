"""The trainer's evaluation metrics: the sink rate named after Gu et al. is theirs; sinklens' variant has its own name."""

from __future__ import annotations

import json

import pytest
import torch

from sinklens.inputs import random_token_batches
from sinklens.testing import tiny_sinklm
from sinklens.train.checkpoint import read_metrics
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
