"""Tiny ``sinklens train`` runs shared by the origins tests (trained once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Two independent 20-step runs (init seeds 1 and 2, their own data streams): {seed: run_dir}."""
    from sinklens.train.loop import train

    root = tmp_path_factory.mktemp("origins-runs")
    runs = {}
    for seed in (1, 2):
        train(origins_cfg(seed), out_dir=root / f"run{seed}", progress=False)
        runs[seed] = root / f"run{seed}"
    return runs
