"""Bad input to the interventions, one row per case: the error type, and a message that names the bad value.

Python cases run on the tiny Llama model (values of the wrong *type* for an annotation, e.g. a
string ``alpha`` or an unknown ``Literal`` mode, are caught by the jaxtyping/beartype checks under
pytest, so the rows use values of the right type and a bad value); ``sinklens intervene`` cases run the real CLI in a
subprocess and expect exit code 2 (a usage error), the message on stderr and no traceback. Every CLI
case names a model path that does not exist, so a case that reached the model loader would report
the model instead of its own mistake: the CLI checks its arguments before the model loads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinklens.errors import InvalidArgumentError, OutputNotWritableError, SinklensError
from sinklens.interventions import (
    amplify, block_keys, calibrate, clamp_dims, create_sink, custom_mask, edit_neurons, measure_intervention,
    patch_sink, reference_mean, remove_sink, restart, self_only, sweep, transplant_dims,
)
from sinklens.interventions.calibration import variance_calibration
from sinklens.options import RunOptions

pytestmark = pytest.mark.models

Q = RunOptions(progress=False)
REPO = Path(__file__).resolve().parents[2]

# (case id, call(model, toks), expected error, text the message must contain)
PYTHON_CASES = [
    ("alpha inf", lambda m, t: amplify(m, positions=3, alpha=math.inf, reference="batch"), InvalidArgumentError, "inf"),
    ("alpha nan", lambda m, t: amplify(m, positions=3, alpha=math.nan, reference="batch"), InvalidArgumentError, "nan"),
    ("alpha zero", lambda m, t: amplify(m, positions=3, alpha=0, reference="batch"), InvalidArgumentError, "got 0"),
    ("layers empty", lambda m, t: self_only(m, positions=3, layers=[]), InvalidArgumentError, "empty list"),
    ("layers float", lambda m, t: restart(m, positions=3, layers=[0.5]), InvalidArgumentError, "0.5"),
    ("layers out of range", lambda m, t: block_keys(m, positions=0, layers=[5]), InvalidArgumentError, "layer 5"),
    ("layers empty, amplify", lambda m, t: amplify(m, positions=3, alpha=2, layers=[], reference="batch"), InvalidArgumentError, "empty list"),
    ("heads -1, amplify", lambda m, t: amplify(m, positions=3, alpha=2, heads=-1, reference="batch"), InvalidArgumentError, "head -1"),
    ("heads -1, calibrate", lambda m, t: calibrate(m, heads=-1), InvalidArgumentError, "head -1"),
    ("heads -1, mask", lambda m, t: block_keys(m, positions=0, heads=[-1]), InvalidArgumentError, "head -1"),
    ("position -1", lambda m, t: self_only(m, positions=-1), InvalidArgumentError, "position -1"),
    ("position n_ctx", lambda m, t: self_only(m, positions=64), InvalidArgumentError, "position 64"),
    ("position bool", lambda m, t: restart(m, positions=True), InvalidArgumentError, "True"),
    ("position float", lambda m, t: self_only(m, positions=[2.5]), InvalidArgumentError, "2.5"),
    ("positions empty", lambda m, t: amplify(m, positions=[], alpha=2, reference="batch"), InvalidArgumentError, "empty list"),
    ("position past the sequence", lambda m, t: m.run_with_hooks(t, fwd_hooks=self_only(m, positions=20)), InvalidArgumentError, "Position 20"),
    ("variance calibration past the sequence",
     lambda m, t: m.run_with_hooks(t, fwd_hooks=variance_calibration(m, positions=20)), InvalidArgumentError, "Position 20"),
    ("clamp value nan", lambda m, t: clamp_dims(m, [1], value=math.nan), InvalidArgumentError, "nan"),
    ("clamp bound negative", lambda m, t: clamp_dims(m, [1], mode="bound", value=-2.0), InvalidArgumentError, "-2"),
    ("clamp dims empty", lambda m, t: clamp_dims(m, []), InvalidArgumentError, "empty list"),
    ("clamp dim d_model", lambda m, t: clamp_dims(m, [16]), InvalidArgumentError, "residual dimension 16"),
    ("edit value inf", lambda m, t: edit_neurons(m, [1], layers=[0], mode="set", value=math.inf), InvalidArgumentError, "inf"),
    ("edit neuron d_mlp", lambda m, t: edit_neurons(m, [32], layers=[0]), InvalidArgumentError, "neuron 32"),
    ("edit without layers", lambda m, t: edit_neurons(m, [3, 4]), InvalidArgumentError, "[3, 4]"),
    ("edit layer key", lambda m, t: edit_neurons(m, {7: [1]}), InvalidArgumentError, "layer 7"),
    ("transplant source", lambda m, t: transplant_dims(m, [0], positions=[3], source=99), InvalidArgumentError, "source position 99"),
    ("calibrate eps", lambda m, t: calibrate(m, eps=0.0), InvalidArgumentError, "eps"),
    ("reference nan", lambda m, t: amplify(m, positions=3, alpha=2, layers=[0], reference={0: torch.full((4, 4), math.nan)}), InvalidArgumentError, "layer 0"),
    ("reference shape", lambda m, t: m.run_with_hooks(t, fwd_hooks=amplify(m, positions=3, alpha=2, layers=[0], reference={0: torch.zeros(3)})), InvalidArgumentError, "(3,)"),
    ("reference option", lambda m, t: amplify(m, positions=3, alpha=2, n_sequence=4), InvalidArgumentError, "'n_sequence'"),
    ("reference_mean n_sequences", lambda m, t: reference_mean(m, n_sequences=0), InvalidArgumentError, "n_sequences"),
    ("mask not bool", lambda m, t: custom_mask(m, torch.ones(12, 12)), InvalidArgumentError, "torch.float32"),
    ("mask not square", lambda m, t: custom_mask(m, torch.ones(12, 11, dtype=torch.bool)), InvalidArgumentError, "(12, 11)"),
    ("mask heads", lambda m, t: custom_mask(m, torch.ones(3, 12, 12, dtype=torch.bool)), InvalidArgumentError, "3 heads"),
    ("mask length", lambda m, t: m.run_with_hooks(t, fwd_hooks=custom_mask(m, torch.ones(8, 8, dtype=torch.bool))), InvalidArgumentError, "(8, 8)"),
    ("unknown method", lambda m, t: create_sink(m, t, 3, method="teleport", options=Q), InvalidArgumentError, "'teleport'"),
    ("wrong role", lambda m, t: create_sink(m, t, 3, method="block-keys", options=Q), InvalidArgumentError, "'block-keys'"),
    ("method needs dims", lambda m, t: remove_sink(m, t, method="clamp_dims", options=Q), InvalidArgumentError, "dims="),
    ("method needs neurons", lambda m, t: remove_sink(m, t, method="edit_neurons", layers=[0], options=Q), InvalidArgumentError, "neurons="),
    ("no query after target", lambda m, t: create_sink(m, t, 11, options=Q), InvalidArgumentError, "position 11"),
    ("sink past the text", lambda m, t: create_sink(m, t, 3, sink=40, options=Q), InvalidArgumentError, "sink position 40"),
    ("tracked dims", lambda m, t: measure_intervention(m, t, [], target=3, dims=[99], options=Q), InvalidArgumentError, "dims 99"),
    ("sweep alphas without alpha", lambda m, t: sweep(m, t, method="restart", positions=[3], alphas=[2.0], options=Q), InvalidArgumentError, "'restart'"),
    ("sweep layer set empty", lambda m, t: sweep(m, t, positions=[3], layer_sets=[[]], options=Q), InvalidArgumentError, "empty list"),
    ("patch target", lambda m, t: patch_sink(m, t, [], target=-1), InvalidArgumentError, "target position -1"),
    ("patch target last", lambda m, t: patch_sink(m, t, [], target=11), InvalidArgumentError, "Target 11"),
    ("patch metric layers", lambda m, t: patch_sink(m, t, [], metric_layers=[]), InvalidArgumentError, "empty list"),
]


@pytest.mark.parametrize("call,error,text", [c[1:] for c in PYTHON_CASES], ids=[c[0] for c in PYTHON_CASES])
def test_python_bad_input(tiny_llama, toks, call, error, text):
    with pytest.raises(error) as info:
        call(tiny_llama, toks)
    assert isinstance(info.value, SinklensError)
    assert text in str(info.value), str(info.value)


def test_numpy_and_tensor_scalars_are_accepted(tiny_llama, toks, capture):
    import numpy as np

    m = tiny_llama
    z0 = "blocks.0.attn.hook_z"
    ref = capture(m, toks, [z0], amplify(m, positions=[3], alpha=2.0, layers=[0], heads=[1], reference="batch"))[z0]
    for positions, alpha, layers, heads in [
        (np.int64(3), np.float32(2.0), np.array([0]), np.int64(1)),
        (torch.tensor(3), torch.tensor(2.0), torch.tensor([0]), torch.tensor(1)),
        (np.array([3]), 2, (np.int32(0),), [torch.tensor(1)]),
    ]:
        hooks = amplify(m, positions=positions, alpha=alpha, layers=layers, heads=heads, reference="batch")
        torch.testing.assert_close(capture(m, toks, [z0], hooks)[z0], ref)
    clamped = capture(m, toks, ["blocks.0.hook_resid_post"], clamp_dims(m, np.int64(2), value=np.float64(0.5), layers=[0]))
    assert torch.all(clamped["blocks.0.hook_resid_post"][:, 0, 2] == 0.5)


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "sinklens.cli", "intervene", "--model", str(tmp_path / "no-such-model"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


# (case id, arguments, text stderr must contain); {tmp} is the test's temporary folder
CLI_CASES = [
    ("unknown method", ["--method", "teleport", "--position", "3"], "'teleport'"),
    ("create needs a position", ["--method", "self-only"], "--position"),
    ("edit-neurons needs layers", ["--method", "edit-neurons", "--neurons", "1,2"], "--layers"),
    ("clamp needs dims", ["--method", "clamp-dims"], "--dims"),
    ("alpha for a mask", ["--method", "restart", "--position", "3", "--alpha", "2"], "--alpha"),
    ("bad layer list", ["--method", "self-only", "--position", "3", "--layers", "0,x"], "'0,x'"),
    ("json under a file", ["--method", "self-only", "--position", "3", "--json", "{tmp}/file.txt/out.json"], "file.txt"),
    ("argparse type", ["--method", "self-only", "--position", "abc"], "'abc'"),
]


@pytest.mark.parametrize("args,text", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(tmp_path, args, text):
    (tmp_path / "file.txt").write_text("a file, not a folder")
    proc = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert text in proc.stderr and "no-such-model" not in proc.stderr, proc.stderr


def test_cli_json_is_strict_and_checked_before_the_model_loads(tiny, tmp_path, monkeypatch):
    import sinklens.loading
    from sinklens import cli

    loaded = []
    monkeypatch.setattr(sinklens.loading, "load_model", lambda spec, **kw: loaded.append(spec) or tiny)
    text = " ".join(f"t{i}" for i in range(3, 15))
    out = tmp_path / "r.json"
    assert cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--no-loss", "--json", str(out)]) == 0

    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    data = json.loads(out.read_text(), parse_constant=no_constants)
    assert data["loss_before"] is None and data["loss_after"] is None  # NaN (no loss computed) -> null
    assert len(data["after"]) == tiny.cfg.n_layers and loaded == ["smollm2-135m"]
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OutputNotWritableError, match="file.txt"):
        from sinklens.commands.intervene import check_args

        check_args(cli.build_parser().parse_args(
            ["intervene", "--method", "restart", "--position", "4", "--json", str(tmp_path / "file.txt" / "o.json")]))
    assert cli.main(["intervene", "--method", "restart", "--position", "4", "--json", str(tmp_path / "file.txt" / "o.json")]) == 2
    assert loaded == ["smollm2-135m"]  # the second call never reached the loader
