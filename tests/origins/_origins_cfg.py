"""Tiny training configs for the origins tests (d_model 64, vocab 1024)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))


def origins_cfg(seed: int, **overrides):
    """d_model 64, 2 layers, vocab 1024 (random last tokens rarely repeat across a few hundred samples)."""
    from _train_cfg import build_cfg

    base = dict(
        steps=20, seed=seed,
        model={"d_model": 64, "n_ctx": 16, "d_vocab": 1024, "d_mlp": 128},
        data={"seq_len": 16, "vocab_size": 64, "seed": 100 + seed, "task_seed": seed},
    )
    base.update(overrides)
    return build_cfg(**base)
