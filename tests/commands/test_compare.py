"""``sinklens compare``'s inputs and outputs (audit O): a ``train`` line without a finite loss is refused by name
(F7), and the figures never replace another file unasked: ``--positional``'s figure is named after ``--out``
(origins writes ``positional.png``), and an existing figure needs ``--overwrite`` (F8).

In-process (``sinklens.cli.main``) on hand-written run folders; ``--positional`` on one tiny trained run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sinklens.cli import main
from sinklens.errors import EXIT_FAILURE, EXIT_USAGE, CorruptFileError


def _run_dir(root: Path, name: str, lines: list[dict] | None = None, *, raw: list[str] | None = None) -> Path:
    """A folder as ``sinklens train`` leaves it, as far as ``compare`` reads it: metrics.jsonl and config.json."""
    run = root / name
    run.mkdir()
    if lines is None:
        lines = [{"kind": "train", "step": s, "loss": 4.0 - s / 4} for s in range(6)]
        lines.append({"kind": "eval", "step": 5, "sink_rate": 0.5, "sinklens_sink_rate": 0.5})
    rows = raw if raw is not None else [json.dumps(line) for line in lines]
    (run / "metrics.jsonl").write_text("".join(row + "\n" for row in rows))
    (run / "config.json").write_text(json.dumps({"model": {"variant": "baseline"}, "steps": 6}))
    return run


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _clean(err: str) -> None:
    assert "Traceback" not in err and "internal error" not in err and "NoneType" not in err, err


# ---- F7: a train line without a finite loss ----------------------------------------------------------------------


@pytest.mark.parametrize("loss_text, shown", [
    ("null", '"loss": null'), ("NaN", '"loss": NaN'), ("Infinity", '"loss": Infinity'),
    ('"2.5"', '"loss": "2.5"'), ("true", '"loss": true'), (None, 'no "loss"'),
])
def test_compare_refuses_a_train_line_without_a_finite_loss_naming_file_and_line(tmp_path, capsys, loss_text, shown):
    good = _run_dir(tmp_path, "good")
    rows = [json.dumps({"kind": "eval", "step": 0, "sink_rate": None}), ""]  # a blank line still counts as a line
    rows += [json.dumps({"kind": "train", "step": s, "loss": 4.0 - s / 4}) for s in range(2)]
    rows.append('{"kind": "train", "step": 2' + (f', "loss": {loss_text}' if loss_text is not None else "") + "}")
    rows += [json.dumps({"kind": "train", "step": s, "loss": 4.0 - s / 4}) for s in range(3, 6)]
    bad = _run_dir(tmp_path, "bad", raw=rows)
    out = tmp_path / "c.png"
    assert main(["compare", str(good), str(bad), "--out", str(out)]) == EXIT_FAILURE
    err = capsys.readouterr().err
    _clean(err)
    (line,) = err.splitlines()
    assert line.startswith(f"sinklens compare: error: {bad / 'metrics.jsonl'}: line 5 is a \"train\" line with {shown}")
    assert not out.exists()  # refused before the figure


def test_read_metrics_raises_the_named_error(tmp_path):
    from sinklens.sinklm.checkpoint import read_metrics

    run = _run_dir(tmp_path, "r", [{"kind": "train", "step": 0, "loss": 3.0}, {"kind": "train", "step": 1, "loss": None}])
    with pytest.raises(CorruptFileError, match=r"metrics.jsonl: line 2 is a \"train\" line with \"loss\": null"):
        read_metrics(run)
    fine = _run_dir(tmp_path, "fine")
    assert [line["loss"] for line in read_metrics(fine) if line["kind"] == "train"] == [4.0 - s / 4 for s in range(6)]


def test_null_eval_metrics_and_nonfinite_lines_are_still_accepted(tmp_path, capsys):
    """What a diverged run writes (null eval metrics, a ``nonfinite`` line with a null loss) is not damage."""
    lines = [{"kind": "train", "step": s, "loss": 4.0 - s / 4} for s in range(3)]
    lines += [{"kind": "eval", "step": 2, "sink_rate": None, "val_loss": None},
              {"kind": "nonfinite", "step": 3, "loss": None, "grad_norm": None, "lr": 1.0, "action": "stop"}]
    run = _run_dir(tmp_path, "div", lines)
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png"), "--json", "-"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "diverged" and row["val_loss"] is None


# ---- F8: compare's figures never replace another file unasked ----------------------------------------------------


def test_a_second_compare_on_the_same_out_needs_overwrite(tmp_path, capsys):
    run = _run_dir(tmp_path, "a")
    default = run / "compare.png"
    assert main(["compare", str(run)]) == 0
    capsys.readouterr()
    before = _md5(default)
    default.write_bytes(b"not the figure")  # to see whether it is replaced
    assert main(["compare", str(run)]) == EXIT_USAGE
    err = capsys.readouterr().err
    _clean(err)
    assert f"--out would replace {str(default)!r}" in err and "--overwrite" in err
    assert default.read_bytes() == b"not the figure"
    assert main(["compare", str(run), "--overwrite"]) == 0
    assert _md5(default) == before


def test_the_refusal_comes_before_the_work(tmp_path, capsys):
    run = _run_dir(tmp_path, "a")
    (run / "metrics.jsonl").write_text("not json\nnot json\n")  # reading it would fail with exit 1
    taken = tmp_path / "c.png"
    taken.write_bytes(b"someone's figure")
    assert main(["compare", str(run), "--out", str(taken)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--out would replace" in err and "not JSON" not in err


def test_positional_figure_is_named_after_out_and_never_takes_origins_file(tmp_path, capsys):
    """``origins --out D`` writes ``D/positional.png``; ``compare --positional --out D/compare.png`` replaced it."""
    from sinklens.sinklm.config import TrainConfig
    from sinklens.train.loop import train

    cfg = TrainConfig.from_dict({  # as tests/train/_train_cfg.py's build_cfg, 1 layer, 2 steps
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 4, "d_mlp": 32, "n_ctx": 16, "d_vocab": 24},
        "optim": {"lr": 1e-2, "warmup_steps": 1},
        "data": {"source": "bigram-backcopy", "seq_len": 16, "vocab_size": 24, "alpha": 0.05},
        "eval": {"interval": 0, "batches": 1, "batch_size": 8},
        "steps": 2, "batch_size": 4, "checkpoint_interval": 1, "keep_every": 1, "device": "cpu"})
    run = tmp_path / "run"
    train(cfg, out_dir=run, progress=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    origins_figure = shared / "positional.png"
    origins_figure.write_bytes(b"origins' figure")  # as `sinklens origins --out shared` leaves it
    argv = ["compare", str(run), "--positional", "--n-sequences", "2", "--seq-len", "4", "--out", str(shared / "compare.png")]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    printed = captured.out
    assert "positional (run)" in captured.err and "3/3" in captured.err  # a bar over the checkpoints (it was silent)
    assert origins_figure.read_bytes() == b"origins' figure"
    positional = shared / "compare-positional.png"
    assert positional.stat().st_size > 1000 and f"figure: {positional}" in printed
    # a second run: both figures are refused by name without --overwrite, nothing is replaced
    assert main(argv) == EXIT_USAGE
    assert "compare.png" in capsys.readouterr().err
    (shared / "compare.png").unlink()
    positional.write_bytes(b"old")
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--out would replace {str(positional)!r}" in err
    assert positional.read_bytes() == b"old" and not (shared / "compare.png").exists()  # refused before the work
    assert main([*argv, "--overwrite"]) == 0
    assert positional.stat().st_size > 1000 and origins_figure.read_bytes() == b"origins' figure"
    # --out positional.png itself is a file that exists: refused too
    assert main([*argv[:-1], str(origins_figure)]) == EXIT_USAGE
    assert origins_figure.read_bytes() == b"origins' figure"


def test_help_names_overwrite_and_the_positional_figure(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert "--overwrite" in text and "compare-positional.png" in text and "-positional" in text
