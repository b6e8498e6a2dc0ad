"""What the commands print and write: strict JSON on stdout, output paths checked before the work and
named as written, defaults that fit the model's context, and conflicting or empty flags refused by name.

Run in-process (``sinklens.cli.main``) on the tiny zoo models and hand-written run folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sinklens.cli import main
from sinklens.errors import EXIT_FAILURE, EXIT_USAGE, InvalidArgumentError
from support.zoo import zoo_dir


def _strict_json(text: str):
    """``json.loads`` that refuses NaN / Infinity (strict JSON) and trailing text."""
    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _clean(err: str) -> None:
    assert "Traceback" not in err and "internal error" not in err


def _run_dir(root: Path, name: str, *, losses=(4.0, 3.5, 3.0, 2.6, 2.4, 2.2), config: str | None = None) -> Path:
    """A folder as ``sinklens train`` leaves it, as far as ``compare`` reads it: metrics.jsonl and config.json."""
    run = root / name
    run.mkdir()
    lines = [{"kind": "train", "step": s, "loss": loss} for s, loss in enumerate(losses)]
    lines.append({"kind": "eval", "step": len(losses) - 1, "sink_rate": 0.5, "sinklens_sink_rate": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "config.json").write_text(config if config is not None else json.dumps({"model": {"variant": "baseline"}}))
    return run


# 1. compare --json -: stdout holds only the JSON


def test_compare_json_stdout_is_only_strict_json(tmp_path, capsys):
    a, b = _run_dir(tmp_path, "a"), _run_dir(tmp_path, "b", losses=(4.0, 3.0, 2.0, 1.5, 1.2, 1.0))
    fig = tmp_path / "c.png"
    assert main(["compare", str(a), str(b), "--json", "-", "--out", str(fig), "--smoothing", "2"]) == 0
    out, err = capsys.readouterr()
    rows = _strict_json(out)  # "Extra data" when the figure line followed the JSON
    assert [row["run"] for row in rows] == ["baseline @ a", "baseline @ b"]
    assert f"figure: {fig}" in err and "figure" not in out
    assert fig.is_file()


# 2. compare --out: checked before the work, the path written is the path printed


def test_compare_out_folder_refused_before_the_work(tmp_path, capsys):
    a = _run_dir(tmp_path, "a")
    folder = tmp_path / "figs"
    folder.mkdir()
    assert main(["compare", str(a), "--out", str(folder)]) == EXIT_USAGE
    err = capsys.readouterr().err
    _clean(err)
    assert repr(str(folder)) in err and "is a folder" in err
    assert not (tmp_path / "figs.png").exists()


def test_compare_out_unknown_suffix_refused_before_the_work(tmp_path, capsys):
    a = _run_dir(tmp_path, "a")
    assert main(["compare", str(a), "--out", str(tmp_path / "fig.txt")]) == EXIT_USAGE
    out, err = capsys.readouterr()
    _clean(err)
    assert "fig.txt" in err and "'.txt'" in err and ".png" in err
    assert out == "" and not (tmp_path / "fig.txt").exists()  # refused before the summary and the figure


def test_compare_out_under_a_file_refused(tmp_path, capsys):
    a = _run_dir(tmp_path, "a")
    (tmp_path / "afile").write_text("x")
    assert main(["compare", str(a), "--out", str(tmp_path / "afile" / "x.png")]) == EXIT_USAGE
    err = capsys.readouterr().err
    _clean(err)
    assert "afile" in err and "not a folder" in err


def test_compare_out_without_suffix_gets_png_and_says_so(tmp_path, capsys):
    a = _run_dir(tmp_path, "a")
    assert main(["compare", str(a), "--out", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "fig.png").is_file() and not (tmp_path / "fig").exists()
    assert f"figure: {tmp_path / 'fig.png'}" in out


# 5. compare on a run with a corrupt config.json names the file


def test_compare_corrupt_config_names_the_file(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", config='{"model": {"variant": "base')
    assert main(["compare", str(a), "--out", str(tmp_path / "c.png")]) == EXIT_FAILURE  # as `train --resume` says it
    err = capsys.readouterr().err
    _clean(err)
    assert repr(str(a / "config.json")) in err and "not valid JSON" in err


# 3. default --seq-len / --max-length capped at the model's context; the message names the flag


@pytest.fixture(scope="module")
def ctx32() -> Path:
    return zoo_dir("llama", n_ctx=32)


def test_analyze_default_seq_len_fits_a_short_context(ctx32, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["analyze", "--model", str(ctx32), "--random-tokens", "2", "--out", str(out), "--no-figures",
                 "--device", "cpu"]) == 0
    _clean(capsys.readouterr().err)
    assert _strict_json((out / "report.json").read_text())
    # an explicit --seq-len beyond the context is still refused, by name
    assert main(["analyze", "--model", str(ctx32), "--random-tokens", "2", "--seq-len", "40",
                 "--out", str(tmp_path / "r2"), "--device", "cpu"]) == EXIT_USAGE
    err = capsys.readouterr().err
    _clean(err)
    assert "--seq-len 40" in err and "32" in err


def test_intervene_default_seq_len_fits_a_short_context(ctx32, capsys):
    assert main(["intervene", "--model", str(ctx32), "--method", "self-only", "--position", "2",
                 "--random-tokens", "2", "--device", "cpu", "--no-loss"]) == 0
    out, err = capsys.readouterr()
    _clean(err)
    assert "method=self_only" in out


def test_analyze_default_max_length_fits_a_short_context(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["analyze", "--model", str(zoo_dir("gpt2")), "--stdlib-text", "2", "--out", str(out),
                 "--no-figures", "--device", "cpu"]) == 0  # n_ctx 64 < the default cut of 128 tokens
    _clean(capsys.readouterr().err)
    assert (out / "report.json").is_file()


def test_too_long_messages_name_the_argument_and_the_flag(ctx32):
    from sinklens.inputs import random_token_batches, tokenize_prompts
    from sinklens.loading import load_model

    model = load_model(str(ctx32), device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"seq_len=32 .*--seq-len 32"):
        random_token_batches(model, n_sequences=1, seq_len=40)
    with pytest.raises(InvalidArgumentError, match=r"max_length=32 .*--max-length 32"):
        tokenize_prompts(model, ["word " * 60])


# 4. --json "" refused by name


@pytest.mark.parametrize("argv", [
    ["intervene", "--model", "no-such-model", "--method", "self-only", "--position", "2", "--json", ""],
    ["fingerprint", "no-such-a", "no-such-b", "--json", ""],
])
def test_empty_json_path_is_refused(argv, capsys):
    assert main(argv) == EXIT_USAGE  # before the model loads: the models named do not exist
    err = capsys.readouterr().err
    _clean(err)
    assert "--json is empty" in err


# 6. --model SPEC@init:S with another --init-seed


def test_origins_conflicting_init_seeds_refused(tmp_path, capsys):
    spec = f"{zoo_dir('llama')}@init:3"
    out = tmp_path / "o"
    assert main(["origins", "--model", spec, "--init-seed", "4", "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    _clean(err)
    assert "--init-seed 4" in err and "seed 3" in err and spec in err
    assert not out.exists()
    # the same seed twice is no conflict
    assert main(["origins", "--model", spec, "--init-seed", "3", "--out", str(out), "--sequences", "2",
                 "--seq-len", "4", "--no-figures", "--device", "cpu"]) == 0
    assert _strict_json((out / "origins.json").read_text())["init_seed"] == 3


# 7. intervene --layers with a repeated layer


@pytest.mark.parametrize("flag", ["--layers", "--dims"])
def test_intervene_repeated_index_refused(flag, capsys):
    argv = ["intervene", "--model", "no-such-model", "--method", "transplant-dims", "--position", "2",
            "--dims", "3", "--layers", "0,1"]
    argv[argv.index(flag) + 1] = "0,1,0"
    assert main(argv) == EXIT_USAGE  # before the model loads
    err = capsys.readouterr().err
    _clean(err)
    assert f"{flag} '0,1,0'" in err and "0 more than once" in err


@pytest.mark.parametrize("command", ["analyze", "fingerprint", "intervene", "origins"])
def test_output_piped_into_a_reader_that_leaves_ends_quietly(tmp_path, command):
    """``sinklens analyze | head -1``: the reader closes the pipe; the report is still written, and the command
    ends with exit 1 and nothing on stderr (no "error: Broken pipe", no traceback from the flush at exit)."""
    import subprocess
    import sys

    model = str(zoo_dir("gpt2"))
    out = tmp_path / "g"
    argv, written = {
        "analyze": (["analyze", "--model", model, "--stdlib-text", "2", "--out", str(out), "--no-figures"],
                    out / "report.json"),
        "fingerprint": (["fingerprint", model, model, "--samples", "8", "--json", str(tmp_path / "f.json")],
                        tmp_path / "f.json"),
        "origins": (["origins", "--model", model, "--sequences", "4", "--seq-len", "8", "--out", str(out), "--no-figures"],
                    out / "origins.json"),
        "intervene": (["intervene", "--model", model, "--method", "self-only", "--position", "2", "--random-tokens", "2",
                       "--no-loss", "--json", str(tmp_path / "i.json")], tmp_path / "i.json"),
    }[command]
    proc = subprocess.Popen([sys.executable, "-m", "sinklens.cli", *argv, "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line is printed
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == EXIT_FAILURE
    assert "rror" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert _strict_json(written.read_text())


# 5. --text is repeatable on every command that has it, and every prompt is kept


def test_every_text_flag_keeps_every_prompt():
    from sinklens.cli import build_parser

    parser = build_parser()
    commands = [name for name, sub in parser._subparsers._group_actions[0].choices.items()
                if "--text" in sub._option_string_actions]
    assert sorted(commands) == ["analyze", "intervene"]
    for name in commands:
        args = parser.parse_args([name, "--method", "self-only"][: 3 if name == "intervene" else 1]
                                 + ["--text", "a", "--text", "b", "c"])
        assert args.text == ["a", "b", "c"], name


def test_analyze_repeated_text_analyses_every_prompt(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["analyze", "--model", str(zoo_dir("gpt2")), "--text", "a b c", "--text", "d e f", "--text", "g h i",
                 "--out", str(out), "--no-figures", "--device", "cpu"]) == 0
    _clean(capsys.readouterr().err)
    report = _strict_json((out / "report.json").read_text())
    assert report["n_sequences"] == 3
    assert report["bos"] == "<s> added (the model's own tokenizer adds one)"


@pytest.mark.parametrize("command", [["analyze"], ["intervene", "--method", "self-only"]])
def test_bos_is_chosen_with_bos_or_no_bos(command):
    from sinklens.cli import build_parser

    parser = build_parser()
    # neither flag: None, as the model's own tokenizer does (sinklens.inputs.resolved_bos)
    assert [parser.parse_args(command + flag).bos for flag in ([], ["--bos"], ["--no-bos"])] == [None, True, False]
