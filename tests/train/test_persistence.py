"""The trainer's persistence metrics (issue 9 item 5), kept checkpoints (keep_every) and the
positional discrepancy over checkpoints (issue 9 item 4)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from _train_cfg import build_cfg

from sinklens.origins.contraction import contraction
from sinklens.origins.positional import positional_discrepancy, positional_over_training
from sinklens.origins.preference import token_preference
from sinklens.sinklm.checkpoint import checkpoint_steps, load_step_model
from sinklens.train.loop import train
from sinklens.train.persistence import REFERENCE

KEYS = ("persistence_spearman", "persistence_kendall", "persistence_log_corr", "persistence_direction_cos")


def _cfg(**overrides):
    evals = {"interval": 3, "persistence_sequences": 6, "persistence_seq_len": 8, "persistence_seed": 7,
             **overrides.pop("eval", {})}
    return build_cfg(**{"eval": evals, "steps": 6, "checkpoint_interval": 3, "keep_every": 1, **overrides})


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(x)).double()


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


def _kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's τ over all pairs, by definition (no ties in continuous probabilities)."""
    sa = torch.sign(a[:, None] - a[None, :])
    sb = torch.sign(b[:, None] - b[None, :])
    n = a.numel()
    return float((sa * sb).sum() / (n * (n - 1)))


def _evals(run_dir) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if line["kind"] == "eval"}


def test_persistence_matches_an_independent_computation(tmp_path):
    train(_cfg(), out_dir=tmp_path, progress=False)
    evals = _evals(tmp_path)
    assert sorted(evals) == [0, 3, 6] and checkpoint_steps(tmp_path) == [3, 6]
    inputs = dict(n_sequences=6, seq_len=8, seed=7)
    init = load_step_model(tmp_path, 0)
    p0 = token_preference(init, **inputs).probs.double()
    d0 = contraction(init, **inputs).site("final").direction.double()
    for step in (3, 6):
        model = load_step_model(tmp_path, step)
        p = token_preference(model, **inputs).probs.double()
        d = contraction(model, **inputs).site("final").direction.double()
        line = evals[step]
        assert line["persistence_spearman"] == pytest.approx(_pearson(_ranks(p), _ranks(p0)), abs=1e-9)
        assert line["persistence_kendall"] == pytest.approx(_kendall(p, p0), abs=1e-9)
        assert line["persistence_log_corr"] == pytest.approx(_pearson(p.log(), p0.log()), abs=1e-5)
        assert line["persistence_direction_cos"] == pytest.approx(abs(float(d @ d0)) / float(d.norm() * d0.norm()), abs=1e-5)
    assert evals[6]["persistence_spearman"] < 0.99  # lr 1e-2 moves the preferences: the test can tell steps apart


def test_persistence_is_exactly_one_at_step_0_and_saved_as_strict_json(tmp_path):
    train(_cfg(steps=3), out_dir=tmp_path, progress=False)
    assert all(_evals(tmp_path)[0][k] == 1.0 for k in KEYS)
    ref = json.loads((tmp_path / REFERENCE).read_text())  # strict JSON: json.loads would accept NaN, check the text
    assert "NaN" not in (tmp_path / REFERENCE).read_text() and ref["n_sequences"] == 6 and ref["seq_len"] == 8
    assert math.isclose(sum(ref["probs"]), 1.0, rel_tol=1e-5) and len(ref["direction"]) == 16


@pytest.mark.parametrize("drop_reference", [False, True])
def test_resumed_run_records_the_same_persistence(tmp_path, drop_reference):
    full = train(_cfg(), progress=False).evals()
    train(_cfg(), out_dir=tmp_path, progress=False, until=3)
    if drop_reference:  # an older run directory: the reference is rebuilt from RUN_DIR@init
        (tmp_path / REFERENCE).unlink()
    resumed = train(_cfg(), out_dir=tmp_path, resume=True, progress=False).evals()
    assert [e["step"] for e in resumed] == [0, 3, 6]
    for a, b in zip(full, resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}


def test_persistence_can_be_turned_off():
    evals = train(_cfg(eval={"persistence_sequences": 0}, checkpoint_interval=0), progress=False).evals()
    assert evals and not any(k in e for e in evals for k in KEYS)


