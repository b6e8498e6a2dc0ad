"""Tiny training configs shared by the trainer tests (d_model 16, 2 layers, seq 16)."""

from __future__ import annotations

from typing import Any

from sinklens.sinklm.config import TrainConfig


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build_cfg(**overrides: Any) -> TrainConfig:
    """A seconds-long CPU run: 2 layers, d_model 16, vocab 24, seq 16, batch 8; nested dicts merge."""
    base = {
        "model": {"n_layers": 2, "d_model": 16, "n_heads": 4, "d_mlp": 32, "n_ctx": 16, "d_vocab": 24},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "data": {"source": "bigram-backcopy", "seq_len": 16, "vocab_size": 24, "alpha": 0.05},
        "eval": {"interval": 0, "batches": 1, "batch_size": 8},
        "steps": 10,
        "batch_size": 8,
        "device": "cpu",
    }
    return TrainConfig.from_dict(_merge(base, overrides))
