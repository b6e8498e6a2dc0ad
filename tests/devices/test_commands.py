"""Every model-facing command with ``--device`` on the lane's device writes the CPU's numbers.

Run in-process (``sinklens.cli.main``) on the tiny seeded Llama of :mod:`support.zoo`, once with
``--device cpu`` and once on the lane's device; their JSON outputs are compared field by field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sinklens.cli import main
from support.zoo import zoo_dir

DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
PROMPTS = ["t4 t5 t6 t7 t8 t9", "t8 t9 t10", "t2 t3 t4 t5 t6 t7 t8 t9 t10 t11"]
TEXT = ["--text", *PROMPTS]
TEXT_EACH = [arg for prompt in PROMPTS for arg in ("--text", prompt)]  # intervene: --text is repeated


def _run(lane, argv: list[str], device: str, dtype: torch.dtype | None) -> None:
    flags = ["--device", str(lane.device) if device == "lane" else "cpu"]
    if dtype is not None:
        flags += ["--dtype", DTYPE_NAME[dtype]]
    if device == "lane":
        with lane.active():
            code = main([*argv, *flags])
    else:
        code = main([*argv, *flags])
    assert code == 0, f"sinklens {' '.join(argv[:1])} --device {device} exited {code}"


def _same_json(lane, tmp_path: Path, argv, output: str, dtype: torch.dtype | None) -> None:
    """Run ``argv`` (with ``{out}`` standing for a per-device path) on both devices; compare ``output``."""
    results = []
    for device in ("cpu", "lane"):
        out = tmp_path / device
        _run(lane, [a.replace("{out}", str(out)) for a in argv], device, dtype)
        results.append(json.loads((out / output if output else out.with_suffix(".json")).read_text()))
    lane.assert_same(*results, dtype or torch.float32)


def test_analyze(lane, dtype, tmp_path):
    _same_json(lane, tmp_path, ["analyze", "--model", str(zoo_dir("llama")), *TEXT, "--batch-size", "2", "--verify",
                                "--no-figures", "--out", "{out}"], "report.json", dtype)


INTERVENTIONS = {"self-only": [], "restart": [], "amplify": ["--alpha", "3"], "transplant-dims": ["--dims", "1,2"],
                 "block-keys": [], "calibrate": [], "clamp-dims": ["--dims", "1,2"],
                 "edit-neurons": ["--neurons", "3,5", "--layers", "0"], "variance-calibration": []}


@pytest.mark.parametrize("method", list(INTERVENTIONS))
def test_intervene(lane, method, tmp_path):
    _same_json(lane, tmp_path, ["intervene", "--model", str(zoo_dir("llama")), "--method", method, "--position", "3",
                                *INTERVENTIONS[method], *TEXT_EACH, "--batch-size", "2", "--json", "{out}.json"], "", torch.float32)


def test_intervene_bf16(lane, tmp_path):
    _same_json(lane, tmp_path, ["intervene", "--model", str(zoo_dir("llama")), "--method", "self-only", "--position",
                                "3", *TEXT_EACH, "--json", "{out}.json"], "", torch.bfloat16)


def test_origins(lane, dtype, tmp_path):
    _same_json(lane, tmp_path, ["origins", "--model", str(zoo_dir("llama")), "--sequences", "4", "--seq-len", "6",
                                "--no-figures", "--out", "{out}"], "origins.json", dtype)


def test_fingerprint(lane, dtype, tmp_path):
    z = str(zoo_dir("llama"))
    _same_json(lane, tmp_path, ["fingerprint", z, f"{z}@init:1", "--samples", "24", "--seq-len", "8", "--buffer-k", "8",
                                "--no-progress", "--json", "{out}.json"], "", dtype)


TRAIN = ["train", "--preset", "tiny", "--variant", "headwise_rms", "--data", "bigram-backcopy", "--steps", "4",
         "--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set", "model.d_vocab=24", "--set",
         "data.vocab_size=24", "--seq-len", "16", "--batch-size", "8", "--set", "eval.interval=2", "--set",
         "eval.batches=1", "--set", "eval.batch_size=4", "--no-progress"]


def _losses(run: Path) -> dict:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {f"{x['kind']}@{x['step']}": {k: v for k, v in x.items() if k in ("loss", "val_loss", "sink_rate")}
            for x in lines if x.get("kind") in ("train", "eval")}


def _train_both(lane, tmp_path: Path, precision: list[str]) -> list[dict]:
    runs = []
    for device in ("cpu", "lane"):
        _run(lane, [*TRAIN, *precision, "--out", str(tmp_path / device)], device, None)
        runs.append(_losses(tmp_path / device))
    return runs


def test_train_then_compare(lane, tmp_path, capsys):
    """Four float32 steps and the evaluation on the device give the CPU's losses; ``compare`` reads both runs."""
    cpu, device = _train_both(lane, tmp_path, ["--set", "autocast=none"])
    assert len(cpu) >= 4
    lane.assert_same(cpu, device, torch.float32)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "cpu"), str(tmp_path / "lane"), "--json", "-", "--out",
                 str(tmp_path / "c.png")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2


def test_train_bf16_autocast(lane, tmp_path):
    """bfloat16 autocast on the GPU against bfloat16 autocast on the CPU (loose: the two round differently)."""
    if lane.fake:
        pytest.skip("autocast(device_type='cuda') needs a CUDA build of torch; the pretend device runs float32")
    cpu, device = _train_both(lane, tmp_path, ["--set", "autocast=bfloat16", "--set", "cpu_autocast=bfloat16"])
    lane.assert_same(cpu, device, torch.bfloat16)
