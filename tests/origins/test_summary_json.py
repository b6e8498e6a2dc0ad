"""``summary()`` of the origins results is strict JSON (audit O, F10): an undefined measurement (NaN, as on a
zero-weight model) is None, as in ``to_dict()`` and ``origins.json``, and a finite one is unchanged."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from sinklens.options import RunOptions
from sinklens.origins.contraction import ContractionResult, contraction
from sinklens.origins.positional import PositionalDiscrepancy, PositionalTrajectory, positional_discrepancy
from sinklens.testing import tiny_model

pytestmark = pytest.mark.models
QUIET = RunOptions(progress=False)


def _strict(value) -> str:
    return json.dumps(value, allow_nan=False)


def _leaves(value):
    """Every number in nested dicts and lists."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def _same_numbers(summary, raw) -> None:
    """``summary`` is ``raw`` with each non-finite float replaced by None, every other value unchanged."""
    if isinstance(raw, dict):
        assert isinstance(summary, dict) and summary.keys() == raw.keys()
        for key in raw:
            _same_numbers(summary[key], raw[key])
    elif isinstance(raw, list):
        assert isinstance(summary, list) and len(summary) == len(raw)
        for s, r in zip(summary, raw):
            _same_numbers(s, r)
    elif isinstance(raw, float) and not math.isfinite(raw):
        assert summary is None
    else:
        assert summary == raw and type(summary) is type(raw)


@pytest.fixture(scope="module")
def zero_model():
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_summaries_of_a_zero_weight_model_are_strict_json(zero_model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        con = contraction(zero_model, n_sequences=2, seq_len=4, options=QUIET)
        pos = positional_discrepancy(zero_model, n_sequences=2, seq_len=4, options=QUIET)
    for result in (con, pos):
        summary = result.summary()
        _strict(summary)  # raised "Out of range float values are not JSON compliant"
        _strict(result.to_dict())
    # the model is degenerate: there is something undefined for summary() to write as None
    assert any(v is None for row in pos.summary().values() if isinstance(row, list) for v in row)
    assert bool(pos.first_token_ratio("attn_out_var").isnan().any())
    assert pos.to_dict()["first_token_ratio"] == {k: v for k, v in pos.summary().items()
                                                  if k not in ("n_sequences", "position", "causal")}
    traj = PositionalTrajectory(steps=[0, 1], results=[pos, pos])
    _strict(traj.summary())


def test_summaries_keep_finite_values_unchanged():
    model = tiny_model()
    con = contraction(model, n_sequences=4, seq_len=6, options=QUIET)
    pos = positional_discrepancy(model, n_sequences=4, seq_len=6, options=QUIET)
    raw_pos = {name: pos.first_token_ratio(name).tolist()
               for name in ("attn_out_var", "attn_out_norm", "resid_var", "resid_norm")}
    raw_pos |= {"n_sequences": pos.n_sequences, "position": pos.first_counted, "causal": pos.causal}
    _same_numbers(pos.summary(), raw_pos)
    assert all(math.isfinite(v) for v in _leaves(pos.summary()))
    summary = con.summary()
    _strict(summary)
    assert summary["share_inter"] == con.share("inter_mean").tolist()  # full precision, not rounded
    assert summary["mlp_post_mean"] == con.mlp_post_mean.tolist()
    assert [row["inter"] for row in summary["sites"]] == [s.inter_mean for s in con.sites]
    assert summary["n_sequences"] == 4 and summary["activation"] == con.activation


def test_summary_methods_say_what_they_are():
    for cls in (ContractionResult, PositionalDiscrepancy, PositionalTrajectory):
        doc = cls.summary.__doc__ or ""
        assert "JSON" in doc and "None" in doc, cls
