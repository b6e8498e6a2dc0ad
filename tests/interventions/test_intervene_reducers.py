"""The interventions' reducers on the BatchFold contract, and patch_sink without pandas."""

import sys

import pytest
import torch

from sinklens.inputs import as_batches
from sinklens.interventions import amplify, patch_sink
from sinklens.interventions.experiments import PositionResidualReducer
from sinklens.interventions.variance import MeanActivationReducer
from sinklens.options import RunOptions
from sinklens.streaming import stream

pytestmark = pytest.mark.models

QUIET = RunOptions(progress=False)


def test_position_residual_reducer_matches_full_cache_and_resets(tiny):
    texts = ["t3 t4 t5 t6 t7 t8", "t9 t10 t11", "t2 t3 t4 t5 t6 t7 t8 t9"]  # the middle one is too short for pos 5
    batches = as_batches(tiny, texts, batch_size=2)
    reducer = PositionResidualReducer(tiny, [5, 0])
    (both,) = stream(tiny, batches, [reducer], options=QUIET)
    reducer.reset()
    (one,) = stream(tiny, batches[:1], [reducer], options=QUIET)  # reset: a fresh mean, not a running total
    long_ids = [b.tokens[i] for b in batches for i in range(len(b.tokens)) if bool(b.valid[i, 5])]
    assert len(long_ids) == 2
    n = min(len(t) for t in long_ids)
    toks = torch.stack([t[:n] for t in long_ids])
    _, cache = tiny.run_with_cache(toks, names_filter=lambda name: name.endswith("hook_resid_post"))
    for layer in range(tiny.cfg.n_layers):
        resid = cache[f"blocks.{layer}.hook_resid_post"][:, [5, 0]].double()  # [seq, 2, d_model]
        torch.testing.assert_close(both[0][layer], resid.mean(dim=0).float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both[1][layer], resid.norm(dim=-1).mean(dim=0).float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(one[0][layer], resid[0].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(one[1][layer], resid[0].norm(dim=-1).float(), rtol=1e-5, atol=1e-5)


def test_mean_activation_reducer_resets(tiny, toks):
    batches = as_batches(tiny, toks, batch_size=1)
    reducer = MeanActivationReducer(tiny, "hook_resid_pre", layers=[1])
    (first,) = stream(tiny, batches, [reducer], options=QUIET)
    reducer.reset()
    (again,) = stream(tiny, batches[:1], [reducer], options=QUIET)
    _, cache = tiny.run_with_cache(toks[:1], names_filter="blocks.1.hook_resid_pre")
    torch.testing.assert_close(again[1], cache["blocks.1.hook_resid_pre"][0, 1:].double().mean(dim=0).float())
    assert not torch.allclose(again[1], first[1])


def test_patch_sink_needs_no_pandas_and_returns_plain_rows(sharp, toks, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # any `import pandas` now raises ImportError
    hooks = amplify(sharp, positions=3, alpha=6.0, site="hook_resid_pre", layers=[1], reference="batch")
    res = patch_sink(sharp, toks, hooks, target=3, site="resid_pre", layers=[1], positions=[2, 3])
    rows = res.to_rows()
    assert [(r["layer"], r["pos"]) for r in rows] == [(1, 2), (1, 3)]
    assert rows[1]["restored"] == pytest.approx(1.0, abs=1e-4) and rows[0]["restored"] == pytest.approx(0.0, abs=1e-4)
    assert rows[1]["value"] == pytest.approx(res.clean, abs=1e-6)
    assert all(isinstance(v, (int, float)) for r in rows for v in r.values())
