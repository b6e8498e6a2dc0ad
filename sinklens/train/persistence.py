"""Persistence of the init-time bias: each evaluation compares a :class:`~sinklens.origins.persistence.PreferenceSnapshot`
with step 0's, kept in ``RUN_DIR/persistence_ref.json`` (:func:`~sinklens.origins.persistence.compare_snapshots`: rank
correlations of the token preference, Pearson of log mean probabilities, ``|cos|`` of the contraction directions)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sinklens.export import write_json
from sinklens.hooks import eval_mode
from sinklens.options import RunOptions
from sinklens.origins.persistence import PreferenceSnapshot, compare_snapshots, snapshot
from sinklens.sinklm.config import TrainConfig
from sinklens.sinklm.init import sinklm_at_init

REFERENCE = "persistence_ref.json"
#: eval-line key of each :func:`~sinklens.origins.persistence.compare_snapshots` value.
KEYS = {"preference_spearman": "persistence_spearman", "preference_kendall": "persistence_kendall",
        "preference_corr": "persistence_log_corr", "direction_cos": "persistence_direction_cos"}


class PersistenceTracker:
    """Step-0 snapshot of a run (kept in ``out``, or in memory when None) and the ``persistence_*`` metrics of
    later evaluations; ``hooks_for(model)`` gives the training-time interventions."""

    def __init__(self, cfg: TrainConfig, out: Path | None, hooks_for: Callable[[Any], list]) -> None:
        self.cfg, self.out, self.hooks_for = cfg, out, hooks_for
        ev = cfg.eval
        self.enabled = bool(ev.interval) and ev.persistence_sequences > 0
        self.inputs = {"n_sequences": ev.persistence_sequences, "seq_len": min(ev.persistence_seq_len, cfg.data.seq_len),
                       "seed": ev.persistence_seed}
        self.reference: PreferenceSnapshot | None = None

    def _snapshot(self, model: Any) -> PreferenceSnapshot:
        batch_size = max(self.inputs["n_sequences"], 1)
        options = RunOptions(progress=False, batch_size=batch_size, extra_hooks=tuple(self.hooks_for(model)))
        with eval_mode(model):
            return snapshot(model, **self.inputs, options=options)

    def resume(self, device: Any) -> None:
        """Read the step-0 snapshot of a resumed run; rebuild it from the step-0 weights when missing or stale."""
        if not self.enabled:
            return
        if self.out is not None and (self.out / REFERENCE).is_file():
            ref = PreferenceSnapshot.from_dict(json.loads((self.out / REFERENCE).read_text()))
            if ref.inputs() == self.inputs:
                self.reference = ref
                return
        self._keep(self._snapshot(sinklm_at_init(self.cfg.model, self.cfg.seed, device=device)))

    def _keep(self, reference: PreferenceSnapshot) -> None:
        self.reference = reference
        if self.out is not None:
            write_json(self.out / REFERENCE, reference.to_dict(), digits=None, indent=None)

    def measure(self, model: Any) -> dict[str, float]:
        """The ``persistence_*`` values of ``model`` (the first call of a fresh run sets the reference)."""
        if not self.enabled:
            return {}
        current = self._snapshot(model)
        if self.reference is None:
            self._keep(current)
        return {KEYS[k]: v for k, v in compare_snapshots(current, self.reference).items()}
