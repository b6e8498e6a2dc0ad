"""Tiny ``sinklens train`` runs shared by the origins tests (trained once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _origins_cfg import origins_cfg  # noqa: E402


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
