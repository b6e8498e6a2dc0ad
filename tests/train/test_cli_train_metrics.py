"""`sinklens train` / `sinklens compare` on undefined metrics, diverged, empty and unfinished runs, unquoted
list overrides, a run without its config.json and a figures path that is not a folder."""

from __future__ import annotations

import json
import shutil

import pytest

from sinklens.cli import main
from sinklens.errors import InvalidArgumentError

TINY = ["--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set", "model.d_vocab=24", "--set", "data.vocab_size=24",
        "--seq-len", "16", "--batch-size", "4", "--device", "cpu", "--no-progress", "--set", "compile=false",
        "--set", "eval.batches=1", "--set", "eval.batch_size=4", "--preset", "tiny", "--data", "bigram-backcopy"]


def _write_run(folder, lines, *, steps):
    """A run directory as `sinklens compare` reads it: config.json (steps) and metrics.jsonl."""
    from sinklens.sinklm.config import TrainConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TrainConfig(steps=steps).to_dict()))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def _train_lines(losses, start=0):
    return [{"kind": "train", "step": start + i, "loss": loss} for i, loss in enumerate(losses)]


# ---- 1. undefined (NaN, written null) metrics print as n/a -------------------------------------------------------


def test_metric_text_prints_undefined_values_as_na():
    from sinklens.commands.compare import metric_text

    assert metric_text(1.23456, ".3f") == "1.235"
    assert metric_text(None, ".3f") == metric_text(float("nan"), ".4f") == metric_text(float("inf"), ".2f") == "n/a"
    assert metric_text(None, "8.3g") == "     n/a"


def test_compare_prints_null_eval_metrics_as_na_and_json_stays_strict(tmp_path, capsys):
    eval_line = {"kind": "eval", "step": 2, "val_loss": 5.5, "sink_rate": None, "sinklens_sink_rate": None,
                 "first_token_norm_ratio": None,
                 "variance_ratio": None, "persistence_spearman": 1.0, "persistence_kendall": None,
                 "persistence_direction_cos": None}
    run = _write_run(tmp_path / "run", _train_lines([5.6, 5.5]) + [eval_line], steps=2)
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "sink_rate n/a" in out and "sinklens_sink_rate n/a" in out and "Kendall n/a" in out and "|cos| n/a" in out, out
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png"), "--overwrite", "--json", "-"]) == 0
    text = capsys.readouterr().out
    (row,) = json.loads(text)  # strict JSON: null, never NaN or "n/a"
    assert row["sink_rate"] is None and row["persistence_kendall"] is None and "NaN" not in text


