"""`sinklens train` input mistakes: a named error with exit 2 (never an internal error), and nothing
written to the run folder before the inputs are checked; plus the way out of a run that failed before its
first checkpoint and the ``max_skips`` contract."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from _train_cfg import build_cfg

import sinklens.train.data as data_mod
from sinklens.cli import main
from sinklens.errors import InvalidArgumentError, NotFoundError
from sinklens.sinklm.config import load_config
from sinklens.train.data import MAX_SYNTHETIC_VOCAB, check_synthetic_vocab
from sinklens.train.loop import train

pytestmark = pytest.mark.models

TINY = ["--preset", "tiny", "--set", "model.d_model=16", "--set", "model.n_ctx=16", "--seq-len", "16",
        "--batch-size", "8", "--no-progress", "--set", "eval.interval=0", "--steps", "2"]
SYNTH = ["--set", "model.d_vocab=24", "--set", "data.vocab_size=24"]


def _train(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err, err
    return code, err


def _snapshot(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ 1. memmap (.bin) data


@pytest.mark.parametrize("case, words", [
    ("odd", "not a whole number of 2-byte uint16 token ids"),
    ("empty", "is empty"),
    ("empty_train_bin", "is empty"),
    ("empty_val_bin", "is empty"),
])
def test_broken_bin_files_are_named_usage_errors(tmp_path, capsys, case, words):
    if case == "odd":
        (data := tmp_path / "odd.bin").write_bytes(b"abc")
    elif case == "empty":
        (data := tmp_path / "empty.bin").write_bytes(b"")
    else:
        (data := tmp_path / "nano").mkdir()
        ids = np.arange(200, dtype=np.uint16) % 20
        (data / "train.bin").write_bytes(b"" if case == "empty_train_bin" else ids.tobytes())
        (data / "val.bin").write_bytes(b"" if case == "empty_val_bin" else ids.tobytes())
    out = tmp_path / "run"
    code, err = _train([*TINY, "--device", "cpu", "--data", str(data), "--out", str(out)], capsys)
    assert code == 2 and words in err, err
    assert not out.exists()


def test_bin_ids_beyond_the_vocabulary_are_refused_before_the_run_folder(tmp_path, capsys):
    data = tmp_path / "tok300.bin"
    np.random.default_rng(0).integers(0, 300, size=4000).astype(np.uint16).tofile(data)
    out = tmp_path / "run"
    code, err = _train([*TINY, "--device", "cpu", "--data", str(data), "--set", "data.vocab_size=100",
                        "--out", str(out)], capsys)
    assert code == 2, err
    assert "go up to 299" in err and "data.vocab_size=100" in err and "--data.vocab-size 300" in err
    assert not out.exists()
    # the vocabulary of a meta.pkl is checked the same way
    folder = tmp_path / "nano"
    folder.mkdir()
    np.arange(300, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 256}))
    code, err = _train([*TINY, "--device", "cpu", "--data", str(folder), "--out", str(out)], capsys)
    assert code == 2 and "go up to 299" in err and "meta.pkl" in err, err
    assert not out.exists()


def test_max_id_is_read_in_chunks(monkeypatch):
    monkeypatch.setattr(data_mod, "_MAX_ID_CHUNK", 7)
    ids = np.zeros(100, dtype=np.uint16)
    ids[93] = 41
    assert data_mod._max_id(ids) == 41 and data_mod._max_id(ids[:0]) == 0


# ------------------------------------------------------------------ 2. --device


@pytest.mark.parametrize("device, words", [
    ("gpu", "Unknown device 'gpu'"),
    ("meta", "Unknown device 'meta'"),
    ("mps", "device 'mps' needs Apple's MPS backend"),
])
def test_unknown_or_missing_device_is_a_usage_error_and_writes_nothing(tmp_path, capsys, device, words):
    out = tmp_path / "run"
    code, err = _train([*TINY, *SYNTH, "--device", device, "--out", str(out)], capsys)
    assert code == 2 and words in err, err
    assert not out.exists()


# ------------------------------------------------------------------ 3. a run that failed before its first checkpoint


def test_a_run_that_failed_before_its_first_checkpoint_can_be_started_again(tmp_path, capsys):
    out = tmp_path / "run"

    def broken(model):  # the work fails at the first step, after config.json and metrics.jsonl are written
        def fn(resid, hook):
            raise RuntimeError("boom")

        return [("blocks.0.hook_resid_post", fn)]

    with pytest.raises(RuntimeError, match="boom"):
        train(build_cfg(steps=2), out_dir=out, interventions=[broken], progress=False)
    assert (out / "config.json").is_file() and not (out / "checkpoints").exists()
    before = _snapshot(out)
    args = [*TINY, *SYNTH, "--device", "cpu", "--out", str(out)]
    code, err = _train(args, capsys)
    assert code == 2 and "stopped before its first checkpoint" in err and "--overwrite" in err, err
    code, err = _train(["--out", str(out), "--resume", "--device", "cpu", "--no-progress"], capsys)
    assert code == 2 and "holds no checkpoint" in err and "--overwrite" in err, err
    assert _snapshot(out) == before  # both refusals left the folder as it was
    code, err = _train([*args, "--overwrite"], capsys)
    assert code == 0, err
    assert (out / "checkpoints").is_dir()


# ------------------------------------------------------------------ 4. synthetic vocabularies too large for their tables


def test_check_synthetic_vocab_names_the_fix():
    check_synthetic_vocab("markov", MAX_SYNTHETIC_VOCAB)
    with pytest.raises(InvalidArgumentError, match=r"50304 tokens \(model.d_vocab.*37.7 GiB.*data.vocab_size"):
        check_synthetic_vocab("bigram-backcopy", 50304, from_model=True)


def test_preset_small_with_synthetic_data_is_refused_before_any_table(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):  # with the check gone, fail here instead of allocating 38 GiB
        raise AssertionError("the synthetic task's tables were built")

    monkeypatch.setattr(data_mod.MarkovSource, "__init__", never)
    out = tmp_path / "run"
    code, err = _train(["--preset", "small", "--steps", "1", "--no-progress", "--device", "cpu", "--out", str(out)],
                       capsys)
    assert code == 2 and "50304 tokens" in err and "data.vocab_size" in err, err
    assert not out.exists()


def test_a_synthetic_vocab_over_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data_mod, "MAX_SYNTHETIC_VOCAB", 20)
    out = tmp_path / "run"
    code, err = _train([*TINY, *SYNTH, "--device", "cpu", "--out", str(out)], capsys)
    assert code == 2 and "vocabulary of 24 tokens (data.vocab_size)" in err and "at most 20 tokens" in err, err
    assert not out.exists()


# ------------------------------------------------------------------ 5. --config


def test_missing_or_folder_config_is_an_input_file_error(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _train([*TINY, "--config", str(tmp_path / "nothere.toml"), "--out", str(out)], capsys)
    assert code == 2 and "nothere.toml' does not exist" in err, err
    (tmp_path / "cfgdir").mkdir()
    code, err = _train([*TINY, "--config", str(tmp_path / "cfgdir"), "--out", str(out)], capsys)
    assert code == 2 and "is a folder" in err and "does not exist" not in err, err
    assert not out.exists()
    with pytest.raises(NotFoundError):  # a FileNotFoundError for API callers, exit 2 on the command line
        load_config(tmp_path / "nothere.json")
    assert issubclass(NotFoundError, FileNotFoundError)


# ------------------------------------------------------------------ 6. binary text data


def test_binary_text_data_is_refused_like_binary_prompts(tmp_path, capsys):
    data = tmp_path / "binary.txt"
    data.write_bytes(b"some text\n" * 10 + b"\x00\x01\x02" + b"more" * 100)
    out = tmp_path / "run"
    code, err = _train([*TINY, "--device", "cpu", "--data", str(data), "--out", str(out)], capsys)
    assert code == 2 and "binary.txt' is a binary file (it holds NUL bytes)" in err, err
    assert not out.exists()
    folder = tmp_path / "corpus"  # one binary file in a folder of text is named too
    folder.mkdir()
    (folder / "a.txt").write_text("hello world " * 50)
    (folder / "b.txt").write_bytes(b"\x00" * 64)
    code, err = _train([*TINY, "--device", "cpu", "--data", str(folder), "--out", str(out)], capsys)
    assert code == 2 and "b.txt' is a binary file" in err, err
    assert not out.exists()


def test_text_data_that_is_not_utf8_is_named_in_a_warning(tmp_path, capsys):
    """Training text was read with errors="replace" in silence: a Latin-1 file trained on U+FFFD unannounced."""
    data = tmp_path / "latin1.txt"
    data.write_bytes(("caf\xe9 au lait, " * 40).encode("latin-1"))
    with pytest.warns(UserWarning, match=r"1 data file\(s\) are not UTF-8 text.*latin1.txt' is not UTF-8 text "
                                         r"\(byte 0xe9 at offset 3\)"):
        code, err = _train([*TINY, "--device", "cpu", "--data", str(data), "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err


# ------------------------------------------------------------------ 7. max_skips


def test_max_skips_allows_that_many_skipped_steps_then_stops(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _train([*TINY, *SYNTH, "--device", "cpu", "--steps", "20", "--lr", "1e30", "--set",
                        "optim.warmup_steps=0", "--set", "optim.grad_clip=0", "--on-nonfinite", "skip", "--set",
                        "max_skips=3", "--out", str(out)], capsys)
    assert code == 1, err  # a failure of the work
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    actions = [x["action"] for x in lines if x["kind"] == "nonfinite"]
    assert actions == ["skip", "skip", "skip", "stop"], actions  # 3 skipped, the next one stops
    assert "after max_skips=3 skipped steps in a row" in err and "raise max_skips" in err
    assert "set on_nonfinite='skip'" not in err  # it already is
