"""benchmarks/gpu_check.py on a CPU: its tiny timing part writes the table as strict JSON, and without CUDA it
says "no GPU" in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
TIMED = ("bridge forward, no-op hook_pattern", "analyze", "find_sinks", "find_massive_activations",
         "find_super_neurons", "measure_variance", "measure_value_drain")
REFERENCE = "HF eager forward, output_attentions"


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    return json.loads(text, parse_constant=refuse)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900,
                          env=env)


def test_tiny_timing_part_writes_one_row_per_analyzer_against_the_eager_forward(tmp_path):
    done = _run("--tiny", "--device", "cpu", "--parts", "analysis", "--out", str(tmp_path / "check.json"))
    report = _strict_json((tmp_path / "check.json").read_text())
    assert (report["card"], report["device"], report["torch"], report["status"]) == ("cpu", "cpu", torch.__version__, "done")
    assert report["sinklens_commit"] and report["transformer_lens"] and report["part_seconds"]["analysis"] > 0
    rows = {r["metric"]: r for r in report["rows"]}
    assert sorted(rows) == sorted((REFERENCE, *TIMED)), report["rows"]
    ref = rows[REFERENCE]["value"]
    assert ref > 0 and rows[REFERENCE]["tokens_per_s"] == pytest.approx(8 * 32 / ref)
    for name in TIMED:
        r = rows[name]
        assert r["status"] in ("info", "pass", "fail"), (name, r["note"])
        assert r["component"] == "tiny-llama float32" and r["unit"] == "s"
        assert r["value"] > 0 and r["reference"] == ref and r["ratio"] == pytest.approx(r["value"] / ref)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["value"])
        assert r["peak_gib"] is None  # no CUDA: no peak memory
    analyze = rows["analyze"]
    assert analyze["goal"] == "<= 1.15x" and analyze["status"] == ("pass" if analyze["ratio"] <= 1.15 else "fail")
    assert all(rows[name]["goal"] == "" and rows[name]["status"] == "info" for name in TIMED if name != "analyze")
    assert done.returncode == report["exit_code"] == (1 if analyze["status"] == "fail" else 0), done.stderr
    table = done.stdout.splitlines()
    assert table[-len(rows) - 2].split() == ["component", "metric", "value", "reference", "ratio", "goal", "pass/fail"]
    assert f"{analyze['ratio']:.3f}x" in next(line for line in table if "  analyze  " in line)


def test_without_cuda_it_says_no_gpu_in_one_line_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine that has one
    done = _run("--out", str(tmp_path / "check.json"), env=env)
    build = "cpu build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
    assert (done.returncode, done.stdout, done.stderr) == (
        0, f"no GPU: CUDA is not available (torch {torch.__version__.split('+')[0]}, {build})\n", "")
    report = _strict_json((tmp_path / "check.json").read_text())
    assert (report["status"], report["rows"], report["exit_code"]) == ("no GPU", [], 0)


def test_tiny_long_context_part_reads_sinks_from_queries_and_keys_against_a_plain_forward(tmp_path):
    done = _run("--tiny", "--device", "cpu", "--parts", "long", "--out", str(tmp_path / "check.json"))
    report = _strict_json((tmp_path / "check.json").read_text())
    assert (report["status"], report["exit_code"], done.returncode) == ("done", 0, 0), done.stderr
    rows = {r["metric"]: r for r in report["rows"]}
    assert list(rows) == ["plain forward, SDPA", "find_sinks(method='qk')", "find_sinks(method='qk') memory above weights"]
    assert {r["component"] for r in rows.values()} == {"tiny-llama float32, 512 tokens"}
    ref, qk, memory = rows.values()
    assert ref["value"] > 0 and ref["tokens_per_s"] == pytest.approx(512 / ref["value"])
    assert qk["value"] > 0 and qk["reference"] == ref["value"] and qk["ratio"] == pytest.approx(qk["value"] / ref["value"])
    assert qk["note"] == "path qk" and qk["status"] == "info" and qk["peak_gib"] is None
    # the weights of the tiny shape: 2 x 64 x 512 embeddings (tied) + 2 layers of attention, SwiGLU and 2 norms + a norm
    n_params = 512 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert memory["value"] is None and memory["reference"] == pytest.approx(n_params * 4 / 2**30)
