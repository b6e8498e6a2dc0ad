"""`sinklens train` and `sinklens compare` end to end on tiny runs."""

from __future__ import annotations

import json
import re

import pytest

from sinklens.cli import main
from sinklens.loading import load_model
from sinklens.sinklm.checkpoint import load_run

pytestmark = pytest.mark.models

TINY = ["--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set", "model.d_vocab=24", "--set", "data.vocab_size=24",
        "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--no-progress", "--set", "eval.interval=3",
        "--set", "eval.batches=1", "--set", "eval.batch_size=4"]


def test_train_then_compare(tmp_path, capsys):
    for variant in ("baseline", "headwise_rms"):
        code = main(["train", "--preset", "tiny", "--variant", variant, "--data", "bigram-backcopy", "--steps", "6",
                     "--out", str(tmp_path / variant), "--intervention", "restart:positions=8", *TINY])
        assert code == 0
        printed = capsys.readouterr().out
        assert "device: cpu, autocast none, compile off" in printed, printed
        run = tmp_path / variant
        assert (run / "metrics.jsonl").is_file() and (load_run(run).path / "model.safetensors").is_file()
        assert load_run(run).step == 6 and (run / "checkpoint.json").is_file()
        assert (run / "figures" / "training.png").stat().st_size > 1000
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["model"]["variant"] == variant and cfg["interventions"] == ["restart:positions=8"]
        assert cfg["model"]["d_model"] == 16 and cfg["data"]["seq_len"] == 16 and cfg["steps"] == 6
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "baseline"), str(tmp_path / "headwise_rms"), "--smoothing", "1",
                 "--out", str(tmp_path / "cmp.png"), "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out.split("figure:")[0])
    assert [r["run"] for r in rows] == ["baseline @ baseline", "headwise_rms @ headwise_rms"]
    lines = [json.loads(x) for x in (tmp_path / "baseline" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if x["kind"] == "train"]
    assert rows[0]["target_loss"] == losses[-1]  # default target: the first run's final loss
    assert rows[0]["steps_to_target"] == next(i for i, v in enumerate(losses) if v <= losses[-1])
    assert (tmp_path / "cmp.png").stat().st_size > 1000


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--set", "optim.lrr=1"]) == 2  # a user mistake: no traceback
    assert "Unknown config key 'optim.lrr'" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--data", str(tmp_path / "missing_folder")]) == 2
    assert "neither a text file nor a folder" in capsys.readouterr().err


def test_variant_options_after_a_colon(tmp_path, capsys):
    out = tmp_path / "calibrated"
    code = main(["train", "--preset", "tiny", "--variant", "variance_calibrated:mode=position_amplify", "--data",
                 "bigram-backcopy", "--steps", "2", "--out", str(out), *TINY])
    assert code == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["variant"] == "variance_calibrated"
    assert cfg["model"]["variant_options"] == {"mode": "position_amplify"}
    model = load_model(out)
    assert model.blocks[0].attn.variant.options["mode"] == "position_amplify"  # the built model has the option


@pytest.mark.parametrize(
    "variant, message",
    [
        ("headwise_rms:gain", "Attention variant argument 'gain' in 'headwise_rms:gain' is not of the form key=value"),
        ("headwise_rms:gain=shard", r"headwise_rms gain must be one of \['per_head', 'shared'\], got 'shard'"),
        ("headwise_rms:gian=shared", r"Unknown option\(s\) \['gian'\] for attention variant"),
        ("headwsie_rms:gain=shared", "Unknown attention variant 'headwsie_rms'"),
        # a non-positive eps made the run diverge at step 0 (NaN) instead of being refused
        ("qk_norm:eps=-1", r"attention variant QKNorm option eps must be in \(0, inf\], got -1"),
        ("headwise_rms:eps=0", r"attention variant HeadwiseRMSNorm option eps must be in \(0, inf\], got 0"),
    ],
)
def test_bad_variant_specs_are_one_line_errors(tmp_path, capsys, variant, message):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--variant", variant, "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert not out.exists()  # nothing written


def test_compare_keeps_runs_that_share_a_folder_name_and_refuses_bad_options(tmp_path, capsys):
    """Two runs named ``a`` in different folders are two rows (one used to replace the other silently)."""
    paths = [str(tmp_path / "x" / "a"), str(tmp_path / "y" / "a")]
    for seed, path in enumerate(paths):
        assert main(["train", "--preset", "tiny", "--data", "bigram-backcopy", "--steps", "3", "--seed", str(seed),
                     "--out", path, *TINY]) == 0
    capsys.readouterr()
    assert main(["compare", *paths, "--smoothing", "1", "--out", str(tmp_path / "cmp.png"), "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out.split("figure:")[0])
    assert [r["run"] for r in rows] == [f"baseline @ {p}" for p in paths]
    finals = [[json.loads(x)["loss"] for x in (tmp_path / d / "a" / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["kind"] == "train"][-1] for d in ("x", "y")]
    assert [r["final_loss"] for r in rows] == finals and finals[0] != finals[1]  # each row is its own run
    for args, message in (
        ([paths[0], str(tmp_path / "x" / "." / "a")], f"The run '{paths[0]}' is given twice"),
        ([*paths, "--labels", "same", "same"], "--labels gives 'same' to more than one run"),
        ([paths[0], "--smoothing", "0"], "--smoothing must be an integer >= 1, got 0."),
        ([paths[0], "--target-loss", "nan"], "--target-loss must be a finite number, got nan."),
        ([paths[0], "--target-loss", "-1"], "--target-loss must be in (0, inf], got -1."),
    ):
        assert main(["compare", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def _build(tmp_path, *argv):
    """The TrainConfig `sinklens train ARGV --out DIR` would run, parsed as the CLI does (nothing trained)."""
    from sinklens.cli import build_parser
    from sinklens.commands.train import build_config

    args, extra = build_parser().parse_known_args(["train", "--out", str(tmp_path / "run"), *argv])
    args.config_flags = extra
    return build_config(args)


def test_derived_model_fields_follow_later_overrides(tmp_path):
    """d_mlp and n_kv_heads nobody set are derived from the final d_model / family / n_heads (they kept
    the preset's values, and --model.n_heads 2 failed with "n_kv_heads=4 must divide n_heads=2")."""
    from sinklens.sinklm.config import ModelConfig

    assert _build(tmp_path, "--preset", "tiny", "--model.d-model", "128").model.d_mlp == ModelConfig(d_model=128).d_mlp == 344
    assert _build(tmp_path, "--preset", "tiny", "--set", "model.family=gpt2").model.d_mlp == 4 * 64
    model = _build(tmp_path, "--preset", "tiny", "--model.n-heads", "2").model
    assert (model.n_heads, model.n_kv_heads) == (2, 2)
    # set explicitly (a flag, the preset's own definition, a config file): kept
    assert _build(tmp_path, "--preset", "tiny", "--model.d-model", "128", "--set", "model.d_mlp=100").model.d_mlp == 100
    assert _build(tmp_path, "--preset", "headnorm-cpu", "--model.d-model", "512").model.d_mlp == 1024
    (tmp_path / "gqa.toml").write_text("[model]\nn_kv_heads = 2\n")
    model = _build(tmp_path, "--config", str(tmp_path / "gqa.toml"), "--model.d-model", "128").model
    assert (model.n_kv_heads, model.d_mlp) == (2, 344)


def test_config_file_model_table_applies_over_the_preset(tmp_path):
    """``--config FILE --preset P``: the preset is the base, the file's [model] keys go over it (the
    whole table used to be replaced by the preset's, silently)."""
    (tmp_path / "c1.toml").write_text('steps = 4\n[model]\nn_layers = 1\nd_model = 32\nvariant = "headwise_rms"\n'
                                      '[model.variant_options]\ngain = "shared"\n')
    model = _build(tmp_path, "--config", str(tmp_path / "c1.toml"), "--preset", "tiny-gpt2").model
    assert (model.variant, model.variant_options) == ("headwise_rms", {"gain": "shared"})
    assert (model.n_layers, model.d_model, model.family, model.n_heads) == (1, 32, "gpt2", 4)  # file, then preset
    assert model.d_mlp == 4 * 32


def test_a_variant_named_over_a_config_file_starts_from_its_own_options(tmp_path):
    """``--config FILE --variant NAME`` checked FILE's variant options (``mode``, for variance_calibrated) against
    NAME and refused an option the user never typed; the same variant keeps the file's options."""
    from sinklens.sinklm.config import TrainConfig
    from sinklens.sinklm.config import apply_overrides

    (tmp_path / "vc.toml").write_text('steps = 2\n[model]\nvariant = "variance_calibrated"\n'
                                      'variant_options = {mode = "position_amplify"}\n')
    vc = str(tmp_path / "vc.toml")
    model = _build(tmp_path, "--config", vc, "--variant", "baseline").model
    assert (model.variant, model.variant_options) == ("baseline", {})
    model = _build(tmp_path, "--config", vc, "--variant", "headwise_rms:gain=shared", "--model.d-model", "128").model
    assert (model.variant, model.variant_options, model.d_mlp) == ("headwise_rms", {"gain": "shared"}, 344)
    model = _build(tmp_path, "--config", vc, "--model.variant", "gated").model  # the field flag too
    assert (model.variant, model.variant_options) == ("gated", {})
    model = _build(tmp_path, "--config", vc, "--variant", "variance_calibrated").model  # the same variant: kept
    assert model.variant_options == {"mode": "position_amplify"}
    cfg = TrainConfig.from_dict({"model": {"variant": "variance_calibrated", "variant_options": {"mode": "attenuate"}}})
    assert apply_overrides(cfg, ["model.variant=baseline"]).model.variant_options == {}


def test_derived_fields_are_written_to_the_run_config(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--model.n-heads", "2", "--steps", "1", "--out", str(out), *TINY])
    assert code == 0, capsys.readouterr().err
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["d_model"], model["n_heads"], model["n_kv_heads"], model["d_mlp"]) == (16, 2, 2, 48)  # complete
    assert load_model(out).cfg.n_heads == 2


def test_resume_with_the_first_commands_preset_and_flags_keeps_the_runs_config(tmp_path, capsys):
    """``--preset tiny --set model.n_heads=2`` (n_kv_heads derived: 2), re-run with ``--resume``: the preset is not
    applied over the run's config again (it set n_kv_heads=4, refused against n_heads=2)."""
    first = ["train", "--preset", "tiny", "--set", "model.n_heads=2", "--data", "bigram-backcopy", "--out",
             str(tmp_path / "run"), *TINY]
    assert main([*first, "--steps", "2"]) == 0
    assert load_run(tmp_path / "run").config.model.n_kv_heads == 2
    capsys.readouterr()
    assert main([*first, "--steps", "4", "--resume"]) == 0, capsys.readouterr().err
    assert "resumed at step 2 with steps 2 -> 4" in capsys.readouterr().out
    assert load_run(tmp_path / "run").step == 4
