"""``TrainConfig.compile``: on for CUDA by default, compiled checkpoints that load eagerly, fallback, many models."""

from __future__ import annotations

import json

import pytest
import torch
from _train_cfg import build_cfg

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import TrainConfig
from sinklens.sinklm.config import apply_overrides, parse_flags as parse_args
from sinklens.train import loop
from sinklens.train.loop import train


def test_config_accepts_true_false_auto():
    assert TrainConfig().compile == "auto"
    assert [apply_overrides(TrainConfig(), [f"compile={v}"]).compile for v in ("true", "false", "auto")] == [True, False, "auto"]
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "compile": False}).compile is False  # old config.json
    # the CLI flag as users type it (lower case), as docs/training.md spells it
    assert [parse_args(TrainConfig(), ["--compile", v]).compile for v in ("true", "false", "auto", "False")] == [
        True, False, "auto", False]
    with pytest.raises(InvalidArgumentError, match="compile"):
        apply_overrides(TrainConfig(), ["compile=yes"])


def test_auto_is_eager_on_a_cpu(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(loop, "compile_model", lambda m: calls.append(1) or m)
    result = train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    assert calls == [] and result.compile == {"compiled": False, "compile_s": None, "error": None}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["train"] * 3 and not any(x["compiled"] for x in lines)
    train(build_cfg(steps=1, compile=True), progress=False)
    assert calls == [1]  # compile=true compiles on a CPU too


_COMPILED_RUN = r"""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests/train")
from _train_cfg import build_cfg
from safetensors.torch import load_file
from sinklens.train import loop, speed
from sinklens.sinklm.checkpoint import load_trained_model
from sinklens.train.loop import train
from sinklens.sinklm.model import SinkLM

speed.COMPILE_KWARGS = {"backend": "eager"}  # dynamo's graphs run as traced: fast, same kernels as eager
calls = []
real = loop.compile_model
loop.compile_model = lambda m: calls.append(1) or real(m)
tmp = Path(sys.argv[1])
cfg = build_cfg(steps=6, compile=True)
compiled = train(cfg, out_dir=tmp / "compiled", progress=False, until=4)
lines = [json.loads(x) for x in (tmp / "compiled" / "metrics.jsonl").read_text().splitlines()]
(step_dir,) = sorted((tmp / "compiled" / "checkpoints").glob("step-*"))
keys = sorted(load_file(str(step_dir / "model.safetensors")))
loaded = load_trained_model(tmp / "compiled")
same_loaded = all(torch.equal(p, q) for p, q in zip(compiled.model.parameters(), loaded.parameters()))
resumed = train(cfg.replace(compile=False), out_dir=tmp / "compiled", progress=False, resume=True)
eager = train(cfg.replace(compile=False), out_dir=tmp / "eager", progress=False)
max_diff = max(float((p - q).abs().max()) for p, q in zip(resumed.model.parameters(), eager.model.parameters()))
print(json.dumps({"calls": len(calls), "compile": compiled.compile, "resumed_compile": resumed.compile,
                  "lines": [[x["kind"], x["step"], x.get("compiled")] for x in lines],
                  "keys": keys, "eager_keys": sorted(SinkLM(cfg.model).state_dict()), "same_loaded": same_loaded,
                  "compiled_losses": compiled.losses(), "resumed_losses": resumed.losses(),
                  "eager_losses": eager.losses(), "max_param_diff": max_diff}))
"""


def test_compiled_run_checkpoint_loads_eagerly_and_trains_as_eager(tmp_path):
    # in a subprocess: pytest's jaxtyping/beartype instrumentation of sinklens is not traceable by dynamo
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILED_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["calls"] == 1 and got["compile"]["compiled"] and got["compile"]["error"] is None
    assert got["compile"]["compile_s"] > 0
    assert got["lines"] == [["compile", 0, True], *[["train", s, True] for s in range(4)]]
    # the checkpoint holds the plain model's weight names (no "_orig_mod.") and loads into an eager SinkLM
    assert got["keys"] == got["eager_keys"] and not any("_orig_mod" in k for k in got["keys"])
    assert got["same_loaded"]
    # compiled, then resumed eagerly, the run ends where an all-eager run ends
    assert got["resumed_compile"]["compiled"] is False
    assert got["compiled_losses"] == pytest.approx(got["eager_losses"][:4], abs=1e-5)
    assert got["resumed_losses"] == pytest.approx(got["eager_losses"], abs=1e-5)
    assert got["max_param_diff"] < 1e-5


_FAILED_COMPILE = r"""
import json, sys, warnings
from pathlib import Path
import torch
sys.path.insert(0, "tests/train")
from _train_cfg import build_cfg
from sinklens.train import loop, speed
from sinklens.train.loop import train

def broken_backend(gm, example_inputs):
    raise RuntimeError("no inductor here")

speed.COMPILE_KWARGS = {"backend": broken_backend}
tmp = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    failed = train(build_cfg(steps=4, compile=True), out_dir=tmp / "a", progress=False)
eager = train(build_cfg(steps=4, compile=False), progress=False)
lines = [json.loads(x) for x in (tmp / "a" / "metrics.jsonl").read_text().splitlines()]
print(json.dumps({"warnings": [str(w.message) for w in caught], "compile": failed.compile, "kinds": [x["kind"] for x in lines],
                  "failed_losses": failed.losses(), "eager_losses": eager.losses()}))
"""


def test_failed_compile_warns_and_trains_on_eagerly(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FAILED_COMPILE, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    (warning,) = [w for w in got["warnings"] if "torch.compile failed" in w]
    assert "no inductor here" in warning and "continues eagerly" in warning and "\n" not in warning
    assert got["compile"]["compiled"] is False and "no inductor here" in got["compile"]["error"]
    assert got["failed_losses"] == got["eager_losses"]  # the failed step was redone eagerly from the same state
    assert got["kinds"] == ["compile", "train", "train", "train", "train"]


_MANY_MODELS = r"""
import json, sys
sys.path.insert(0, "tests/train")
from _train_cfg import build_cfg
from sinklens.train import loop, speed
from sinklens.train.loop import train

calls = []
def counting_backend(gm, example_inputs):  # called once for every graph dynamo really compiles
    calls.append(1)
    return gm.forward

speed.COMPILE_KWARGS = {"backend": counting_backend}
seen = []
for i in range(10):  # ten differently shaped models trained compiled in one process, as in a notebook sweep
    before, d = len(calls), 16 + 8 * i
    result = train(build_cfg(steps=2, compile=True, model={"d_model": d, "d_mlp": 2 * d}), progress=False)
    seen.append([result.compile["compiled"], len(calls) - before])
print(json.dumps(seen))
"""


def test_a_run_reported_compiled_was_compiled_in_a_process_that_trains_many_models(tmp_path):
    # dynamo keeps at most 8 compiled entries per code object, shared by every torch.compile of SinkLM
    # unless the call isolates its recompiles: without that the 9th and 10th models ran eagerly, reported compiled.
    import subprocess
    import sys

    import inspect

    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        pytest.skip(f"torch {torch.__version__}'s torch.compile has no isolate_recompiles")
    done = subprocess.run([sys.executable, "-c", _MANY_MODELS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [[True, 1]] * 10
