#!/usr/bin/env python3
"""One-call GPU check of sinklens: the GPU test lane, analysis speed against the plain Hugging Face eager
forward, and ``sinklens train`` against the head-wise RMSNorm authors' ``train.py``; one table, one JSON file.

Usage (from anywhere; needs a CUDA build of torch, no network)::

    benchmarks/gpu_check.sh [--wheels DIR] [--authors DIR] [--out FILE] [--parts lane,analysis,trainer]
    benchmarks/gpu_check.sh --tiny --device cpu --out /tmp/check.json     # the whole pipeline, tiny, on a CPU

Parts, each in its own process with its own time budget (``--budget part=SECONDS``), so one that fails or
runs over is a row of the table and the others still run:

* ``lane``: ``python -m pytest -p no:cacheprovider -q tests/devices --device DEVICE``; passed / failed counts.
* ``analysis``: random-init Llama shapes (TinyLlama-1.1B in bfloat16, SmolLM2-135M in float32), saved without
  a tokenizer and loaded with ``sinklens.load_model``; 64 sequences of 512 random tokens (token 0 first, as
  the BOS) in batches of 16. Each of ``analyze``, ``find_sinks``, ``find_massive_activations``,
  ``find_super_neurons``, ``measure_variance`` and ``measure_value_drain`` is timed (median of 3 runs after
  one warm-up, synchronised) against the Hugging Face model's eager forward with ``output_attentions=True``
  on the same batches; peak memory is ``torch.cuda.max_memory_allocated`` during those runs, with only the
  timed model loaded. Goal: ``analyze`` <= 1.15x the eager forward on the 1.1B shape.
* ``trainer``: ``sinklens train`` at the authors' ``config/headnorm.py`` configuration (12 layers, d_model
  768, SwiGLU 3072, vocabulary 50304, sequence 4096, 12 x 5 sequences a step, bf16, compiled) on random
  tokens, both variants, and with ``--authors DIR`` (a checkout of Siquan-Li/Head-wise-RMSNorm) their
  ``train.py`` on the same ``train.bin``; tokens/s is the median over the steps after the first three.
  Goals: sinklens >= 1.15x theirs, HeadNorm >= 0.97x baseline, MFU >= 0.5.
* ``long``: a random-init sinklens Llama of Llama-3-8B's shape (32 layers, d_model 4096, 32 heads, 8 kv heads,
  SwiGLU 14336, vocabulary 128256, rope base 500000) in bfloat16, one sequence of 32,768 random tokens:
  ``find_sinks(method="qk")`` against the same model's plain forward (SDPA, flash). Goals: at most 1.5x the
  forward, peak ``torch.cuda.max_memory_allocated`` at most the weights + 12 GiB. Skipped on a card under 40 GiB.

Exit status: 0 when every row passed or is informational, and on a machine without CUDA (it says
``no GPU: ...`` and checks nothing); 1 when a row failed its goal or a part failed; 2 for a usage error or
when torch is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("lane", "analysis", "long", "trainer")
#: Seconds each part may take on one H100/H200 and all of it (setup included); the trainer, last, gets what the
#: others left of the total. --budget changes them.
BUDGET_S = {"lane": 110, "analysis": 125, "long": 100, "trainer": 300, "total": 465}
ANALYZERS = ("analyze", "find_sinks", "find_massive_activations", "find_super_neurons", "measure_variance",
             "measure_value_drain")
ANALYZE_GOAL, TRAIN_GOAL, HEADNORM_GOAL, MFU_GOAL = 1.15, 1.15, 0.97, 0.5
LONG_TIME_GOAL, LONG_EXTRA_GIB, LONG_MIN_CARD_GIB = 1.5, 12.0, 40.0
#: the long-context part: a sinklens Llama (SinkLM) of this shape on one sequence of this length
LONG = dict(full=(dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336, d_vocab=128256,
                       rope_base=500000.0), 32768, "bfloat16", "llama-3-8b-shape"),
            tiny=(dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=128, d_vocab=512, rope_base=500000.0),
                  512, "float32", "tiny-llama"))

# name, Llama shape, dtype, goal shape (analyze <= ANALYZE_GOAL x eager); sequences, length, batch
SHAPES = [
    ("tinyllama-1.1b-shape", dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                  intermediate_size=5632, vocab_size=32000), "bfloat16", True),
    ("smollm2-135m-shape", dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                intermediate_size=1536, vocab_size=49152), "float32", False),
]
TINY_SHAPES = [("tiny-llama", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=512), "float32", True)]
SEQUENCES = dict(full=(64, 512, 16), tiny=(8, 32, 4))

# sinklens train flags and their train.py flags at their config/headnorm.py configuration (and a tiny one)
OURS = dict(full=["--preset", "124m", "--batch-size", "60", "--seq-len", "4096", "--set", "grad_accum=5",
                  "--set", "model.n_ctx=4096", "--set", "model.d_mlp=3072", "--set", "compile=true"],
            tiny=["--preset", "tiny", "--batch-size", "8", "--seq-len", "64", "--set", "grad_accum=2",
                  "--set", "model.n_ctx=64", "--set", "compile=false"])
THEIRS = dict(full=[], tiny=["--compile=False", "--dtype=float32", "--n_layer=2", "--n_head=4", "--n_embd=64",
                             "--intermediate_size=176", "--block_size=64", "--batch_size=4",
                             "--gradient_accumulation_steps=2"])
TOKENS_PER_STEP = dict(full=60 * 4096, tiny=8 * 64)
VOCAB = dict(full=(50257, 50304), tiny=(256, 256))  # random ids below the first, meta.pkl's vocab_size


def row(component: str, metric: str, value: float | str | None, unit: str = "", *, reference: float | None = None,
        ratio: float | None = None, goal: str = "", status: str = "info", note: str = "", **extra: Any) -> dict:
    """One line of the table; ``status`` is pass, fail, info (no goal), skipped or error."""
    return dict(component=component, metric=metric, value=value, unit=unit, reference=reference, ratio=ratio,
                goal=goal, status=status, note=note, **extra)


def judged(value: float | None, goal: float, at_most: bool) -> str:
    if value is None:
        return "skipped"
    return "pass" if (value <= goal if at_most else value >= goal) else "fail"


# ---------------------------------------------------------------- parts (each runs in its own process)
def part_env(args: argparse.Namespace, emit) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    emit(dict(torch=torch.__version__, cuda_build=torch.version.cuda, cuda_available=cuda,
              card=torch.cuda.get_device_name() if cuda else None, transformer_lens=ver("transformer-lens"),
              transformers=ver("transformers"), python=sys.version.split()[0]))


def _timed(fn, cuda: bool, reps: int) -> tuple[float, float | None]:
    """Median seconds of ``reps`` synchronised runs after one warm-up, and the peak GiB allocated (CUDA)."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def part_analysis(args: argparse.Namespace, emit) -> None:
    deadline = time.monotonic() + args.budget - 5
    for name, shape, dtype_name, goal_shape in TINY_SHAPES if args.tiny else SHAPES:
        component = f"{name} {dtype_name}"
        if time.monotonic() > deadline:
            emit(row(component, "all", None, status="skipped", note="time budget spent"))
            continue
        try:
            _analysis_shape(args, emit, component, Path(args.work) / name, shape, dtype_name, goal_shape, deadline)
        except Exception as err:  # reported as a row; the next shape still runs
            emit(row(component, "model", None, status="error", note=f"{type(err).__name__}: {err}"[:300]))
        finally:
            shutil.rmtree(Path(args.work) / name, ignore_errors=True)


