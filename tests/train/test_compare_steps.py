"""`sinklens compare` smooths in training steps: a run's ``log_interval`` does not change its numbers."""

from __future__ import annotations

import json
import random

import pytest

from sinklens.cli import main
from sinklens.commands.compare import log_interval, on_common_steps, summarize
from sinklens.plotting.training import smooth, steps_to_loss

STEPS = 300


def _losses(seed: int = 0) -> list[float]:
    """A noisy decreasing loss at every step 0..STEPS-1, as a run logged every step writes it."""
    rng = random.Random(seed)
    return [5.0 - 0.004 * s + 0.3 * rng.random() for s in range(STEPS)]


def _lines(losses: list[float], every: int) -> list[dict]:
    """The train lines of a run logged every ``every`` steps (and at its last step, as the trainer does)."""
    return [{"kind": "train", "step": s, "loss": loss} for s, loss in enumerate(losses)
            if s % every == 0 or s == len(losses) - 1]


def test_smooth_window_counts_steps_not_logged_points():
    values = [float(v) for v in range(12)]
    assert smooth(values, 4) == smooth(values, 4, steps=list(range(12)))  # logged every step: as before
    # logged every 5 steps, window of 10 steps: the points at s and s-5 (s-10 is outside (s-10, s])
    assert smooth([1.0, 3.0, 5.0, 7.0, 9.0], 10, steps=[0, 5, 10, 15, 17]) == [1.0, 2.0, 4.0, 6.0, 7.0]
    lines = [{"kind": "train", "step": s, "loss": loss} for s, loss in zip((0, 5, 10, 15), (4.0, 3.0, 2.0, 1.0))]
    # smoothed over 10 steps: 4, 3.5, 2.5, 1.5 (over 10 logged points it was 4, 3.5, 3, 2.5: step 15)
    assert steps_to_loss(lines, 2.5, smoothing=10) == 10 and steps_to_loss(lines, 1.0, smoothing=10) is None


@pytest.mark.parametrize("every", [5, 7])
def test_runs_with_other_log_intervals_summarize_alike(every):
    """Two runs with the same loss at every step they both logged get the same final loss and steps
    to target whatever their log_interval (they used to differ: smoothing counted logged lines)."""
    losses = _losses()
    runs = {"every step": _lines(losses, 1), f"every {every}": _lines(losses, every)}
    assert [log_interval(lines) for lines in runs.values()] == [1, every]
    for target in (None, 4.5):
        a, b = summarize(runs, target=target, smoothing=10)
        assert a["final_loss"] == b["final_loss"] and a["steps_to_target"] == b["steps_to_target"]
        assert a["steps_to_target"] % every == 0 and a["common_log_interval"] == every
    kept, interval = on_common_steps(runs)
    assert interval == every and [x["step"] for x in kept["every step"]] == [x["step"] for x in kept[f"every {every}"]]
    # the final loss is the mean of the losses logged in the last 10 steps (STEPS-11, STEPS-1] on that grid
    window = [s for s in range(STEPS - 10, STEPS) if s % every == 0 or s == STEPS - 1]
    assert a["final_loss"] == pytest.approx(sum(losses[s] for s in window) / len(window))


def test_one_log_interval_keeps_every_logged_step():
    losses = _losses()
    (row,) = summarize({"a": _lines(losses, 1)}, smoothing=10)
    assert row["common_log_interval"] == 1 and row["final_loss"] == pytest.approx(sum(losses[-10:]) / 10)


def test_compare_cli_prints_step_units(tmp_path, capsys):
    losses = _losses()
    paths = []
    for every in (1, 5):
        run = tmp_path / f"L{every}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in _lines(losses, every)))
        paths.append(str(run))
    assert main(["compare", *paths, "--out", str(tmp_path / "cmp.png")]) == 0
    printed = capsys.readouterr().out
    assert "mean of the losses logged in the last 10 steps, at the steps all runs logged: every 5" in printed, printed
    rows = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("? @ L")]
    assert len(rows) == 2 and rows[0] == rows[1], printed


def test_compare_takes_the_last_line_of_a_repeated_step(tmp_path, capsys):
    """A resumed run whose later lines were not cut holds steps 3..5 twice: the later lines are the run's."""
    run = tmp_path / "resumed"
    run.mkdir()
    first = [{"kind": "train", "step": s, "loss": 9.0} for s in range(6)]
    again = [{"kind": "train", "step": s, "loss": 1.0 + s} for s in range(3, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in first + again))
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0
    # smoothed over the last 10 steps, one line per step: (9 + 9 + 9 + 4 + 5 + 6) / 6 (with the repeats 69 / 9)
    assert "final loss 7.0000" in capsys.readouterr().out
