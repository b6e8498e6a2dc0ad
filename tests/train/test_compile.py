"""``TrainConfig.compile``: the "auto" rule, eager tiny runs, compiled checkpoints that load eagerly, fallback."""

from __future__ import annotations

import json

import pytest
import torch
from _train_cfg import build_cfg

from sinklens.errors import InvalidArgumentError
from sinklens.train import compile as tc
from sinklens.sinklm.config import TrainConfig, apply_overrides, parse_args
from sinklens.train.loop import train

CPU = torch.device("cpu")


def test_auto_rule_compares_expected_saving_with_compile_cost():
    # saving = steps_left × step_s × SAVED_FRACTION[device] against COMPILE_SECONDS[device] (60 s)
    assert tc.SAVED_FRACTION == {"cpu": 0.1, "cuda": 0.2} and tc.COMPILE_SECONDS == {"cpu": 60.0, "cuda": 60.0}
    assert tc.AUTO_MIN_STEPS == 100
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    yes = tc.decide("auto", blocker=None, steps_left=1500, step_seconds=0.2, device=cuda)  # 60 s >= 60 s
    no = tc.decide("auto", blocker=None, steps_left=1400, step_seconds=0.2, device=cuda)  # 56 s < 60 s
    assert yes.compile and "60 s expected saving" in yes.reason
    assert not no.compile and "56 s expected saving" in no.reason
    # A CPU expects a tenth of a step saved (and checks it after compiling, below): 1200 × 0.5 s × 0.1 = 60 s.
    cpu_long = tc.decide("auto", blocker=None, steps_left=1200, step_seconds=0.5, device=CPU)
    cpu_short = tc.decide("auto", blocker=None, steps_left=1100, step_seconds=0.5, device=CPU)
    assert cpu_long.compile and "60 s expected saving" in cpu_long.reason
    assert not cpu_short.compile and "55 s expected saving" in cpu_short.reason
    assert not tc.decide("auto", blocker=None, steps_left=99, step_seconds=100.0, device=cuda).compile  # too short
    assert not tc.decide("auto", blocker=None, steps_left=10**6, step_seconds=None, device=cuda).compile  # untimed
    assert not tc.decide("auto", blocker="no C++ compiler", steps_left=10**6, step_seconds=1.0, device=CPU).compile
    assert tc.decide(True, blocker="x", steps_left=1, step_seconds=None, device=CPU).compile
    assert not tc.decide(False, blocker=None, steps_left=10**6, step_seconds=9.0, device=CPU).compile


def test_blockers(monkeypatch):
    assert tc.compile_blocker(CPU, hooks=False, distributed=False) is None  # g++ is on this machine
    assert "hooks" in tc.compile_blocker(CPU, hooks=True, distributed=False)
    assert "distributed" in tc.compile_blocker(CPU, hooks=False, distributed=True)
    assert "not a CPU or CUDA" in tc.compile_blocker(torch.device("meta"), hooks=False, distributed=False)
    monkeypatch.setattr(tc, "cxx_compiler", lambda: None)
    assert "C++ compiler" in tc.compile_blocker(CPU, hooks=False, distributed=False)


def test_config_accepts_true_false_auto():
    assert TrainConfig().compile == "auto"
    assert [apply_overrides(TrainConfig(), [f"compile={v}"]).compile for v in ("true", "false", "auto")] == [True, False, "auto"]
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "compile": False}).compile is False  # old config.json
    # the CLI flag as users type it (lower case), as the README spells it
    assert [parse_args(TrainConfig(), ["--compile", v]).compile for v in ("true", "false", "auto", "False")] == [
        True, False, "auto", False]
    with pytest.raises(InvalidArgumentError, match="compile"):
        apply_overrides(TrainConfig(), ["compile=yes"])


