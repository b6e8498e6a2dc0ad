"""Persistence: how much of the init-time bias a trained model keeps.

Two numbers between a model and a reference (typically its own step 0, ``RUN_DIR@init``), both on
the same random inputs (:func:`~sinklens.origins.preference.token_preference` and
:func:`~sinklens.origins.contraction.contraction` with equal ``n_sequences``, ``seq_len``, ``seed``):

* ``preference_corr``: Pearson correlation over the vocabulary of ``log`` pooled mean next-token
  probabilities (log, because the preferences span orders of magnitude — our choice);
* ``direction_cos``: ``|cos|`` between the two dominant directions (top singular vectors) of the final
  hidden states (the ``final`` site; both models must share ``d_model``).

Not recorded by the trainer yet: call it on checkpoints. Measured on the tiny test runs (d_model 64,
std-0.02 init): the init preferences are nearly uniform, so they are fragile — after 3 AdamW steps at
lr 1e-4 ``preference_corr`` is above 0.8, but 2 steps at lr 1e-2 already bring it to about 0, while
the SeedPrint test still finds the lineage after 20 such steps.
"""

from __future__ import annotations

from typing import Any

import torch

from sinklens.errors import IncompatibleModelsError
from sinklens.hooks import model_dims
from sinklens.options import RunOptions
from sinklens.origins.contraction import contraction
from sinklens.origins.preference import token_preference


def persistence(
    model: Any,
    reference: Any,
    *,
    n_sequences: int = 64,
    seq_len: int = 16,
    seed: int = 0,
    options: RunOptions = RunOptions(progress=False, desc="persistence"),
) -> dict[str, float]:
    """``{"preference_corr", "direction_cos"}`` of ``model`` against ``reference`` (see the module docstring).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> m = tiny_model()
        >>> {k: round(v, 6) for k, v in persistence(m, m, n_sequences=8, seq_len=4).items()}
        {'preference_corr': 1.0, 'direction_cos': 1.0}
    """
    a, b = model_dims(model), model_dims(reference)
    if (a.d_model, a.d_vocab) != (b.d_model, b.d_vocab):
        raise IncompatibleModelsError(
            f"persistence needs the same d_model and d_vocab, got {(a.d_model, a.d_vocab)} and {(b.d_model, b.d_vocab)}."
        )
    common = dict(n_sequences=n_sequences, seq_len=seq_len, seed=seed, options=options)
    pa, pb = token_preference(model, **common).probs, token_preference(reference, **common).probs
    la, lb = pa.double().clamp_min(1e-30).log(), pb.double().clamp_min(1e-30).log()
    corr = float(torch.corrcoef(torch.stack([la, lb]))[0, 1])
    da = contraction(model, **common).site("final").direction
    db = contraction(reference, **common).site("final").direction
    return {"preference_corr": corr, "direction_cos": float((da @ db).abs() / (da.norm() * db.norm()))}