def _analysis_shape(args: argparse.Namespace, emit, component: str, folder: Path, shape: dict, dtype_name: str,
                    goal_shape: bool, deadline: float) -> None:
    """The rows of one random-init Llama shape: the eager forward, then the bridge and each analyzer."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sinklens

    device, reps, cuda = args.device, 1 if args.tiny else 3, args.device.startswith("cuda")
    n_seq, seq_len, bs = SEQUENCES["tiny" if args.tiny else "full"]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds for 1.1B parameters
        hf = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True, **shape))
    hf.to(dtype).save_pretrained(folder)  # no tokenizer: load_model runs it on token ids
    del hf
    tokens = torch.randint(0, shape["vocab_size"], (n_seq, seq_len), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0
    n_tokens = n_seq * seq_len
    hfm = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).to(device).eval()
    chunks = [tokens[i:i + bs].to(device) for i in range(0, n_seq, bs)]

    def eager_forward():
        with torch.inference_mode():
            for chunk in chunks:
                hfm(chunk, output_attentions=True)

    ref_s, ref_peak = _timed(eager_forward, cuda, reps)
    emit(row(component, "HF eager forward, output_attentions", ref_s, "s", peak_gib=ref_peak,
             tokens_per_s=n_tokens / ref_s, note=f"{n_seq}x{seq_len} tokens, batch {bs}: the reference"))
    del hfm, chunks
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    model = sinklens.load_model(folder, device=device, dtype=dtype_name)
    batches = sinklens.as_batches(model, tokens, batch_size=bs, prepend_bos=True)
    options = sinklens.RunOptions(progress=False, batch_size=bs)
    noop = [(f"blocks.{layer}.attn.hook_pattern", lambda act, hook: None) for layer in range(model.cfg.n_layers)]

    def bridge_forward():
        with torch.inference_mode(), model.hooks(fwd_hooks=noop):
            for b in batches:
                model(b.tokens, return_type=None)

    runs = [("bridge forward, no-op hook_pattern", bridge_forward)]
    runs += [(fn, lambda fn=fn: getattr(sinklens, fn)(model, batches, options=options)) for fn in ANALYZERS]
    for label, fn in runs:
        if time.monotonic() > deadline:
            emit(row(component, label, None, status="skipped", note="time budget spent"))
            continue
        try:
            s, peak = _timed(fn, cuda, reps)
        except Exception as err:  # reported as a row; the next analyzer still runs
            emit(row(component, label, None, status="error", note=f"{type(err).__name__}: {err}"[:300]))
            continue
        goal = label == "analyze" and goal_shape
        emit(row(component, label, s, "s", reference=ref_s, ratio=s / ref_s, peak_gib=peak,
                 reference_peak_gib=ref_peak, tokens_per_s=n_tokens / s, goal=f"<= {ANALYZE_GOAL}x" if goal else "",
                 status=judged(s / ref_s, ANALYZE_GOAL, at_most=True) if goal else "info"))
    del model, batches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def part_long(args: argparse.Namespace, emit) -> None:
    """Sink statistics at long context: ``find_sinks(method="qk")`` on one sequence against the same model's plain
    forward (SDPA: flash on a GPU in bfloat16); peak memory against the weights' size."""
    import torch

    import sinklens
    from sinklens.sinklm.config import ModelConfig
    from sinklens.sinklm.model import SinkLM

    shape, n, dtype_name, name = LONG["tiny" if args.tiny else "full"]
    component, cuda = f"{name} {dtype_name}, {n} tokens", args.device.startswith("cuda")
    if cuda and (card := torch.cuda.get_device_properties(args.device).total_memory / 2**30) < LONG_MIN_CARD_GIB:
        emit(row(component, "all", None, status="skipped", note=f"{card:.0f} GiB card, needs {LONG_MIN_CARD_GIB:.0f}"))
        return
    torch.manual_seed(0)
    with torch.device(args.device):  # random init on the device
        model = SinkLM(ModelConfig(n_ctx=n, dtype=dtype_name, **shape)).eval()
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    tokens = torch.randint(0, shape["d_vocab"], (1, n), generator=torch.Generator().manual_seed(0)).to(args.device)
    options = sinklens.RunOptions(progress=False, batch_size=1)
    got: list = []

    def forward():
        with torch.inference_mode():
            model(tokens, return_type=None)

    def sinks():
        got[:] = [sinklens.find_sinks(model, tokens, method="qk", options=options)]

    goal = not args.tiny
    ref_s, ref_peak = _timed(forward, cuda, 1)
    emit(row(component, "plain forward, SDPA", ref_s, "s", peak_gib=ref_peak, tokens_per_s=n / ref_s,
             note=f"weights {weights_gib:.3g} GiB: the reference"))
    s, peak = _timed(sinks, cuda, 1)
    emit(row(component, "find_sinks(method='qk')", s, "s", reference=ref_s, ratio=s / ref_s, peak_gib=peak,
             reference_peak_gib=ref_peak, tokens_per_s=n / s, goal=f"<= {LONG_TIME_GOAL}x" if goal else "",
             status=judged(s / ref_s, LONG_TIME_GOAL, at_most=True) if goal else "info",
             note=f"path {got[0].attention_path}"))
    extra = None if peak is None else peak - weights_gib
    emit(row(component, "find_sinks(method='qk') memory above weights", extra, "GiB", reference=weights_gib,
             goal=f"<= {LONG_EXTRA_GIB:.0f} GiB" if goal else "",
             status=judged(extra, LONG_EXTRA_GIB, at_most=True) if goal else "info",
             note="peak torch.cuda.max_memory_allocated minus the weights" if cuda else "no CUDA: no peak memory"))


