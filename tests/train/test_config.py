"""TrainConfig: file round trips, command-line overrides, validation errors, the LR schedule."""

from __future__ import annotations

import json
import math

import pytest
from _train_cfg import build_cfg

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import OptimConfig, TrainConfig, load_config
from sinklens.sinklm.config import apply_overrides
from sinklens.train.optim import get_lr


def test_dict_json_and_toml_round_trip(tmp_path):
    cfg = build_cfg(optim={"lr": 3e-3}, interventions=["restart:positions=4"])
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    assert load_config(tmp_path / "c.json") == cfg
    (tmp_path / "c.toml").write_text(
        'steps = 7\nbatch_size = 4\n[model]\nd_model = 32\nn_heads = 2\nn_ctx = 32\n[optim]\nlr = 0.002\n[data]\nseq_len = 32\n'
    )
    toml = load_config(tmp_path / "c.toml")
    assert (toml.steps, toml.batch_size, toml.model.d_model, toml.model.n_heads, toml.optim.lr, toml.data.seq_len) == (
        7, 4, 32, 2, 0.002, 32
    )
    assert toml.optim.min_lr is None and toml.optim.final_lr == pytest.approx(0.0002)  # default lr / 10


def test_overrides_parse_types_and_nest():
    cfg = apply_overrides(build_cfg(), ["optim.lr=3e-4", "model.variant=headwise_rms", "compile=true",
                                        "model.variant_options.gain=shared", "data.path=none"])
    assert cfg.optim.lr == 3e-4 and cfg.model.variant == "headwise_rms" and cfg.compile is True
    assert cfg.model.variant_options == {"gain": "shared"} and cfg.data.path is None


def test_a_literal_none_stays_a_string_where_the_field_lists_it():
    # autocast / cpu_autocast list "none" among their values: it is not Python's None there
    cfg = apply_overrides(build_cfg(autocast="float16", cpu_autocast="bfloat16"), ["autocast=none", "cpu_autocast=none"])
    assert cfg.autocast == "none" and cfg.cpu_autocast == "none"
    cfg = apply_overrides(cfg, ["cpu_autocast=bfloat16", "optim.min_lr=none", "compile=auto"])
    assert cfg.cpu_autocast == "bfloat16" and cfg.optim.min_lr is None and cfg.compile == "auto"


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.n_heads=3"], "n_heads=3 does not divide d_model=16"),
        (["model.variant=nope"], "Unknown attention variant 'nope'"),
        (["data.seq_len=32"], "data.seq_len=32 is longer than the model context model.n_ctx=16"),
        (["optim.lrr=1"], "Unknown config key 'optim.lrr'"),
        (["optimizer.lr=1"], r"Unknown config key 'optimizer.lr' \(did you mean 'optim.lr'\?\)"),
        (["batch_size=6", "grad_accum=4"], "batch_size=6 must be divisible by grad_accum=4"),
        (["optim.min_lr=1"], r"optim.min_lr must be in \[0, lr="),
        (["data.source=wiki"], r"data.source must be one of \['bigram-backcopy', 'markov', 'text', 'memmap', 'hf'\], got 'wiki'"),
        (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
        (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
        (["steps=ten"], "--steps must be an integer, got 'ten'"),
        (["model.family=bert"], r"model.family must be one of \['llama', 'gpt2'\], got 'bert'"),
        (["model.family=lama"], r"\(did you mean 'llama'\?\)"),
        (["optim.min_lr=low"], "--optim.min-lr must be None or a number, got 'low'"),
        (["data.seq-len=8"], r"Unknown config key 'data.seq-len' \(did you mean 'data.seq_len'\?\)"),
        (["autocast=fp8"], r"autocast must be one of .*got 'fp8'"),
        (["data.source=text"], "needs data.path"),
        (["lr"], "not of the form"),
        (["data.bos=false"], "data.bos=False: the bigram-backcopy task always starts its sequences with its BOS token"),
    ],
)
def test_bad_configs_raise_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(build_cfg(), overrides)


def test_unknown_keys_in_files_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown TrainConfig keys \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match=r"Unknown DataConfig keys \['sequence'\]"):
        TrainConfig.from_dict({"data": {"sequence": 3}})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("typo.toml", "steps = 3\n[model]\nn_layerz = 2\n",
         r"Config file '.*typo\.toml': Unknown ModelConfig keys \['n_layerz'\] \(did you mean 'n_layers'\?\)"),
        ("two.toml", "stepz = 3\nbatchsize = 2\n", r"\(did you mean 'batch_size' for 'batchsize', 'steps' for 'stepz'\?\)"),
        ("syntax.toml", "steps = 3\n[model\n", r"Config file '.*syntax\.toml': Expected ']'.*line 2"),
        ("syntax.json", '{"steps": 3,}', r"Config file '.*syntax\.json': Expecting property name"),
    ],
)
def test_a_bad_config_file_is_named_in_its_error(tmp_path, name, text, match):
    """(A bad value or a non-table section: rows of ``tests/commands/test_cli_errors.py``, which runs without pytest's type checker.)"""
    (tmp_path / name).write_text(text)
    with pytest.raises(InvalidArgumentError, match=match):
        load_config(tmp_path / name)


def test_lr_schedule_warmup_cosine_floor():
    opt = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=24)
    lrs = [get_lr(s, opt, total_steps=100) for s in range(30)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warmup
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[14] == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)  # cosine midpoint 0.55
    assert all(a >= b for a, b in zip(lrs[4:24], lrs[5:25]))  # monotone decay
    assert lrs[24:] == pytest.approx([0.1] * 6)  # floor after decay_steps


def test_config_errors_are_one_clean_line():
    """A field's own validation comes back as its own message; a flag's error names the flag as typed."""
    from sinklens.sinklm.config import parse_flags as parse_args

    with pytest.raises(ValueError) as own:
        apply_overrides(build_cfg(), ["steps=0"])
    assert str(own.value) == "steps must be an integer >= 1, got 0."
    with pytest.raises(ValueError) as unknown:
        parse_args(build_cfg(), ["--until", "20"])
    assert str(unknown.value) == "Unknown flag --until; sinklens train --fields lists them."
    with pytest.raises(ValueError) as typed:
        parse_args(build_cfg(), ["--optim.lr", "abc"])
    assert str(typed.value) == "--optim.lr must be a number, got 'abc'."
    with pytest.raises(ValueError) as underscore:  # one spelling: flags are keys with hyphens
        parse_args(build_cfg(), ["--data.seq_len", "8"])
    assert str(underscore.value) == "Unknown flag --data.seq_len (did you mean --data.seq-len?); sinklens train --fields lists them."
    with pytest.raises(ValueError, match="--optim.lr needs a value"):
        parse_args(build_cfg(), ["--optim.lr"])


def test_flags_and_set_items_parse_to_the_same_config():
    from sinklens.sinklm.config import parse_flags as parse_args

    flags = parse_args(build_cfg(), ["--optim.lr", "3e-4", "--data.seq-len=8", "--optim.min-lr", "none", "--model.d-vocab",
                                     "auto", "--on-nonfinite", "skip", "--data.path", "None", "--optim.fused", "true"])
    sets = apply_overrides(build_cfg(), ["optim.lr=3e-4", "data.seq_len=8", "optim.min_lr=null", "model.d_vocab=auto",
                                         "on_nonfinite=skip", "data.path=none", "optim.fused=true"])
    assert flags == sets
    assert (sets.optim.lr, sets.data.seq_len, sets.optim.min_lr, sets.model.d_vocab, sets.data.path, sets.optim.fused) == (
        3e-4, 8, None, "auto", None, True)

