"""No finished analysis is ever lost: a result folder is replaced all at once or not at all, one process writes it
at a time, a ``--json`` file another process wrote meanwhile is kept, outputs never land among a training run's own
files, figures are written atomically, and SIGTERM ends a command as Ctrl-C does."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from sinklens.cli import main
from sinklens.errors import EXIT_INTERRUPTED, EXIT_USAGE, OutputExistsError, OutputNotWritableError
from sinklens.export import write_json
from sinklens.folder_lock import OUTPUT_LOCK, FolderLock
from sinklens.plotting.style import save_figure
from support.zoo import zoo_dir


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (hidden ones included) with the hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def _analyze(out: Path, *extra: str, n: str = "2") -> int:
    return main(["analyze", "--model", str(zoo_dir("gpt2")), "--random-tokens", n, "--seq-len", "8",
                 "--out", str(out), "--device", "cpu", *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "report"
    assert _analyze(out) == 0
    return out


def test_a_failure_while_saving_leaves_the_earlier_analysis_as_it_was(finished, tmp_path, monkeypatch, capsys):
    import shutil

    from sinklens.plotting import report as report_files

    out = tmp_path / "report"
    shutil.copytree(finished, out)
    before = _snapshot(out)
    real = report_files.figure_makers

    def one_figure_fails(report):
        makers = dict(real(report))
        makers["value_drain.png"] = lambda: (_ for _ in ()).throw(RuntimeError("plotting broke"))
        return makers

    monkeypatch.setattr(report_files, "figure_makers", one_figure_fails)
    assert _analyze(out, "--overwrite", n="3") != 0
    assert _snapshot(out) == before  # the old report, its figures, no staging folder and no temporary file
    monkeypatch.setattr(report_files, "figure_makers", real)
    assert _analyze(out, "--overwrite", n="3") == 0  # the same command without the fault replaces it whole
    assert json.loads((out / "report.json").read_text())["n_sequences"] == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    capsys.readouterr()


def test_a_folder_another_process_is_writing_is_refused(tmp_path, capsys):
    out = tmp_path / "busy"
    with FolderLock(out, OUTPUT_LOCK):  # flock conflicts between two open files, in one process too
        assert _analyze(out) == EXIT_USAGE
        assert main(["origins", "--model", str(zoo_dir("gpt2")), "--sequences", "2", "--seq-len", "4",
                     "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("is being written by another sinklens process (pid ") == 2, err
    assert not (out / "report.json").exists() and not (out / "origins.json").exists()


def test_a_json_file_written_meanwhile_is_kept_without_overwrite(tmp_path):
    path = tmp_path / "result.json"
    path.write_text('{"theirs": 1}\n')
    with pytest.raises(OutputExistsError, match="written by another process while this one ran; it is kept"):
        write_json(path, {"ours": 2}, replace=False)
    assert json.loads(path.read_text()) == {"theirs": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary file left
    write_json(tmp_path / "new.json", {"ours": 2}, replace=False)
    write_json(path, {"ours": 2}, replace=True)
    assert json.loads(path.read_text()) == {"ours": 2}


def test_outputs_are_refused_among_a_training_runs_own_files(tmp_path, capsys):
    from sinklens.sinklm.config import TrainConfig
    from sinklens.train.loop import train

    run = tmp_path / "run"
    cfg = TrainConfig.from_dict({  # a seconds-long run, as tests/train/_train_cfg.py's build_cfg
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 4, "d_mlp": 32, "n_ctx": 16, "d_vocab": 24},
        "data": {"source": "bigram-backcopy", "seq_len": 16, "vocab_size": 24},
        "eval": {"interval": 0}, "steps": 4, "batch_size": 4, "device": "cpu", "checkpoint_interval": 2})
    train(cfg, out_dir=run, progress=False)
    before = _snapshot(run)
    step = next((run / "checkpoints").iterdir())
    model = str(zoo_dir("gpt2"))
    calls = [
        ["analyze", "--model", str(run), "--random-tokens", "2", "--out", str(step / "analysis")],
        ["origins", "--model", str(run), "--sequences", "2", "--seq-len", "4", "--out", str(run / "checkpoints")],
        ["fingerprint", model, model, "--json", str(run / "config.json"), "--overwrite"],
        ["intervene", "--model", model, "--method", "self-only", "--position", "2", "--random-tokens", "2",
         "--json", str(step / "manifest.json"), "--overwrite"],
        ["compare", str(run), "--out", str(step / "compare.png")],  # was written there, then pruned with the step
    ]
    for argv in calls:
        assert main(argv) == EXIT_USAGE, argv
    err = capsys.readouterr().err
    assert err.count("which the trainer manages") == 4 and err.count("replacing it would break the run") == 1, err
    assert "is inside the checkpoints/ folder of the training run" in err
    assert _snapshot(run) == before
    assert _analyze(run) == 0  # the run's own folder is fine: nothing of the run's is replaced
    assert set(before) <= set(_snapshot(run))


def test_a_figure_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "fig.png"
    path.write_bytes(b"the earlier figure")
    fig, ax = plt.subplots()
    ax.plot([0, 1])

    def broken_savefig(target, **kw):
        Path(target).write_bytes(b"half a pn")
        raise OSError(28, "No space left on device")

    fig.savefig = broken_savefig
    with pytest.raises(OutputNotWritableError, match=r"Cannot write '.*fig\.png': No space left on device"):
        save_figure(fig, path)
    assert path.read_bytes() == b"the earlier figure"
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]
    fig2, ax2 = plt.subplots()
    ax2.plot([0, 1])
    assert save_figure(fig2, tmp_path / "plain") == tmp_path / "plain.png"  # no suffix: PNG, as matplotlib does
    assert (tmp_path / "plain.png").read_bytes()[:4] == b"\x89PNG"


def test_sigterm_ends_a_command_as_ctrl_c_does(tmp_path):
    """SIGTERM during the analysis pass (once its progress bar shows): one line, exit 130, no --out left behind."""
    import threading

    out = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sinklens.cli", "analyze", "--model", str(zoo_dir("gpt2")), "--random-tokens", "4000",
         "--seq-len", "64", "--out", str(out), "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while "sinklens analyze:" not in "".join(err) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == EXIT_INTERRUPTED, "".join(err)
    reader.join(timeout=10)
    text = "".join(err)
    assert "sinklens analyze: interrupted" in text and "Traceback" not in text, text
    assert not out.exists()  # the --out it created, left empty, is removed
