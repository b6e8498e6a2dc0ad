"""The `peft` and `layer-card` commands: short plain help, one-line errors before any model loads."""

from __future__ import annotations

import pytest

from sinklens.cli import main


@pytest.mark.parametrize("command", ["peft", "layer-card"])
def test_help_fits_40_lines_of_100_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 100


@pytest.mark.parametrize("argv,message", [
    (["peft", "lora", "--rank", "0"], "--rank must be an integer >= 1, got 0"),
    (["peft", "prefix", "--steps", "-1"], "--steps"),
    (["layer-card", "--check-steps", "5"], "--check-steps needs --top-k"),
    (["layer-card", "--top-k", "0"], "--top-k"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith(f"sinklens {argv[0]}: error:")


def test_the_commands_know_every_method_and_objective():
    """The CLI names them without importing torch; they must stay the library's."""
    from sinklens.cli import build_parser
    from sinklens.commands.peft import METHODS
    from sinklens.peft.adapters import METHODS as LIBRARY_METHODS
    from sinklens.peft.layer_card import OBJECTIVES

    assert METHODS == LIBRARY_METHODS
    card = build_parser()._subparsers._group_actions[0].choices["layer-card"]
    assert next(a.choices for a in card._actions if a.dest == "objective") == OBJECTIVES
