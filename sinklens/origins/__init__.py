"""Where sinks come from: models at initialization, init-time biases, variance calibration, SeedPrint.

* :mod:`sinklens.origins.fingerprint` — the SeedPrint lineage test (:func:`fingerprint`).
"""

from sinklens.origins.fingerprint import FingerprintResult, final_hidden_states, fingerprint, seedprint_test

__all__ = ["FingerprintResult", "final_hidden_states", "fingerprint", "seedprint_test"]