def _run_logged(cmd: list[str], cwd: Path, log: Path, timeout: float) -> str | None:
    """Run ``cmd`` with output to ``log``; None when it exited 0, else why not (with the log's last line)."""
    if timeout < 20:
        return "not run: time budget spent"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"stopped after {timeout:.0f} s"
    if code == 0:
        return None
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    return f"exit {code}: {tail[0][:200] if tail else 'no output'}"


def part_trainer(args: argparse.Namespace, emit) -> None:
    import numpy as np

    deadline = time.monotonic() + args.budget - 5
    size = "tiny" if args.tiny else "full"
    work, steps = Path(args.work), args.steps or (6 if args.tiny else 10)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    high, vocab = VOCAB[size]
    rng = np.random.default_rng(0)
    n_train = max(steps + 2, 12) * TOKENS_PER_STEP[size] * 2
    for split, n in (("train", n_train), ("val", n_train // 10)):
        rng.integers(0, high, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(__import__("pickle").dumps({"vocab_size": vocab}))
    theirs_dir = None
    if args.authors:
        theirs_dir = work / "theirs"
        (theirs_dir / "data").mkdir(parents=True)
        for src in [*Path(args.authors).glob("*.py"), Path(args.authors) / "config"]:
            os.symlink(src.resolve(), theirs_dir / src.name)
        os.symlink(data, theirs_dir / "data" / "bench")
    ours, theirs = {}, {}
    for variant in ("headwise_rms", "baseline"):
        out = work / f"sinklens_{variant}"
        cmd = [sys.executable, "-m", "sinklens.cli", "train", "--variant", variant, "--data", str(data),
               "--steps", str(steps), "--device", args.device, "--no-progress", "--set", "eval.interval=0",
               *OURS[size], "--out", str(out)]
        failed = _run_logged(cmd, REPO, work / f"sinklens_{variant}.log", min(150, deadline - time.monotonic()))
        lines = [json.loads(x) for x in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
        train = [x for x in lines if x.get("kind") == "train"][3:]
        compiled = next((x for x in lines if x.get("kind") == "compile"), {})
        peak = next((x.get("peak_flops") for x in lines if x.get("kind") == "device"), None)
        if failed or not train:
            ours[variant] = None
            emit(row(f"sinklens train {variant}", "tokens/s", None, status="error", note=failed or "no steps logged"))
        else:
            ours[variant] = dict(tokens_per_s=statistics.median(x["tokens_per_s"] for x in train),
                                 mfu=statistics.median(x["mfu"] for x in train) if train[0].get("mfu") else None,
                                 compile_s=compiled.get("compile_s"), compile_error=compiled.get("error"),
                                 peak_flops=peak)
        if theirs_dir is None:
            continue
        hn = "True" if variant == "headwise_rms" else "False"
        cmd = [sys.executable, "train.py", "config/headnorm.py", f"--enable_headnorm={hn}", f"--max_iters={steps}",
               "--eval_interval=100000", "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False",
               "--dataset=bench", f"--device={args.device}", f"--out_dir={work / f'theirs_{variant}'}", *THEIRS[size]]
        log = work / f"theirs_{variant}.log"
        failed = _run_logged(cmd, theirs_dir, log, min(150, deadline - time.monotonic()))
        ms = [float(m) for m in re.findall(r"iter \d+: loss [\d.naif]+, time ([\d.]+)ms", log.read_text(errors="replace"))][3:]
        theirs[variant] = TOKENS_PER_STEP[size] / (statistics.median(ms) / 1000) if ms and not failed else None
        if theirs[variant] is None:
            emit(row(f"authors' train.py {variant}", "tokens/s", None, status="error", note=failed or "no steps logged"))
    for variant in ("headwise_rms", "baseline"):
        if ours[variant] is None:
            continue
        a, b = ours[variant]["tokens_per_s"], theirs.get(variant)
        emit(row(f"sinklens train {variant}", "tokens/s vs authors' train.py, after 3 steps", a, "tok/s", reference=b,
                 ratio=a / b if b else None, goal=f">= {TRAIN_GOAL}x", note="" if b else "no --authors: no reference",
                 status=judged(a / b, TRAIN_GOAL, at_most=False) if b else "skipped"))
    if ours["headwise_rms"] and ours["baseline"]:
        a, b = ours["headwise_rms"]["tokens_per_s"], ours["baseline"]["tokens_per_s"]
        emit(row("sinklens train HeadNorm cost", "headwise_rms vs baseline tokens/s", a, "tok/s", reference=b,
                 ratio=a / b, goal=f">= {HEADNORM_GOAL}x", status=judged(a / b, HEADNORM_GOAL, at_most=False)))
    for variant in ("headwise_rms", "baseline"):
        run = ours[variant]
        if run is None:
            continue
        emit(row(f"sinklens train {variant}", "MFU (trainer's mfu field)", run["mfu"], goal=f">= {MFU_GOAL}",
                 status=judged(run["mfu"], MFU_GOAL, at_most=False) if not args.tiny else "info",
                 note=f"of a {run['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 peak" if run["peak_flops"] else
                 "" if run["mfu"] is not None else "no peak known for this device", peak_flops=run["peak_flops"]))
        if run["compile_s"] is not None or run["compile_error"]:  # a failed compile trained eagerly
            emit(row(f"sinklens train {variant}", "first compiled step", run["compile_s"], "s",
                     status="error" if run["compile_error"] else "info", note=str(run["compile_error"] or "")[:300]))


# ---------------------------------------------------------------- the orchestrator (standard library only)
def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SINKLENS_COMMIT", "unknown (no git; set SINKLENS_COMMIT)")


def _install_wheels(folder: Path, site: Path, env: dict) -> dict:
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        return row("setup", "wheels", None, status="error", note=f"no *.whl in {folder}")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                           "--disable-pip-version-check", "--target", str(site), *wheels],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        return row("setup", "wheels", None, status="error", note=done.stderr.strip()[-300:])
    return row("setup", "wheels installed", len(wheels), note=f"into {site}")


def _child(part: str, args: argparse.Namespace, env: dict, work: Path, budget: float) -> tuple[list[dict], str | None]:
    """Run one part in its own process; its rows, and why it failed (None when it did not)."""
    rows_file, log = work / f"{part}.jsonl", work / f"{part}.log"
    part_work = work / part
    part_work.mkdir(exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--rows", str(rows_file), "--device",
           args.device, "--budget", str(budget), "--work", str(part_work)]
    cmd += ["--tiny"] * args.tiny + (["--authors", args.authors] if args.authors else [])
    cmd += ["--steps", str(args.steps)] if args.steps else []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=budget + 20)
            why = None if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"stopped after its {budget:.0f} s budget"
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if why:
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:]
        why += f" ({tail[0][:240]})" if tail else ""
    return rows, why


def _lane(args: argparse.Namespace, env: dict, budget: float) -> list[dict]:
    """The GPU test lane; when pyproject's addopts name plugins this Python lacks (pytest-xdist, nbmake: a
    usage error, exit 4), it runs again with ``-o addopts=-ra`` and the row says so."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/devices", "--device", args.device]
    deadline, note = time.monotonic() + budget, ""
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
        if done.returncode == 4 and re.search(r"unrecognized arguments: .*--(dist|nbmake|maxprocesses)", done.stderr):
            note = "without pyproject's addopts (pytest-xdist or nbmake missing)"
            done = subprocess.run([*cmd, "-o", "addopts=-ra"], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        return [row("test lane", f"tests/devices on {args.device}", None, status="error",
                    note=f"stopped after its {budget:.0f} s budget")]
    text = done.stdout + done.stderr
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    summary = [x for x in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", x)][-1:]
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[0] if summary else ""):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] += int(n)
    failed = [x.split(" - ")[0][7:] for x in text.splitlines() if x.startswith(("FAILED ", "ERROR "))]
    value = f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped"
    if done.returncode in (0, 1) and summary:
        status = "pass" if done.returncode == 0 and counts["passed"] else "fail"
        return [row("test lane", f"tests/devices on {args.device}", value, goal="0 failed, 0 errors", status=status,
                    note="; ".join(x for x in [note, *failed[:5]] if x), **counts)]
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    last = ([x for x in lines if re.search("error", x, re.IGNORECASE) and "usage:" not in x] or lines)[-1:]
    return [row("test lane", f"tests/devices on {args.device}", None, status="error",
                note=f"pytest exit {done.returncode}: {last[0][:240] if last else 'no output'}" + (f"; {note}" if note else ""))]


def _fmt(x: Any, unit: str, peak: float | None = None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    text = (f"{x / 1e3:.1f}k tok/s" if unit == "tok/s" else f"{x:.3f} s" if unit == "s" else
            f"{x:.3g}" if isinstance(x, float) else str(x))
    return text + (f", {peak:.1f} GiB" if peak is not None else "")


def table(rows: list[dict]) -> str:
    head = ("component", "metric", "value", "reference", "ratio", "goal", "pass/fail")
    lines = [(r["component"], r["metric"], _fmt(r["value"], r["unit"], r.get("peak_gib")),
              _fmt(r["reference"], r["unit"], r.get("reference_peak_gib")),
              "-" if r["ratio"] is None else f"{r['ratio']:.3f}x", r["goal"] or "-",
              r["status"] + (f": {r['note']}" if r["note"] and r["status"] in ("error", "skipped", "fail") else ""))
             for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*x) for x in [head, tuple("-" * w for w in widths) + ("-" * 9,), *lines])


def _finite(x: Any) -> Any:
    """NaN and infinities as None, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cuda (default), cuda:1 ...; cpu with --tiny")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and trainer, to test the pipeline on a CPU")
    p.add_argument("--wheels", help="install the *.whl of this folder (gpu_check.sh --fetch-wheels fills it)")
    p.add_argument("--site", default="/tmp/sinklens-gpu-site", help="where --wheels installs (default %(default)s)")
    p.add_argument("--authors", help="a checkout of Siquan-Li/Head-wise-RMSNorm (its *.py and config/)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    p.add_argument("--budget", action="append", default=[], metavar="PART=S",
                   help=f"seconds a part (or 'total') may take; defaults {BUDGET_S}")
    p.add_argument("--steps", type=int, help="trainer steps (default 10; tiny 6); tokens/s from step 4 on")
    p.add_argument("--out", help="write the table as JSON here")
    p.add_argument("--logs", help="copy each part's log (and the trainers' logs) into this folder")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.part:  # a child: run one part, appending its rows to --rows as JSON lines
        args.budget = float(args.budget[0])
        with open(args.rows, "a") as rows_file:
            def emit(r: dict) -> None:
                rows_file.write(json.dumps(_finite(r)) + "\n")
                rows_file.flush()
            dict(env=part_env, analysis=part_analysis, long=part_long, trainer=part_trainer)[args.part](args, emit)
        return 0

    started = time.monotonic()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    budgets = dict(BUDGET_S)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            p.error(f"--budget {item!r}: expected PART=SECONDS, e.g. trainer=300")
    unknown = [x for x in parts if x not in PARTS] + [x for x in budgets if x not in BUDGET_S]
    if unknown:
        p.error(f"unknown part(s) {unknown}; the parts are {list(PARTS)} (and 'total' for --budget)")
    if args.authors and not (Path(args.authors, "train.py").is_file() and Path(args.authors, "config", "headnorm.py").is_file()):
        p.error(f"--authors {args.authors!r} has no train.py and config/headnorm.py: pass a checkout of "
                "Siquan-Li/Head-wise-RMSNorm")
    if args.steps is not None and args.steps < 4:
        p.error(f"--steps {args.steps}: at least 4 (tokens/s is the median after the first 3 steps)")
    if args.wheels and not Path(args.wheels).is_dir():
        p.error(f"--wheels {args.wheels!r} is not a folder")
    work = Path(tempfile.mkdtemp(prefix="sinklens-gpu-check-"))
    paths = [str(REPO), *([args.site] if args.wheels else []), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    rows = [_install_wheels(Path(args.wheels), Path(args.site), env)] if args.wheels else []
    info, why = _child("env", args, env, work, 60)
    report: dict[str, Any] = dict(sinklens_commit=_commit(), device=args.device, tiny=args.tiny, parts=parts,
                                  **(info[0] if info else {}))
    try:
        if not info:
            print(f"no torch: python could not import torch ({why})")
            report.update(status="no torch", rows=rows, exit_code=2)
            return 2
        env_info = info[0]
        build = "cpu build" if env_info["cuda_build"] is None else f"CUDA {env_info['cuda_build']} build"
        if args.device.startswith("cuda") and not env_info["cuda_available"]:
            print(f"no GPU: CUDA is not available (torch {env_info['torch'].split('+')[0]}, {build})")
            report.update(status="no GPU", rows=rows, exit_code=0)
            return 0
        report["card"] = env_info["card"] or "cpu"
        print(f"sinklens {report['sinklens_commit']} on {report['card']}: torch {env_info['torch']} ({build}), "
              f"transformer-lens {env_info['transformer_lens']}, transformers {env_info['transformers']}", flush=True)
        for part in parts:
            budget = min(budgets[part], budgets["total"] - (time.monotonic() - started))
            if budget < 10:
                rows.append(row(part, "all", None, status="skipped", note="total time budget spent"))
                continue
            print(f"{part}: up to {budget:.0f} s ...", flush=True)
            t0 = time.monotonic()
            if part == "lane":
                rows += _lane(args, env, budget)
            else:
                got, why = _child(part, args, env, work, budget)
                rows += got + ([row(part, "part", None, status="error", note=why)] if why else [])
            report.setdefault("part_seconds", {})[part] = round(time.monotonic() - t0, 1)
        report.update(status="done", rows=rows)
        print(table(rows))
        report["exit_code"] = 1 if any(r["status"] in ("fail", "error") for r in rows) else 0
        return report["exit_code"]
    finally:
        report["wall_s"] = round(time.monotonic() - started, 1)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in work.rglob("*.log"):
                shutil.copy(log, Path(args.logs) / log.name)
        if args.out:
            Path(args.out).write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