def test_checkpoints_keep_only_the_newest_two_unless_keep_every(tmp_path):
    train(build_cfg(steps=8, checkpoint_interval=2), out_dir=tmp_path / "default", progress=False)
    assert checkpoint_steps(tmp_path / "default") == [6, 8]
    train(build_cfg(steps=8, checkpoint_interval=2, keep_every=2), out_dir=tmp_path / "k2", progress=False)
    assert checkpoint_steps(tmp_path / "k2") == [4, 6, 8]  # multiples of 2 × 2, plus the newest two


def test_positional_over_training_equals_each_checkpoint_measured_alone(tmp_path):
    train(_cfg(eval={"interval": 0}), out_dir=tmp_path, progress=False)
    traj = positional_over_training(tmp_path, n_sequences=8, seq_len=8)
    assert traj.steps == [0, 3, 6]
    for step, result in zip(traj.steps, traj.results):
        alone = positional_discrepancy(load_step_model(tmp_path, step), n_sequences=8, seq_len=8)
        torch.testing.assert_close(result.attn_out_var, alone.attn_out_var)
    # step 0 is the run's initialization exactly: RUN_DIR@init, not a fresh draw
    torch.manual_seed(_cfg().seed)
    from sinklens.sinklm.model import SinkLM

    init = SinkLM(_cfg().model).eval()
    expected = positional_discrepancy(init, n_sequences=8, seq_len=8)
    torch.testing.assert_close(traj.results[0].attn_out_var, expected.attn_out_var, rtol=0, atol=0)
    ratio = traj.first_token_ratio()
    assert ratio.shape == (3, 2) and not torch.allclose(ratio[0], ratio[2])  # the checkpoints differ
    with pytest.raises(Exception, match="keeps no checkpoint of step 4"):
        load_step_model(tmp_path, 4)


def test_compare_prints_persistence_and_positional_over_checkpoints(tmp_path, capsys):
    from sinklens.cli import main

    train(_cfg(), out_dir=tmp_path / "run", progress=False)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "run"), "--smoothing", "1", "--out", str(tmp_path / "cmp.png"),
                 "--positional", "--n-sequences", "8", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    last = _evals(tmp_path / "run")[6]
    assert f"preference Spearman {last['persistence_spearman']:.3f}" in out
    traj = positional_over_training(tmp_path / "run", n_sequences=8, seq_len=8)
    for step, row in zip(traj.steps, traj.first_token_ratio().tolist()):
        assert f"step {step:>7}: " + "  ".join(f"{v:8.3g}" for v in row) in out
    assert (tmp_path / "cmp.png").stat().st_size > 1000 and (tmp_path / "cmp-positional.png").stat().st_size > 1000


def test_a_constant_preference_gives_undefined_correlations_not_minus_one():
    """A uniform preference (zero-initialised unembedding) has no ranking: scipy says NaN, and a clip to
    [-1, 1] turned that into -1.0, "perfectly anti-correlated"."""
    from sinklens.origins.persistence import PreferenceSnapshot, compare_snapshots

    g = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    uniform = PreferenceSnapshot(torch.full((64,), 1 / 64), direction, 8, 4, 0)
    peaked = PreferenceSnapshot(torch.softmax(torch.randn(64, generator=g), 0), direction, 8, 4, 0)
    got = compare_snapshots(peaked, uniform)
    for name in ("preference_corr", "preference_spearman", "preference_kendall"):
        assert math.isnan(got[name]), (name, got[name])
    assert got["direction_cos"] == pytest.approx(1.0)
    same = compare_snapshots(peaked, peaked)
    assert same["preference_spearman"] == 1.0 and same["preference_kendall"] == pytest.approx(1.0)


def test_compare_writes_every_figure_before_printing(tmp_path, capsys, monkeypatch):
    """A reader that closes stdout at the first line (``sinklens compare ... | head -1``) still gets both figures."""
    import sys

    from sinklens.cli import main
    from sinklens.errors import EXIT_FAILURE

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    train(_cfg(eval={"interval": 0}), out_dir=tmp_path / "run", progress=False)
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["compare", str(tmp_path / "run"), "--smoothing", "1", "--out", str(tmp_path / "cmp.png"),
                 "--positional", "--n-sequences", "8", "--seq-len", "8"]) == EXIT_FAILURE
    assert (tmp_path / "cmp.png").stat().st_size > 1000 and (tmp_path / "cmp-positional.png").stat().st_size > 1000
    err = capsys.readouterr().err  # nothing but the progress bar over the checkpoints: no message, no traceback
    assert all(line.startswith("positional (run)") for line in re.split(r"[\r\n]+", err) if line.strip()), err
