"""``sinklens origins`` on a tiny run at init: summaries printed, strict JSON and figures written."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.models


def test_origins_cli_writes_report(trained_runs, tmp_path, capsys):
    from sinklens.cli import main

    out = tmp_path / "rep"
    code = main(["origins", "--model", f"{trained_runs[1]}@init", "--sequences", "16", "--seq-len", "8",
                 "--batch-size", "16", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "origins.json").read_text())
    assert data["token_preference"]["n_sequences"] == 16 and data["token_preference"]["seq_len"] == 8
    sites = [s["site"] for s in data["contraction"]["sites"]]
    assert sites == ["embed", "attn 0", "mlp 0", "attn 1", "mlp 1", "final"]
    assert len(data["positional"]["attn_out_var"]) == 2 and data["positional"]["attn_out_var"][0] > 1
    assert {p.name for p in out.glob("*.png")} == {"rank_probability.png", "contraction.png", "positional.png"}
    assert (out / "index.md").read_text().count("\n- `") == 4  # origins.json and each figure, with what it shows
    assert "token preference over 16 random sequences" in capsys.readouterr().out
    # a second run into the same folder is refused; --overwrite --no-figures leaves no figure of the first
    assert main(["origins", "--model", "./no/such/model", "--out", str(out)]) == 2
    assert "--out would replace" in capsys.readouterr().err
    assert main(["origins", "--model", f"{trained_runs[1]}@init", "--sequences", "4", "--seq-len", "8", "--out", str(out),
                 "--overwrite", "--no-figures"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["origins.json"]
    assert json.loads((out / "origins.json").read_text())["token_preference"]["n_sequences"] == 4


def test_origins_cli_user_mistakes_exit_cleanly(tmp_path, capsys):
    from sinklens.cli import main

    assert main(["origins", "--model", "no-such-model@init:3", "--out", str(tmp_path)]) == 2
    assert main(["origins", "--model", "x@init:notanint", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "notanint" in err and "Traceback" not in err


def test_origins_default_seq_len_is_capped_at_the_models_context(trained_runs, tmp_path, capsys):
    """The default --seq-len 32 was refused on these n_ctx-16 runs ("--seq-len 32 is longer than the model's
    context"), though nobody passed it; analyze, intervene and fingerprint already capped their defaults."""
    from sinklens.cli import main

    code = main(["origins", "--model", f"{trained_runs[1]}@init", "--sequences", "4", "--no-figures",
                 "--out", str(tmp_path / "rep")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "rep" / "origins.json").read_text())["token_preference"]["seq_len"] == 16
    assert main(["origins", "--model", f"{trained_runs[1]}@init", "--seq-len", "17", "--out", str(tmp_path / "r2")]) == 2
    assert "--seq-len 17 is longer than the model's context of 16 tokens" in capsys.readouterr().err
