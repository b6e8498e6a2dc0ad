"""Where sinks come from: models at init (:mod:`sinklens.loading.init`), token preference, contraction,
positional discrepancy, persistence through training and the SeedPrint lineage test (docs/origins.md)."""

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
