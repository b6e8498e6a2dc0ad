"""The command line's error contract (issue 11), run as a user runs it: ``python -m sinklens.cli ...``.

Each row asserts the exit code (2 usage, 1 failure, 130 interrupted), that stderr has no
"Traceback", and that its error line names the bad value. ``--debug`` / ``SINKLENS_DEBUG=1`` show
the traceback. The analyze command's inputs are covered in full; train / intervene / compare only
for the generic mapping (their own rows live with their tests).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinklens.cli import main
from sinklens.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]


def sinklens(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run ``python -m sinklens.cli ARGS`` in a fresh process with no GPU visible."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "SINKLENS_DEBUG": "", **env}
    return subprocess.run([sys.executable, "-m", "sinklens.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Bad files and folders for the rows below, plus a tiny local model and a tokenizer-less run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinklens.testing import word_tokenizer

    root = tmp_path_factory.mktemp("cli")
    (root / "binary.txt").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "empty.txt").write_text("\n \n")
    (root / "a_file").write_text("not a folder")
    (root / "bad.gguf").write_bytes(b"PK\x03\x04" * 16)
    (root / "short.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3))
    (root / "bad_config.json").write_text("{")
    (root / "value.toml").write_text("[model]\nn_layers = 'x'\n")
    (root / "done").mkdir()
    for name in ("report.json", "origins.json", "intervention.png"):
        (root / "done" / name).write_text("{}")
    (root / "done.json").write_text("{}")
    (root / "table.toml").write_text("model = 3\n")
    (root / "bos.json").write_text('{"data": {"source": "text", "path": "corpus.txt", "bos": "false"}}')
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    model_dir = root / "tiny"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    word_tokenizer(64).save_pretrained(model_dir)
    broken = root / "broken"
    LlamaForCausalLM(config).save_pretrained(broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    from safetensors.torch import load_file, save_file

    for name, edit in (("partial", lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                       ("nan", lambda w: w["model.layers.0.mlp.down_proj.weight"].view(-1)[3].fill_(float("nan")))):
        LlamaForCausalLM(config).save_pretrained(root / name)
        weights = load_file(root / name / "model.safetensors")
        edit(weights)
        save_file(weights, root / name / "model.safetensors", metadata={"format": "pt"})
    return {"root": root, "tiny": model_dir, "broken": broken}


def _p(files: dict[str, Path], name: str) -> str:
    return str(files["root"] / name)


# (id, args(files) -> list, exit code, words that stderr must contain)
ANALYZE_ROWS = [
    ("batch-size-zero", lambda f: ["--batch-size", "0"], EXIT_USAGE, ["--batch-size", "got 0"]),
    ("batch-size-negative", lambda f: ["--batch-size", "-4"], EXIT_USAGE, ["--batch-size", "-4"]),
    ("batch-size-not-int", lambda f: ["--batch-size", "abc"], EXIT_USAGE, ["--batch-size", "'abc'"]),
    ("max-length-zero", lambda f: ["--max-length", "0"], EXIT_USAGE, ["--max-length", "got 0"]),
    ("max-length-negative", lambda f: ["--max-length", "-5"], EXIT_USAGE, ["--max-length", "-5"]),
    ("seq-len-zero", lambda f: ["--seq-len", "0", "--random-tokens", "2"], EXIT_USAGE, ["--seq-len", "got 0"]),
    ("random-tokens-zero", lambda f: ["--random-tokens", "0"], EXIT_USAGE, ["--random-tokens", "got 0"]),
    ("random-tokens-negative", lambda f: ["--random-tokens", "-1"], EXIT_USAGE, ["--random-tokens", "-1"]),
    ("stdlib-text-zero", lambda f: ["--stdlib-text", "0"], EXIT_USAGE, ["--stdlib-text", "got 0"]),
    ("stdlib-text-negative", lambda f: ["--stdlib-text", "-3"], EXIT_USAGE, ["--stdlib-text", "-3"]),
    ("empty-text", lambda f: ["--text", "t2", "  "], EXIT_USAGE, ["--text", "2 of 2", "empty"]),
    ("text-and-prompts", lambda f: ["--text", "t2", "--prompts", "p.txt"], EXIT_USAGE, ["not allowed with"]),
    ("prompts-missing", lambda f: ["--prompts", _p(f, "missing.txt")], EXIT_USAGE, ["missing.txt", "does not exist"]),
    ("prompts-folder", lambda f: ["--prompts", str(f["root"])], EXIT_USAGE, ["is a folder"]),
    ("prompts-binary", lambda f: ["--prompts", _p(f, "binary.txt")], EXIT_USAGE, ["binary.txt", "binary"]),
    ("prompts-not-utf8", lambda f: ["--prompts", _p(f, "latin1.txt")], EXIT_USAGE, ["latin1.txt", "UTF-8"]),
    ("prompts-empty", lambda f: ["--prompts", _p(f, "empty.txt")], EXIT_USAGE, ["empty.txt", "no non-empty lines"]),
    ("prompts-empty-path", lambda f: ["--prompts", ""], EXIT_USAGE, ["--prompts is empty"]),
    ("device-cuda-without-gpu", lambda f: ["--device", "cuda"], EXIT_USAGE, ["'cuda'", "'cpu'"]),
    ("device-unknown", lambda f: ["--device", "gpu"], EXIT_USAGE, ["'gpu'", "'cuda:N'"]),
    ("dtype-unknown", lambda f: ["--dtype", "float13"], EXIT_USAGE, ["'float13'", "bfloat16"]),
    ("dtype-integer", lambda f: ["--dtype", "int64"], EXIT_USAGE, ["int64", "floating"]),
    ("model-empty", lambda f: ["--model", ""], EXIT_USAGE, ["--model is empty"]),
    ("model-unknown", lambda f: ["--model", "gpt-5-nano"], EXIT_USAGE, ["'gpt-5-nano'", "smollm2-135m"]),
    ("model-dot-path-missing", lambda f: ["--model", "./no/such/model"], EXIT_USAGE, ["./no/such/model"]),
    ("model-gguf-missing", lambda f: ["--model", "weights.gguf"], EXIT_USAGE, ["weights.gguf"]),
    ("model-not-gguf", lambda f: ["--model", _p(f, "bad.gguf")], EXIT_FAILURE, ["bad.gguf", "GGUF"]),
    ("model-truncated-gguf", lambda f: ["--model", _p(f, "short.gguf")], EXIT_FAILURE, ["short.gguf", "GGUF"]),
    ("model-truncated-safetensors", lambda f: ["--model", str(f["broken"])], EXIT_FAILURE,
     ["model.safetensors", "truncated"]),
    ("model-lacking-a-tensor", lambda f: ["--model", _p(f, "partial")], EXIT_FAILURE,
     ["lacks 1 tensor(s)", "model.layers.1.mlp.up_proj.weight"]),
    ("model-with-nan-weights", lambda f: ["--model", _p(f, "nan")], EXIT_FAILURE,
     ["NaN or inf", "model.layers.0.mlp.down_proj.weight"]),
    ("model-folder-without-config", lambda f: ["--model", str(f["root"])], EXIT_USAGE, ["config.json"]),
    ("out-is-a-file", lambda f: ["--out", _p(f, "a_file")], EXIT_USAGE, ["--out", "a_file", "not a folder"]),
    ("out-under-a-file", lambda f: ["--out", _p(f, "a_file") + "/sub"], EXIT_USAGE, ["--out", "cannot be created"]),
    ("out-empty", lambda f: ["--out", ""], EXIT_USAGE, ["--out is empty"]),
    ("seq-len-beyond-context", lambda f: ["--model", str(f["tiny"]), "--random-tokens", "2", "--seq-len", "65"],
     EXIT_USAGE, ["65", "64"]),
    ("max-length-with-random-tokens", lambda f: ["--random-tokens", "2", "--max-length", "8"], EXIT_USAGE,
     ["--max-length 8 truncates text prompts", "--seq-len"]),
    ("seq-len-with-text", lambda f: ["--text", "t2", "--seq-len", "8"], EXIT_USAGE,
     ["--seq-len 8 sets the length of --random-tokens", "--max-length"]),
    ("seq-len-with-the-built-in-prompts", lambda f: ["--model", str(f["tiny"]), "--seq-len", "8"], EXIT_USAGE,
     ["--seq-len 8 sets the length of --random-tokens", "text prompts"]),
    ("seq-len-one", lambda f: ["--random-tokens", "2", "--seq-len", "1"], EXIT_USAGE, ["--seq-len", ">= 2, got 1"]),
    ("max-length-one", lambda f: ["--text", "t2 t3", "--max-length", "1"], EXIT_USAGE, ["--max-length", ">= 2, got 1"]),
    ("one-token-text-without-bos", lambda f: ["--model", str(f["tiny"]), "--text", "t2", "--no-bos"], EXIT_USAGE,
     ["Every sequence is 1 token long", "at least one sequence of 2 tokens"]),
    ("stdlib-text-beyond-the-library", lambda f: ["--model", str(f["tiny"]), "--stdlib-text", "100000"], EXIT_USAGE,
     ["--stdlib-text 100000 asks for more docstrings than this Python's standard library holds", "pass at most"]),
    ("unknown-flag", lambda f: ["--bogus"], EXIT_USAGE, ["unrecognized arguments: --bogus"]),
]


@pytest.mark.parametrize(("make_args", "code", "words"), [r[1:] for r in ANALYZE_ROWS], ids=[r[0] for r in ANALYZE_ROWS])
def test_analyze_bad_input(files, tmp_path, make_args, code, words):
    args = make_args(files)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    done = sinklens("analyze", "--no-figures", *args, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr
    assert done.stdout == ""  # no analysis ran
    assert not (tmp_path / "out").exists()  # and no empty report folder is left behind


GENERIC_ROWS = [
    ("no-command", lambda f: [], EXIT_USAGE, ["required"]),
    ("unknown-command", lambda f: ["analyse"], EXIT_USAGE, ["invalid choice", "'analyse'"]),
    ("train-config-value", lambda f: ["train", "--out", _p(f, "run"), "--set", "optim.lr=-1"], EXIT_USAGE,
     ["optim.lr", "-1"]),
    ("train-config-syntax", lambda f: ["train", "--out", _p(f, "run"), "--config", _p(f, "bad_config.json")], EXIT_USAGE,
     ["error:"]),
    # a string where a boolean belongs (truthy "false") used to be stored and trained with BOS
    ("train-config-bos-string", lambda f: ["train", "--out", _p(f, "run"), "--config", str(f["root"] / "bos.json")],
     EXIT_USAGE, ["data.bos must be True or False, got 'false' (str)"]),
    ("train-config-missing", lambda f: ["train", "--out", _p(f, "run"), "--config", _p(f, "missing.toml")], None,
     ["missing.toml"]),
    ("origins-batch-size", lambda f: ["origins", "--model", "./no/such/model", "--batch-size", "0"], EXIT_USAGE,
     ["--batch-size must be an integer >= 1, got 0"]),
    ("origins-device", lambda f: ["origins", "--model", "./no/such/model", "--device", "cdua"], EXIT_USAGE,
     ["--device", "'cdua'"]),
    # --batch-size, --device and --dtype mean the same in analyze, intervene, origins and fingerprint
    ("intervene-batch-size", lambda f: ["intervene", "--method", "self-only", "--position", "2", "--model", "./no/m",
                                        "--batch-size", "0"], EXIT_USAGE, ["--batch-size must be an integer >= 1, got 0"]),
    ("intervene-device", lambda f: ["intervene", "--method", "self-only", "--position", "2", "--model", "./no/m",
                                    "--device", "cdua"], EXIT_USAGE, ["--device", "'cdua'"]),
    ("origins-dtype", lambda f: ["origins", "--model", "./no/such/model", "--dtype", "int64"], EXIT_USAGE,
     ["--dtype", "int64", "floating"]),
    ("fingerprint-dtype", lambda f: ["fingerprint", "./no/a", "./no/b", "--dtype", "float13"], EXIT_USAGE,
     ["--dtype", "'float13'"]),
    ("origins-seq-len-beyond-context", lambda f: ["origins", "--model", str(f["tiny"]), "--seq-len", "65",
                                                  "--no-figures", "--out", _p(f, "o")], EXIT_USAGE,
     ["--seq-len 65 is longer than the model's context of 64 tokens"]),
    ("fingerprint-seq-len-beyond-context", lambda f: ["fingerprint", str(f["tiny"]), str(f["tiny"]), "--seq-len", "65"],
     EXIT_USAGE, ["--seq-len 65 is longer than the models' context of 64 tokens"]),
    # a typo in a name gets the closest known one; a task too big for its vocabulary names both
    ("train-variant-typo", lambda f: ["train", "--out", _p(f, "run"), "--variant", "headwise_rmss"], EXIT_USAGE,
     ["Unknown attention variant 'headwise_rmss' (did you mean 'headwise_rms'?)"]),
    ("train-preset-typo", lambda f: ["train", "--out", _p(f, "run"), "--preset", "tinyy"], EXIT_USAGE,
     ["Unknown model preset 'tinyy' (did you mean 'tiny'?)"]),
    ("train-backcopy-vocab-too-small", lambda f: ["train", "--out", _p(f, "run"), "--data", "bigram-backcopy",
                                                  "--set", "model.d_vocab=3"], EXIT_USAGE,
     ["data.n_triggers=3 needs a vocabulary of at least 5 tokens", "got 3"]),
    # a finished result is never replaced without --overwrite (checked before any model loads)
    ("analyze-over-a-report", lambda f: ["analyze", "--model", "./no/such/model", "--out", str(f["root"] / "done")],
     EXIT_USAGE, ["--out would replace", "report.json", "pass --overwrite to replace it"]),
    ("origins-over-a-report", lambda f: ["origins", "--model", "./no/such/model", "--out", str(f["root"] / "done")],
     EXIT_USAGE, ["--out would replace", "origins.json"]),
    ("fingerprint-over-a-json", lambda f: ["fingerprint", "./no/a", "./no/b", "--json", str(f["root"] / "done.json")],
     EXIT_USAGE, ["--json would replace", "done.json"]),
    ("intervene-over-a-json", lambda f: ["intervene", "--method", "self-only", "--position", "2", "--model", "./no/m",
                                         "--json", str(f["root"] / "done.json")], EXIT_USAGE, ["--json would replace"]),
    ("intervene-over-a-figure", lambda f: ["intervene", "--method", "self-only", "--position", "2", "--model", "./no/m",
                                           "--out", str(f["root"] / "done")], EXIT_USAGE, ["--out would replace",
                                                                                          "intervention.png"]),
    # a config file's bad value or shape is named with the file
    ("train-config-bad-value", lambda f: ["train", "--config", str(f["root"] / "value.toml"), "--out", _p(f, "run")],
     EXIT_USAGE, ["value.toml': model.n_layers must be an integer, got 'x' (str)."]),
    ("train-config-section-not-a-table", lambda f: ["train", "--config", str(f["root"] / "table.toml"), "--out", _p(f, "run")],
     EXIT_USAGE, ["table.toml': ModelConfig must be given as a mapping of its fields, got 3."]),
    # seeds: torch.manual_seed's 0..2**64-1, named with their minus sign (a wrapped panel line once lost it)
    ("train-seed-negative", lambda f: ["train", "--out", _p(f, "run"), "--seed", "-1"], EXIT_USAGE,
     ["seed must be an integer from 0 to 2**64 - 1, got -1."]),
    ("train-data-seed-too-large", lambda f: ["train", "--out", _p(f, "run"), "--data.seed", str(2**64)], EXIT_USAGE,
     [f"data.seed must be an integer from 0 to 2**64 - 1, got {2**64}."]),
    ("origins-init-seed-too-large", lambda f: ["origins", "--model", "./no/such/model", "--init-seed", str(10**20)],
     EXIT_USAGE, [f"--init-seed must be an integer from 0 to 2**64 - 1, got {10**20}."]),
    ("origins-seed-negative", lambda f: ["origins", "--model", "./no/such/model", "--seed", "-3"], EXIT_USAGE,
     ["--seed must be an integer from 0 to 2**64 - 1, got -3."]),
    ("origins-one-token-after-bos", lambda f: ["origins", "--model", "./no/such/model", "--seq-len", "2", "--bos"],
     EXIT_USAGE, ["--seq-len=2 with --bos leaves 1 random token after the BOS", "use --seq-len >= 3"]),
    ("origins-init-spec-negative-seed", lambda f: ["origins", "--model", f"{f['tiny']}@init:-4", "--no-figures",
                                                   "--out", _p(f, "o")], EXIT_USAGE,
     ["@init:-4' must be an integer from 0 to 2**64 - 1, got -4."]),
    ("fingerprint-seed-too-large", lambda f: ["fingerprint", "./no/such/a", "./no/such/b", "--seed", str(10**20)],
     EXIT_USAGE, [f"--seed must be an integer from 0 to 2**64 - 1, got {10**20}."]),
    ("intervene-unknown-method", lambda f: ["intervene", "--method", "nope"], EXIT_USAGE, ["'nope'"]),
    ("intervene-missing-model", lambda f: ["intervene", "--method", "self-only", "--position", "2", "--model",
                                           "./no/such/model"], EXIT_USAGE, ["./no/such/model"]),
    ("compare-not-a-run", lambda f: ["compare", _p(f, "no-run")], None, ["no-run"]),
    # --seq-len sets random sequences' length: on the built-in text prompts it did nothing, in silence
    ("intervene-seq-len-with-the-built-in-prompts", lambda f: ["intervene", "--method", "self-only", "--position", "2",
                                                               "--model", str(f["tiny"]), "--seq-len", "8"], EXIT_USAGE,
     ["--seq-len 8 sets the length of --random-tokens sequences, and this intervene runs on text prompts."]),
    # checked before the model loads: the missing model is never reached
    ("intervene-negative-position", lambda f: ["intervene", "--method", "self-only", "--position", "-3", "--model",
                                               "./no/such/model"], EXIT_USAGE, ["--position must be an integer >= 0, got -3"]),
]


@pytest.mark.parametrize(("make_args", "code", "words"), [r[1:] for r in GENERIC_ROWS], ids=[r[0] for r in GENERIC_ROWS])
def test_other_commands_map_errors_to_one_line(files, tmp_path, make_args, code, words):
    done = sinklens(*make_args(files), cwd=tmp_path)
    assert done.returncode == code if code is not None else done.returncode in (EXIT_USAGE, EXIT_FAILURE), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr


@pytest.mark.parametrize("command", [
    ["origins", "--sequences", "1"],
    ["intervene", "--method", "self-only", "--position", "2", "--model", "./no/such/model"],
    ["intervene", "--method", "self-only", "--position", "2", "--json", "{out}/result.json", "--model", "./no/such/model"],
], ids=["origins-bad-sequences", "intervene-missing-model", "intervene-json-folder"])
def test_a_refused_command_leaves_no_out_folder(tmp_path, capsys, command):
    """A refusal found after ``--out`` (or ``--json``'s folder) was checked creates no folder: the check only
    asks whether it could be created."""
    out = tmp_path / "new" / "out"
    args = [arg.replace("{out}", str(out)) for arg in command]
    if "--json" not in args:
        args += ["--out", str(out)]
    assert main(args) in (EXIT_USAGE, EXIT_FAILURE)
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--debug", "analyze", "--batch-size", "0"], {}),
        (["analyze", "--batch-size", "0", "--debug"], {}),
        (["analyze", "--batch-size", "0"], {"SINKLENS_DEBUG": "1"}),
    ],
    ids=["flag-before", "flag-after", "environment"],
)
def test_debug_shows_the_traceback(tmp_path, args, env):
    done = sinklens(*args, "--out", str(tmp_path / "out"), cwd=tmp_path, **env)
    assert done.returncode == EXIT_USAGE
    assert "Traceback (most recent call last)" in done.stderr and "InvalidArgumentError" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1] == "sinklens analyze: error: --batch-size must be an integer >= 1, got 0."


def test_error_is_exactly_one_line(tmp_path):
    done = sinklens("analyze", "--random-tokens", "0", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert done.stderr.splitlines() == ["sinklens analyze: error: --random-tokens must be an integer >= 1, got 0."]


@pytest.fixture(scope="module")
def tokenless_run(tmp_path_factory) -> Path:
    """A ``sinklens train`` run directory as a synthetic task leaves it: weights, no tokenizer."""
    from sinklens.sinklm.checkpoint import save_checkpoint
    from sinklens.sinklm.config import ModelConfig, TrainConfig
    from sinklens.sinklm.model import SinkLM

    run = tmp_path_factory.mktemp("tokenless") / "run"
    cfg = TrainConfig.from_dict({**TrainConfig().to_dict(), "model": ModelConfig.from_preset("tiny").to_dict()})
    save_checkpoint(run, model=SinkLM(cfg.model), optimizer=None, cfg=cfg, step=0)
    return run


def test_run_without_a_tokenizer_is_analysed_on_random_tokens(tokenless_run, tmp_path):
    """A ``sinklens train`` run on synthetic data has no tokenizer: analyze uses random tokens and says so."""
    done = sinklens("analyze", "--model", str(tokenless_run), "--out", str(tmp_path / "out"), "--no-figures",
                    "--batch-size", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no tokenizer" in done.stderr and "16 random-token sequences" in done.stderr
    assert "each starting with the task's BOS token 0 as in training" in done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["n_sequences"] == 16
    # the synthetic task starts every training sequence with token 0: so do the analysed ones (its sink's token)
    assert report["sinks"]["prepend_bos"] is True and report["sinks"]["position_tokens"]["0"] == "id 0"
    no_bos = sinklens("analyze", "--model", str(tokenless_run), "--out", str(tmp_path / "nb"), "--no-figures", "--no-bos",
                      cwd=tmp_path)
    assert no_bos.returncode == 0 and "BOS token 0" not in no_bos.stderr, no_bos.stderr
    assert json.loads((tmp_path / "nb" / "report.json").read_text())["sinks"]["prepend_bos"] is False
    refused = sinklens("analyze", "--model", str(tokenless_run), "--text", "hello", "--out", str(tmp_path / "o2"))
    assert refused.returncode == EXIT_USAGE and "--text needs a tokenizer" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_run_without_a_tokenizer_is_intervened_on_random_tokens(tokenless_run, tmp_path):
    """intervene runs such a model on random tokens too (it used to ask for token ids, which a CLI cannot pass)."""
    done = sinklens("intervene", "--model", str(tokenless_run), "--method", "block-keys", "--json", "b.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no tokenizer" in done.stderr and "16 random-token sequences of 64 tokens" in done.stderr
    blocked = json.loads((tmp_path / "b.json").read_text())
    assert min(blocked["before"]) > 0.0 and blocked["after"] == [0.0] * len(blocked["before"])  # no query sees key 0
    asked = sinklens("intervene", "--model", str(tokenless_run), "--method", "self-only", "--position", "6",
                     "--random-tokens", "3", "--seq-len", "8", "--json", "s.json", cwd=tmp_path)
    assert asked.returncode == 0 and "no tokenizer" not in asked.stderr, asked.stderr
    assert json.loads((tmp_path / "s.json").read_text())["target"] == 6
    for args, words in ((["--text", "hello"], "--text needs a tokenizer, and the model"),
                        (["--random-tokens", "3", "--seq-len", "8", "--position", "8"], "No query after position 8"),
                        (["--text", "hello", "--seq-len", "8"], "--seq-len 8 sets the length of --random-tokens")):
        refused = sinklens("intervene", "--model", str(tokenless_run), "--method", "self-only", "--position", "2", *args)
        assert refused.returncode == EXIT_USAGE and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_good_run_still_works(files, tmp_path):
    done = sinklens("analyze", "--model", str(files["tiny"]), "--random-tokens", "3", "--seq-len", "8",
                    "--out", str(tmp_path / "out"), "--no-figures", "--device", "cpu", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["n_sequences"] == 3


# ---------------------------------------------------------------------------------------------------
# In-process: unexpected exceptions, Ctrl-C, network failures, broken sub-command modules
# ---------------------------------------------------------------------------------------------------


def test_unexpected_exception_is_an_internal_error(monkeypatch, capsys, tmp_path):
    from sinklens.commands import analyze as command

    def boom(args):
        torch.zeros(2).view(3)  # a RuntimeError from inside torch

    monkeypatch.setattr(command, "_check_args", boom)
    assert main(["analyze", "--out", str(tmp_path)]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("sinklens analyze: internal error: RuntimeError: shape '[3]' is invalid")
    assert "--debug" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_ctrl_c_exits_130(monkeypatch, capsys, tmp_path):
    from sinklens.commands import analyze as command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "_check_args", interrupted)
    assert main(["analyze", "--out", str(tmp_path)]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "sinklens analyze: interrupted\n"


def test_no_network_is_a_failure_not_a_usage_error(monkeypatch, capsys, tmp_path):
    from sinklens import model_files

    monkeypatch.setattr(model_files, "hub_reachable", lambda timeout=3.0: False)
    assert main(["analyze", "--model", "org/model", "--out", str(tmp_path / "o")]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "'org/model'" in err and "smollm2-135m" in err and "Traceback" not in err


def test_a_sub_command_that_fails_to_import_is_reported_not_dropped(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sinklens.commands.compare", None)  # `import` now raises ModuleNotFoundError
    assert main(["compare", "runs/a", "--json"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "sinklens compare: error: this command could not be loaded (ModuleNotFoundError" in err
    assert "Traceback" not in err
    assert main(["compare", "runs/a", "--debug"]) == EXIT_FAILURE
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "compare" in capsys.readouterr().out  # still listed


def test_a_warning_is_one_line_naming_the_command_and_python_format_under_debug(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"kind": "train", "step": i, "loss": 5.0 - i / 10}) for i in range(3)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a write cut short by a kill
    done = sinklens("compare", str(run), "--out", str(tmp_path / "c.png"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"sinklens compare: warning: {run / 'metrics.jsonl'}: its last line is cut short "
                                        "(Unterminated string starting at, column 19), as when the run was stopped while "
                                        "writing it; that line is ignored."]
    debug = sinklens("compare", str(run), "--out", str(tmp_path / "c.png"), "--overwrite", "--debug")
    assert "RuntimeWarning: " in debug.stderr and "compare.py" in debug.stderr



@pytest.mark.parametrize("command", ["analyze", "intervene", "train", "compare", "origins", "fingerprint"])
def test_help_is_plain_text_with_its_examples(command, capsys):
    """``--help`` shows the module's examples without reStructuredText quoting (``code``, :mod:, ``::``)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: sinklens {command}" in text
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    assert not [line for line in text.splitlines() if line.endswith("::")]
    if command != "analyze":
        assert f"    sinklens {command} " in text or f"-m sinklens.cli {command}" in text  # an example survived


@pytest.mark.parametrize("command", ["analyze", "intervene", "origins", "fingerprint"])
def test_model_flags_are_the_same_in_every_command(command):
    """``--batch-size``, ``--device`` and ``--dtype`` exist in every command that runs a model, each with the
    same help text (one definition), and the commands' defaults are the ones their help states."""
    from sinklens.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    flags = {a.option_strings[0]: a for a in sub._actions if a.option_strings}
    reference = {a.option_strings[0]: a for a in next(a for a in parser._actions if a.dest == "command")
                 .choices["analyze"]._actions if a.option_strings}
    for flag in ("--batch-size", "--device", "--dtype"):
        assert flag in flags, f"{command} has no {flag}"
        assert flags[flag].help == reference[flag].help
    assert flags["--device"].default is None and flags["--dtype"].default is None
    assert flags["--batch-size"].default >= 1 and "%(default)s" in flags["--batch-size"].help


def test_init_seed_must_agree_with_the_seed_in_the_model_spec():
    from sinklens.commands.origins import check_init_seed
    from sinklens.errors import InvalidArgumentError

    check_init_seed("runs/a@init:3", 3)
    check_init_seed("runs/a@init", 4)
    with pytest.raises(InvalidArgumentError, match=r"^--init-seed 4 conflicts with the seed 3 of --model 'runs/a@init:3'; "
                       r"give the seed once \(--model runs/a@init:4, or --model runs/a@init --init-seed 4\)\.$"):
        check_init_seed("runs/a@init:3", 4)
