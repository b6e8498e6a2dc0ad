"""``sinklens context``: strict JSON and a figure in --out; a length above the model's context refused in one line."""

import json

from sinklens.cli import main
from sinklens.errors import EXIT_USAGE
from support.zoo import zoo_dir


def test_context_writes_strict_json_and_the_figure(tmp_path, capsys):
    out = tmp_path / "ctx"
    assert main(["context", "--model", str(zoo_dir("llama")), "--lengths", "16,64", "--out", str(out)]) == 0
    data = json.loads((out / "long_context.json").read_text(), parse_constant=lambda name: 1 / 0)
    assert [p["length"] for p in data["points"]] == [16, 64]
    assert all(0.0 <= p["sink_rate"] <= 1.0 and 0.0 < p["sink_attention"] < 1.0 for p in data["points"])
    assert (out / "long_context.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote long_context.json, long_context.png" in capsys.readouterr().out


def test_context_refuses_a_length_above_the_context(tmp_path, capsys):
    code = main(["context", "--model", str(zoo_dir("llama")), "--lengths", "16,65", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "length 65 is outside 2..64, the model's context" in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("sinklens context: error: length 65")
