"""Where sinks come from: models at initialization, init-time biases, variance calibration, SeedPrint.

:mod:`sinklens.loading.init` (``SPEC@init:S``, ``RUN_DIR@init``), :mod:`.preference` (token preference on
random inputs), :mod:`.contraction` (concentration by sublayer), :mod:`.positional` (first-token discrepancy),
:mod:`.persistence` (init-time bias through training), :mod:`.fingerprint` (SeedPrint lineage test).
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
