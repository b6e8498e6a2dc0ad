"""``--help`` of every command: one screen (<= 40 lines, <= 100 columns), plain text, printed without importing
torch; and the defaults the commands, the API and the trainer share come from one place."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sinklens.cli import COMMANDS, main

HELPS = [[], *([command] for command in COMMANDS)]


@pytest.mark.parametrize("command", HELPS, ids=["sinklens", *COMMANDS])
def test_help_fits_a_screen(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 40, "\n".join(lines)
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    text = "\n".join(lines)
    assert "``" not in text and ":mod:" not in text and "│" not in text and "╭" not in text


def test_train_fields_are_one_plain_line_each(capsys):
    from sinklens.sinklm.config import flag_keys

    assert main(["train", "--fields"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(flag_keys()) and max(map(len, lines)) <= 100
    assert "``" not in "\n".join(lines) and "│" not in "\n".join(lines)
    lr = next(line for line in lines if line.startswith("  --optim.lr "))
    assert lr.split()[:4] == ["--optim.lr", "FLOAT", "=", "0.001"] and "peak learning rate" in lr
    assert any(line.startswith("  --data.seq-len INT = 64") for line in lines)


def test_help_imports_neither_torch_nor_transformer_lens():
    """Every ``--help`` answers without torch (about 2 s of imports on a busy machine): checked in a fresh
    interpreter, where nothing was imported before."""
    script = (
        "import sys\n"
        "from sinklens.cli import COMMANDS, main\n"
        "for argv in [['--help'], *([c, '--help'] for c in COMMANDS)]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformer_lens', 'transformers'))\n"
        "print('HEAVY', heavy[:5], file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr, done.stderr


def test_shared_defaults_come_from_sinklens_options():
    """One sink threshold, batch size and sequence length for the API, the trainer's metrics and every command."""
    import inspect

    from sinklens.analysis.sinks import SinkSettings
    from sinklens.analysis.value_drain import ValueDrainSettings
    from sinklens.cli import build_parser
    from sinklens.options import BATCH_SIZE, SEQ_LEN, SINK_THRESHOLD, RunOptions
    from sinklens.origins.positional import positional_over_training
    from sinklens.origins.preference import RandomInputs
    from sinklens.sinklm.config import DataConfig, EvalConfig
    from sinklens.train.sink_metrics import evaluate

    assert SINK_THRESHOLD == 0.3 and (SinkSettings().sink_threshold, ValueDrainSettings().sink_head_threshold,
                                      EvalConfig().sink_threshold) == (SINK_THRESHOLD,) * 3
    assert inspect.signature(evaluate).parameters["threshold"].default == SINK_THRESHOLD
    assert RunOptions().batch_size == BATCH_SIZE
    assert (RandomInputs().seq_len, DataConfig().seq_len, EvalConfig().persistence_seq_len) == (SEQ_LEN,) * 3
    assert inspect.signature(positional_over_training).parameters["seq_len"].default == SEQ_LEN
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("analyze", "intervene", "origins", "fingerprint"):
        assert commands[name].get_default("batch_size") == BATCH_SIZE, name
    assert commands["compare"].get_default("seq_len") == SEQ_LEN


def test_command_constants_match_the_library():
    """What the torch-free command modules restate for their help is the library's value."""
    import importlib

    from sinklens.commands import fingerprint as command
    from sinklens.commands.train import SYNTHETIC_DATA
    from sinklens.sinklm.config import SYNTHETIC_SOURCES

    library = importlib.import_module("sinklens.origins.fingerprint")

    for name in ("DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN", "DEFAULT_BUFFER_K", "DEFAULT_ALPHA", "DEFAULT_SEED"):
        assert getattr(command, name) == getattr(library, name), name
    assert SYNTHETIC_DATA == SYNTHETIC_SOURCES


def test_json_file_means_the_same_in_every_command():
    """``--json FILE`` (``-``: stdout) in each command that writes JSON, with one help text."""
    from sinklens.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    helps = {}
    for name in ("intervene", "compare", "fingerprint"):
        action = next(a for a in commands[name]._actions if "--json" in a.option_strings)
        assert action.metavar == "FILE" and action.nargs is None and action.default is None, name
        helps[name] = action.help.split(" as strict JSON to FILE")[1]
    assert len(set(helps.values())) == 1, helps


def test_compare_json_file_holds_what_json_dash_prints(tmp_path, capsys):
    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 4.0 - s / 2}) + "\n"
                                               for s in range(4)))
    (run / "config.json").write_text(json.dumps({"model": {"variant": "baseline"}, "steps": 4}))
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png"), "--json", "-"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png"), "--overwrite", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "final loss" in out and json.loads((tmp_path / "s.json").read_text()) == printed
    assert printed[0]["final_loss"] == pytest.approx(sum(4.0 - s / 2 for s in range(4)) / 4)  # smoothing 10 > 4 steps
    assert main(["compare", str(run), "--out", str(tmp_path / "d.png"), "--json", str(tmp_path / "s.json")]) == 2
    assert "--json would replace" in capsys.readouterr().err
