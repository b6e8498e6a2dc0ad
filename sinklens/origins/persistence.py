"""Persistence: how much of the init-time bias a trained model keeps, compared with a reference (typically its
own ``RUN_DIR@init``) on the same seeded random inputs through a :class:`PreferenceSnapshot`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import model_device, model_dims
from sinklens.inputs import TokenBatch
from sinklens.options import SEQ_LEN, RunOptions
from sinklens.origins.contraction import _SiteAccumulator
from sinklens.origins.preference import RandomInputs, TokenPreferenceReducer, random_batches
from sinklens.origins.sites import final_state_site
from sinklens.streaming import BatchFold, Reducer, stream


@dataclass(repr=False, eq=False)
class PreferenceSnapshot(CompactRepr):
    """A model's pooled next-token distribution ``probs`` ``[vocab]`` and unit final contraction ``direction`` (top
    eigenvector of ``Σ h hᵀ`` of the final states) on the random inputs ``n_sequences``, ``seq_len``, ``seed``."""

    probs: Float[Tensor, " vocab"]
    direction: Float[Tensor, " d_model"]
    n_sequences: int
    seq_len: int
    seed: int

    def inputs(self) -> dict[str, int]:
        return {"n_sequences": self.n_sequences, "seq_len": self.seq_len, "seed": self.seed}

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (float32 values, exact as JSON numbers) for :func:`sinklens.export.write_json`."""
        return {**self.inputs(), "probs": self.probs.tolist(), "direction": self.direction.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreferenceSnapshot:
        return cls(torch.tensor(data["probs"], dtype=torch.float32), torch.tensor(data["direction"], dtype=torch.float32),
                   int(data["n_sequences"]), int(data["seq_len"]), int(data["seed"]))


class FinalDirectionReducer(Reducer[Float[Tensor, " d_model"]]):
    """Streams only the ``final`` site's dominant direction (the contraction measure, one site)."""

    statistics = ("acc", "seen")

    def __init__(self, model: Any, seq_len: int) -> None:
        self.site, self.finish = final_state_site(model)
        self.seq_len, self.d_model, self.device = seq_len, model_dims(model).d_model, model_device(model)
        self.reset()

    def reset(self) -> None:
        self.acc = _SiteAccumulator("final", self.seq_len, self.d_model, self.device, True)
        self.seen = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        start = self.seen
        return BatchFold([(self.site, lambda act, hook: self.acc.fold(self.finish(act), 0, start))])

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.seen += batch.tokens.shape[0]

    def merge(self, other: FinalDirectionReducer) -> None:
        """As :meth:`ContractionReducer.merge` for its one site: halves swap after an odd number of sequences."""
        self.acc.merge(other.acc, swap_halves=self.seen % 2 == 1)
        self.seen += other.seen

    def result(self) -> Float[Tensor, " d_model"]:
        return self.acc.result(0).direction


def snapshot(
    model: Any, *, n_sequences: int = 64, seq_len: int = SEQ_LEN, seed: int = 0,
    options: RunOptions = RunOptions(progress=False, desc="persistence"),
) -> PreferenceSnapshot:
    """The :class:`PreferenceSnapshot` of ``model`` (one streamed pass; no gradients, hooks removed after)."""
    random = RandomInputs(n_sequences=n_sequences, seq_len=seq_len, prepend_bos=False, seed=seed)
    reducers = [TokenPreferenceReducer(model, seq_len), FinalDirectionReducer(model, seq_len)]
    pref, direction = stream(model, random_batches(model, random, options), reducers, options=options)
    return PreferenceSnapshot(pref.probs.float(), direction.float(), n_sequences, seq_len, seed)


def compare_snapshots(current: PreferenceSnapshot, reference: PreferenceSnapshot) -> dict[str, float]:
    """``preference_corr`` (Pearson over ``log probs``), ``preference_spearman`` / ``preference_kendall``
    (rankings by ``probs``) and ``direction_cos`` (``|cos|`` of the directions); NaN for a constant preference."""
    from scipy import stats

    if current.inputs() != reference.inputs():
        raise InvalidArgumentError(f"Snapshots on different inputs: {current.inputs()} vs {reference.inputs()}.")
    if current.probs.shape != reference.probs.shape or current.direction.shape != reference.direction.shape:
        raise InvalidArgumentError(
            f"persistence needs the same d_vocab and d_model, got {tuple(current.probs.shape) + tuple(current.direction.shape)} "
            f"and {tuple(reference.probs.shape) + tuple(reference.direction.shape)}.")
    pa, pb = current.probs.double(), reference.probs.double()
    corr = float(torch.corrcoef(torch.stack([pa, pb]).clamp_min(1e-30).log())[0, 1])
    a, b = pa.numpy(), pb.numpy()
    same_ranks = (stats.rankdata(a) == stats.rankdata(b)).all()
    spearman = 1.0 if same_ranks else float(stats.spearmanr(a, b).statistic)  # exact 1 for the same ranking
    kendall = float(stats.kendalltau(a, b).statistic)
    da, db = current.direction.double(), reference.direction.double()
    out = {"preference_corr": corr, "preference_spearman": spearman, "preference_kendall": kendall,
           "direction_cos": float((da @ db).abs() / (da.norm() * db.norm()))}
    return {k: v if math.isnan(v) else min(1.0, max(-1.0, v)) for k, v in out.items()}  # rounding: 1 + 2e-16


def persistence(
    model: Any, reference: Any, *, n_sequences: int = 64, seq_len: int = SEQ_LEN, seed: int = 0,
    options: RunOptions = RunOptions(progress=False, desc="persistence"),
) -> dict[str, float]:
    """:func:`compare_snapshots` of ``model`` against ``reference`` on the same random inputs.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> m = tiny_model()
        >>> {k: round(v, 6) for k, v in persistence(m, m, n_sequences=8, seq_len=4).items()}
        {'preference_corr': 1.0, 'preference_spearman': 1.0, 'preference_kendall': 1.0, 'direction_cos': 1.0}
    """
    a, b = ((d.d_model, d.d_vocab) for d in (model_dims(model), model_dims(reference)))
    if a != b:
        raise InvalidArgumentError(f"persistence needs the same d_model and d_vocab, got {a} and {b}.")
    common = dict(n_sequences=n_sequences, seq_len=seq_len, seed=seed, options=options)
    return compare_snapshots(snapshot(model, **common), snapshot(reference, **common))