def test_resume_after_null_eval_metrics_reports_na(tmp_path, capsys):
    """A resumed run re-reads its earlier evals from metrics.jsonl, where NaN is null: the summary said
    "error: unsupported format string passed to NoneType.__format__" (exit 2) after training fine."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--set", "eval.interval=1", "--out", str(out)]) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for line in lines:  # what a run with an undefined metric (init_std=1e-30) writes
        if line["kind"] == "eval":
            line["first_token_norm_ratio"] = line["variance_ratio"] = None
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--set", "eval.interval=0", "--no-progress"]) == 0, \
        capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "first_token_norm_ratio n/a, variance_ratio n/a" in printed, printed


# ---- 2. compare: a status per run; a NaN default target is refused -------------------------------------------------


def test_compare_marks_diverged_and_incomplete_runs(tmp_path, capsys):
    good = _write_run(tmp_path / "good", _train_lines([5.0, 4.0, 3.0, 2.0]), steps=4)
    diverged = _write_run(tmp_path / "div", _train_lines([5.5]) + [
        {"kind": "nonfinite", "step": 1, "loss": None, "grad_norm": None, "lr": 1.0, "action": "stop"}], steps=10)
    short = _write_run(tmp_path / "short", _train_lines([5.0, 4.5]), steps=10)
    skipped = _write_run(tmp_path / "skip", _train_lines([5.0]) + [
        {"kind": "nonfinite", "step": 1, "loss": None, "grad_norm": None, "lr": 1.0, "action": "skip"}]
        + _train_lines([4.0, 3.5], start=2), steps=4)
    runs = [str(good), str(diverged), str(short), str(skipped)]
    assert main(["compare", *runs, "--smoothing", "1", "--out", str(tmp_path / "c.png"), "--json", "-"]) == 0
    rows = {row["run"].split(" @ ")[1]: row for row in json.loads(capsys.readouterr().out)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "good": "finished", "div": "diverged", "short": "incomplete", "skip": "finished"}
    assert (rows["div"]["steps_done"], rows["div"]["steps"]) == (1, 10)
    assert (rows["short"]["steps_done"], rows["short"]["steps"]) == (2, 10)
    assert main(["compare", *runs, "--smoothing", "1", "--out", str(tmp_path / "c.png"), "--overwrite"]) == 0
    table = {line.split(":")[0].split(" @ ")[1]: line for line in capsys.readouterr().out.splitlines() if " @ " in line}
    assert "diverged at step 1 of 10" in table["div"] and "incomplete: 2 of 10 steps" in table["short"], table
    assert "finished" in table["good"] and "finished" in table["skip"], table


def test_compare_refuses_a_nan_default_target(tmp_path, capsys):
    empty = _write_run(tmp_path / "empty", [], steps=4)
    good = _write_run(tmp_path / "good", _train_lines([5.0, 4.0, 3.0, 2.0]), steps=4)
    assert main(["compare", str(empty), str(good), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert "--target-loss" in err and "empty" in err and "Traceback" not in err, err
    assert main(["compare", str(empty), str(good), "--target-loss", "3.5", "--smoothing", "1",
                 "--out", str(tmp_path / "c.png"), "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in rows] == ["incomplete", "finished"] and rows[0]["final_loss"] is None
    assert rows[1]["steps_to_target"] == 2


def test_summarize_names_the_run_of_a_nan_target():
    from sinklens.commands.compare import summarize

    with pytest.raises(InvalidArgumentError, match=r"'first'.*--target-loss"):
        summarize({"first": [], "second": _train_lines([1.0])})


# ---- 3. a list-typed key: one flag with several values, or --set with one --------------------------------------------


def test_list_flags_and_set_items_parse_to_the_same_list():
    from sinklens.sinklm.config import TrainConfig, apply_overrides, parse_flags

    flags = parse_flags(TrainConfig(), ["--interventions", "restart:positions=4,scale=2", "zero"]).interventions
    assert flags == ["restart:positions=4,scale=2", "zero"]
    assert apply_overrides(TrainConfig(), ["interventions=restart:positions=4,scale=2"]).interventions == flags[:1]
    assert parse_flags(TrainConfig(), ["--interventions"]).interventions == []


def test_a_bad_intervention_on_the_command_line_is_one_line(tmp_path, capsys):
    assert main(["train", "--data", "bigram-backcopy", "--steps", "2", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "r"), "--set", "interventions=[a]"]) == 2
    err = capsys.readouterr().err
    assert "'[a]'" in err and "internal error" not in err and len(err.strip().splitlines()) == 1, err


# ---- 4. a run whose config.json is gone: --resume uses its checkpoint's config ----------------------------------------


def test_resume_without_config_json_uses_the_checkpoint_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--set", "eval.interval=0", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").unlink()
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "2", "--set", "eval.interval=0", "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err  # the advice ...
    with pytest.warns(UserWarning, match=r"has no config.json; resuming with the config saved in its checkpoint of step 2"):
        code = main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "resumed at step 2" in capsys.readouterr().out  # ... works
    restored = json.loads((out / "config.json").read_text())
    assert restored["steps"] == 3 and restored["model"] == saved["model"]


def test_resume_of_a_folder_without_config_or_checkpoint_is_one_message(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "Traceback" not in err, err


# ---- 5. OUT/figures must be a writable folder before training starts ---------------------------------------------


def test_figures_path_that_is_a_file_fails_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "figures").write_text("x")
    assert main(["train", *TINY, "--steps", "2", "--set", "eval.interval=0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "figures" in err and "not a folder" in err and "Traceback" not in err, err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    shutil.rmtree(out)
