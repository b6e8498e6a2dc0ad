"""Where sinks come from: models at initialization, init-time biases, variance calibration, SeedPrint.

* :mod:`sinklens.loading.init` — ``load_model(spec, init_seed=S)``, ``SPEC@init:S``, ``RUN_DIR@init``;
* :mod:`sinklens.origins.preference` — token preference on random inputs;
* :mod:`sinklens.origins.contraction` — inter/intra-sequence concentration by sublayer;
* :mod:`sinklens.origins.positional` — the first token's positional discrepancy, at init and over checkpoints;
* :mod:`sinklens.origins.persistence` — how much of the init-time bias persists through training;
* :mod:`sinklens.interventions.calibration` — variance calibration hooks
  (trainer variant ``variance_calibrated``);
* :mod:`sinklens.origins.fingerprint` — the SeedPrint lineage test (:func:`fingerprint`).
"""

from sinklens.origins.contraction import ContractionResult, contraction
from sinklens.origins.fingerprint import FingerprintResult, final_hidden_states, fingerprint, seedprint_test
from sinklens.loading.init import load_at_init
from sinklens.origins.persistence import persistence, snapshot
from sinklens.origins.positional import PositionalDiscrepancy, PositionalTrajectory, positional_discrepancy, positional_over_training
from sinklens.origins.preference import RandomInputs, TokenPreference, token_preference

__all__ = [
    "ContractionResult", "FingerprintResult", "PositionalDiscrepancy", "TokenPreference", "contraction",
    "final_hidden_states", "fingerprint", "load_at_init", "persistence", "positional_discrepancy", "seedprint_test",
    "token_preference", "PositionalTrajectory", "RandomInputs", "positional_over_training", "snapshot",
]