def _count_compiles(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = tc.compile_model

    def counting(model):
        calls.append(1)
        return real(model)

    monkeypatch.setattr(tc, "compile_model", counting)
    return calls


def test_tiny_auto_run_stays_eager(monkeypatch, tmp_path):
    calls = _count_compiles(monkeypatch)
    result = train(build_cfg(steps=6), out_dir=tmp_path, progress=False)
    assert calls == []
    assert result.compile == {"mode": "auto", "compiled": False, "reason": "auto: only 6 steps left (fewer than 100)",
                              "compile_s": None, "error": None, "eager_step_s": None, "compiled_step_s": None}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["train"] * 6 and not any(x["compiled"] for x in lines)


class _Marked(torch.nn.Module):
    """Stands in for a compiled model (no dynamo): the same forward, recognisable by its type."""

    def __init__(self, model, delay_s=0.0):
        super().__init__()
        self.model, self.delay_s = model, delay_s

    def forward(self, *args, **kwargs):
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        return self.model(*args, **kwargs)


def _auto_switch(monkeypatch, eager_s):
    monkeypatch.setattr(tc, "compile_model", _Marked)
    raw = torch.nn.Linear(2, 2)
    switch = tc.CompileSwitch("auto", raw, lambda m: m, CPU, hooks=False, distributed=False, steps_left=10**6)
    switch.maybe_decide(tc.AUTO_PROBE_STEPS, 10**6, eager_s)
    assert switch.compiled and isinstance(switch.model, _Marked) and not switch.checking  # compile step not run yet
    switch.compile_s = 30.0  # the loop records it after the first compiled step
    return switch, raw


@pytest.mark.parametrize(("times", "kept"), [((0.8, 0.95, 0.7), True), ((1.1, 0.9, 1.0), False)])
def test_auto_keeps_the_compiled_model_only_where_its_steps_are_faster(monkeypatch, times, kept):
    switch, raw = _auto_switch(monkeypatch, eager_s=0.92)
    assert switch.checking and switch.eager_step_s == 0.92
    assert [switch.record_compiled_step(t) for t in times] == [False] * (tc.AUTO_CHECK_STEPS - 1) + [True]
    # the median of the three compiled steps (0.8 or 1.0 s) against the eager step (0.92 s)
    assert switch.compiled_step_s == sorted(times)[1] and not switch.checking
    assert switch.compiled is kept and switch.decision.compile is kept
    assert isinstance(switch.model, _Marked) is kept and (switch.model is raw) is not kept
    assert switch.decision.reason.startswith("auto: 1000000 steps")
    assert switch.decision.reason.endswith(f"{sorted(times)[1]:.3g} s against 0.92 s eager (median of 3), so "
                                           + ("kept compiled" if kept else "back to eager"))
    assert switch.record_compiled_step(0.1) is False and switch.compiled is kept  # settled once


def test_auto_goes_back_to_eager_when_compiled_steps_are_slower(monkeypatch, tmp_path):
    # "compiled" model 0.2 s slower a step: after the compile step and three checked steps the run is eager again,
    # and it trains exactly as an all-eager run (the stand-in computes the same).
    monkeypatch.setattr(tc, "AUTO_MIN_STEPS", 2)
    monkeypatch.setattr(tc, "COMPILE_SECONDS", {"cpu": 0.0})
    monkeypatch.setattr(tc, "compile_model", lambda m: _Marked(m, delay_s=0.2))
    got = train(build_cfg(steps=9), out_dir=tmp_path / "auto", progress=False)
    eager = train(build_cfg(steps=9, compile=False), progress=False)
    lines = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    kinds = [(x["kind"], x["step"], x.get("compiled")) for x in lines]
    assert kinds == [("train", 0, False), ("train", 1, False), ("compile", 2, True), ("train", 2, True),
                     ("train", 3, True), ("train", 4, True), ("compile", 5, False), ("train", 5, True),
                     *[("train", s, False) for s in range(6, 9)]]
    check = lines[6]
    assert check["compiled_step_s"] > check["eager_step_s"] + 0.15 and "back to eager" in check["reason"]
    assert got.compile["compiled"] is False and got.compile["compiled_step_s"] == check["compiled_step_s"]
    assert got.losses() == eager.losses()


_COMPILED_RUN = r"""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests/train")
from _train_cfg import build_cfg
from safetensors.torch import load_file
from sinklens.train import compile as tc
from sinklens.sinklm.checkpoint import load_trained_model
from sinklens.train.loop import train
from sinklens.sinklm.model import SinkLM

# "auto" decides to compile any run of 2+ steps left, at no cost, with dynamo's (fast) eager backend
tc.AUTO_MIN_STEPS, tc.COMPILE_SECONDS, tc.COMPILE_KWARGS = 2, {"cpu": 0.0}, {"backend": "eager"}
calls = []
real = tc.compile_model
tc.compile_model = lambda m: calls.append(1) or real(m)
tmp = Path(sys.argv[1])
cfg = build_cfg(steps=6)
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
                  "lines": [[x["kind"], x["step"], x.get("compiled")] for x in lines], "compile_line": lines[2],
                  "keys": keys, "eager_keys": sorted(SinkLM(cfg.model).state_dict()), "same_loaded": same_loaded,
                  "resumed_losses": resumed.losses(), "eager_losses": eager.losses(), "max_param_diff": max_diff}))
"""


def test_auto_compiles_after_probing_and_checkpoint_loads_eagerly(tmp_path):
    # in a subprocess: pytest's jaxtyping/beartype instrumentation of sinklens is not traceable by dynamo
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILED_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["calls"] == 1 and got["compile"]["compiled"] and got["compile"]["error"] is None
    assert got["compile"]["reason"].startswith("auto: 2 steps")
    # two timed eager probe steps, then compiled ones; one compile line at the first compiled step
    assert got["lines"] == [["train", 0, False], ["train", 1, False], ["compile", 2, True], ["train", 2, True],
                            ["train", 3, True]]
    assert got["compile_line"]["compile_s"] is not None
    # the checkpoint holds the plain model's weight names (no "_orig_mod.") and loads into an eager SinkLM
    assert got["keys"] == got["eager_keys"] and not any("_orig_mod" in k for k in got["keys"])
    assert got["same_loaded"]
    # resumed eagerly, the run ends where an all-eager run ends (dynamo's eager backend runs the same kernels)
    assert got["resumed_compile"]["compiled"] is False
    assert got["resumed_losses"] == pytest.approx(got["eager_losses"], abs=1e-5)
    assert got["max_param_diff"] < 1e-5


_FAILED_COMPILE = r"""
import json, sys, warnings
from pathlib import Path
import torch
sys.path.insert(0, "tests/train")
from _train_cfg import build_cfg
from sinklens.train import compile as tc
from sinklens.train.loop import train

def broken_backend(gm, example_inputs):
    raise RuntimeError("no inductor here")

tc.COMPILE_KWARGS = {"backend": broken_backend}
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
from sinklens.train import compile as tc
from sinklens.train.loop import train

calls = []
def counting_backend(gm, example_inputs):  # called once for every graph dynamo really compiles
    calls.append(1)
    return gm.forward

tc.COMPILE_KWARGS = {"backend": counting_backend}
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

    if not tc._isolates_recompiles():
        pytest.skip(f"torch {torch.__version__}'s torch.compile has no isolate_recompiles")
    done = subprocess.run([sys.executable, "-c", _MANY_MODELS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [[True, 1]] * 10
