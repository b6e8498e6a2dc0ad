"""Deprecated: the three mechanism links now live in modules named after what each measures.

* :mod:`sinklens.analysis.weight_super_neurons` — super neurons from weights (was "(b)");
* :mod:`sinklens.analysis.normalized_disparity` — disparity after normalisation (was "(c)");
* :mod:`sinklens.analysis.qk_locking` — query–key locking (was "(d)").

Importing a name from here still works and warns.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    **dict.fromkeys(("SinkInput", "SinkInputReducer", "sink_inputs", "WeightNeurons", "super_neurons_from_weights"),
                    "sinklens.analysis.weight_super_neurons"),
    **dict.fromkeys(("NormalizedDisparity", "NormalizedDisparityReducer", "normalized_disparity"),
                    "sinklens.analysis.normalized_disparity"),
    **dict.fromkeys(("QKLocking", "QKLockingReducer", "query_key_locking", "ROT_Q", "ROT_K"), "sinklens.analysis.qk_locking"),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"sinklens.analysis.links is deprecated; import {name} from {_MOVED[name]}.", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
