"""Trainer benchmarks: throughput against a minimal reference loop, GPU MFU, and convergence.

Modes::

    python benchmarks/bench_train.py throughput [--steps 20]        # CPU, one process, side by side
    python benchmarks/bench_train.py throughput --gpu [--compile]   # 124M Llama-style, seq 1024, bf16
    python benchmarks/bench_train.py convergence [--steps 300 --seeds 0 1 2]
    python benchmarks/bench_train.py headnorm --theirs PATH [--repeats 3 --steps 12 --compile --cold-cache --bf16 --prime]

``throughput`` times the sinklens trainer's step (``forward_backward`` + clip + AdamW, the code
:func:`sinklens.train.loop.train` runs) against a minimal PyTorch Llama-style loop written here
(same shapes, same batch, same optimizer), interleaved in one process so machine noise hits both;
it reports tokens/s and the ratio, for ``baseline`` and ``headwise_rms``. Warm-up steps are not timed.
``--gpu`` uses the ``124m`` preset at sequence 1024 in bf16 autocast on random tokens (vocabulary 50304,
too large for the synthetic tasks) and also reports MFU; ``--compile``
runs both models through ``torch.compile`` (as ``compile=auto`` does on CUDA); ``--bf16``
(CPU) runs both under bfloat16 autocast (``TrainConfig.cpu_autocast``).
``convergence`` trains baseline and headwise_rms on the same offline text (the Python standard
library's ``*.py`` sources, byte tokenizer) for several seeds and reports the steps each needs to
reach the baseline's final loss; the figure goes to ``assets/train_convergence.png``.
``headnorm`` runs the head-wise RMSNorm authors' own trainer (``train.py`` of a checkout of
Siquan-Li/Head-wise-RMSNorm at ``--theirs``, run from a temporary folder, never copied here) and
``sinklens train`` alternately as separate processes at their CPU configuration (4 layers, 4 heads,
d_model 256, SwiGLU 1024, sequence 256, batch 16, vocabulary 512, fp32, HeadNorm on, no eval),
both on the same random nanoGPT-style ``train.bin``; it reports each run's median tokens/s over
the steps after ``--warmup`` (after the first compiled step for a run that compiled), the medians
over repeats, their ratios and the medians of the paired ratios, the load average at each repeat,
and the compile seconds of ``--compile`` (``compile=true``); ``--cold-cache`` gives the first repeat
a fresh inductor cache; ``--prime``
runs every trainer once, untimed, before the repeats; ``--bf16``
adds ``sinklens train`` with ``cpu_autocast=bfloat16`` (mixed precision, which their ``train.py``
does not offer on a CPU: its CPU context is a ``nullcontext``), and with ``--compile`` a compiled
bfloat16 run too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sinklens.sinklm.config import TrainConfig
from sinklens.train.data import build_source
from sinklens.distributed.ddp import DistContext
from sinklens.train.loop import forward_backward, micro_batch
from sinklens.train.optim import configure_optimizer
from sinklens.train.speed import estimate_mfu, peak_flops
from sinklens.sinklm.model import SinkLM


# ---------------------------------------------------------------- reference minimal Llama-style model
class RefBlock(nn.Module):
    def __init__(self, d: int, h: int, d_mlp: int, n_ctx: int):
        super().__init__()
        self.h = h
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.gate, self.down = (nn.Linear(d, d_mlp, bias=False), nn.Linear(d, d_mlp, bias=False),
                                         nn.Linear(d_mlp, d, bias=False))
        hs = d // h
        inv = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
        ang = torch.outer(torch.arange(n_ctx).float(), inv)
        self.register_buffer("cos", torch.cat([ang.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([ang.sin()] * 2, -1), persistent=False)

    def rope(self, x):  # (B, nh, T, hs)
        T = x.shape[2]
        x1, x2 = x.chunk(2, -1)
        return x * self.cos[:T] + torch.cat([-x2, x1], -1) * self.sin[:T]

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RefLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList([RefBlock(cfg.d_model, cfg.n_heads, cfg.d_mlp, cfg.n_ctx) for _ in range(cfg.n_layers)])
        self.norm = nn.RMSNorm(cfg.d_model)

    def forward(self, idx, targets):  # the loss inside the forward, as nanoGPT (and sinklens' trainer) compute it
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.norm(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- throughput
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def throughput(args) -> dict:
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu and not torch.cuda.is_available():
        print("not run: no GPU (torch.cuda.is_available() is False)")
        return {"gpu": "not run: no GPU"}
    if args.gpu:
        model_cfg = {"n_layers": 12, "d_model": 768, "n_heads": 12, "n_ctx": 1024, "d_vocab": 50304}
        seq, batch = 1024, args.batch or 8
    else:
        model_cfg = {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_ctx": 128, "d_vocab": 256}
        seq, batch = 128, args.batch or 8
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if args.gpu
           else torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16))
    results = {}
    vocab = model_cfg["d_vocab"]
    for variant in ("baseline", "headwise_rms"):
        cfg = TrainConfig.from_dict({"model": {**model_cfg, "variant": variant}, "data": {"seq_len": seq, "vocab_size": min(vocab, 256)},
                                     "batch_size": batch, "steps": args.steps, "device": str(device)})
        torch.manual_seed(0)
        ours = SinkLM(cfg.model).to(device)
        opt_ours = configure_optimizer(ours, cfg.optim, device)
        ref = RefLM(cfg.model).to(device)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=device.type == "cuda")
        source = None if args.gpu else build_source(cfg.data)

        def batch_rows(s):  # (batch, seq + 1): the synthetic task on a CPU, random tokens at the 124M vocabulary on a GPU
            if source is not None:
                return source.batch("train", s, batch).to(device)
            gen = torch.Generator().manual_seed(s)
            return torch.randint(0, vocab, (batch, seq + 1), generator=gen).pin_memory().to(device, non_blocking=True)
        # --compile: both models through torch.compile (what compile=auto does on CUDA); the
        # compilation happens in the warm-up steps, which are not timed
        run_ours, run_ref = (torch.compile(ours), torch.compile(ref)) if args.compile else (ours, ref)

        def step_ours(s):
            rows = batch_rows(s)
            forward_backward(run_ours, micro_batch(rows, 0, cfg, DistContext()), autocast=amp, hook_owner=ours)
            torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
            opt_ours.step()
            opt_ours.zero_grad(set_to_none=True)

        def step_ref(s):
            rows = batch_rows(s)
            with amp:
                loss = run_ref(rows[:, :-1], rows[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)

        times = {"sinklens": [], "reference": []}
        for s in range(args.warmup + args.steps):
            for name, fn in (("sinklens", step_ours), ("reference", step_ref)):  # interleaved
                _sync(device)
                t0 = time.perf_counter()
                fn(s)
                _sync(device)
                if s >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        tokens = batch * seq
        row = {name: tokens / statistics.median(t) for name, t in times.items()}
        row["ratio"] = row["sinklens"] / row["reference"]
        if device.type == "cuda":
            row["mfu"] = estimate_mfu(ours.flops_per_token(seq), row["sinklens"], device)
            row["peak"] = f"{torch.cuda.get_device_name()} dense bf16 {peak_flops(torch.cuda.get_device_name()) or 0:.3g} FLOP/s"
        results[variant] = row
        print(f"{variant}: sinklens {row['sinklens']:.0f} tok/s, reference {row['reference']:.0f} tok/s, "
              f"ratio {row['ratio']:.2f}" + (f", MFU {row['mfu']:.3f} of the {row['peak']}" if row.get("mfu") else ""))
    return results


# ---------------------------------------------------------------- convergence
def convergence(args) -> dict:
    from sinklens.plotting.training import plot_training, smooth, steps_to_loss
    from sinklens.train.loop import train

    stdlib = sysconfig.get_paths()["stdlib"]
    runs, summary = {}, {}
    for seed in args.seeds:
        for variant in ("baseline", "headwise_rms"):
            cfg = TrainConfig.from_dict({
                "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_ctx": 64, "d_vocab": 257, "variant": variant},
                "data": {"source": "text", "path": stdlib, "glob": "*.py", "seq_len": 64, "max_tokens": 1_000_000},
                "optim": {"lr": 3e-3, "warmup_steps": 20}, "eval": {"interval": 0},
                "steps": args.steps, "batch_size": 16, "seed": seed, "device": "cpu",
            })
            runs[f"{variant} seed {seed}"] = train(cfg, progress=False).history
    for seed in args.seeds:
        base = runs[f"baseline seed {seed}"]
        target = smooth([x["loss"] for x in base if x["kind"] == "train"], 20)[-1]
        for variant in ("baseline", "headwise_rms"):
            summary.setdefault(variant, []).append(steps_to_loss(runs[f"{variant} seed {seed}"], target, smoothing=20))
        summary.setdefault("baseline_final_loss", []).append(target)
    plot_training(runs, panels=("loss",), smoothing=20, path="assets/train_convergence.png")
    print(json.dumps(summary))
    return summary


# ---------------------------------------------------------------- against the authors' trainer
def _their_run(theirs: Path, data: Path, steps: int, their_compile: bool) -> list[float]:
    """Their train.py from a temporary folder holding links to their files; tokens/s of every step."""
    import os
    import re
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="headnorm-theirs-") as tmp:
        for name in ("train.py", "model.py", "configurator.py"):
            os.symlink(theirs / name, Path(tmp) / name)
        (Path(tmp) / "data").mkdir()
        os.symlink(data, Path(tmp) / "data" / "bench")
        cmd = [sys.executable, "train.py", "--dataset=bench", "--device=cpu", f"--compile={their_compile}", "--dtype=float32",
               "--n_layer=4", "--n_head=4", "--n_embd=256", "--intermediate_size=1024", "--block_size=256",
               "--batch_size=16", "--gradient_accumulation_steps=1", f"--max_iters={steps - 1}", "--eval_interval=1000000",
               "--eval_iters=1", "--log_interval=1", "--enable_headnorm=True", "--headnorm_shared_weights=False",
               f"--out_dir={tmp}/out"]
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=True)
    ms = [float(m) for m in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", done.stdout)]
    return [16 * 256 / (t / 1000) for t in ms]


def _our_run(data: Path, steps: int, compile_: str, *, cache_dir: str | None = None,
             cpu_autocast: str = "none") -> tuple[list[float], list[bool], dict[str, Any] | None]:
    """``sinklens train`` at the same configuration: tokens/s and ``compiled`` of every step (from
    metrics.jsonl), and the ``kind="compile"`` line if any.

    ``cache_dir``: inductor's on-disk cache (a fresh folder measures a cold compile).
    ``cpu_autocast``: ``TrainConfig.cpu_autocast`` (``"bfloat16"``: mixed precision, not their float32 arithmetic).
    """
    import os
    import subprocess
    import sys
    import tempfile

    env = dict(os.environ, **({"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {}))
    with tempfile.TemporaryDirectory(prefix="headnorm-ours-") as tmp:
        cmd = [sys.executable, "-m", "sinklens.cli", "train", "--preset", "headnorm-cpu", "--data", str(data),
               "--seq-len", "256", "--batch-size", "16", "--steps", str(steps), "--device", "cpu",
               "--no-progress", "--set", "eval.interval=0", "--set", f"compile={compile_}",
               "--set", f"cpu_autocast={cpu_autocast}", "--out", f"{tmp}/run"]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        got = [json.loads(x) for x in Path(tmp, "run", "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_lines = [x for x in got if x["kind"] == "train"]
    compile_line = next((x for x in got if x["kind"] == "compile"), None)
    return [x["tokens_per_s"] for x in train_lines], [bool(x.get("compiled")) for x in train_lines], compile_line


def _steady(tokens_per_s: list[float], compiled: list[bool], warmup: int) -> float:
    """Median tokens/s of the steady steps: after ``warmup`` steps, or for a run that compiled,
    after its first compiled step (which holds the compilation)."""
    if any(compiled):
        first = compiled.index(True)
        return statistics.median(tokens_per_s[first + 1:])
    return statistics.median(tokens_per_s[warmup:])


def headnorm(args) -> dict:
    import os
    import shutil
    import tempfile

    import numpy as np

    theirs = Path(args.theirs).expanduser().resolve()
    if not (theirs / "train.py").is_file():
        raise SystemExit(f"--theirs {theirs} has no train.py (a checkout of Siquan-Li/Head-wise-RMSNorm)")
    data = Path(tempfile.mkdtemp(prefix="headnorm-data-"))
    rng = np.random.default_rng(0)
    rng.integers(0, 512, size=2_000_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 512, size=200_000, dtype=np.uint16).tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(__import__("pickle").dumps({"vocab_size": 512}))
    ours = {"sinklens_eager": "false"}
    if args.bf16:
        ours["sinklens_eager_bf16"] = "false"
    if args.bf16 and args.compile:
        ours["sinklens_compiled_bf16"] = "true"
    if args.compile:
        ours["sinklens_compiled"] = "true"
    runs: dict[str, list[float]] = {name: [] for name in ["theirs", *ours]}
    compile_s: dict[str, list[float | None]] = {name: [] for name, mode in ours.items() if mode != "false"}
    load: list[float] = []
    scratch = [data]  # removed at the end, with any cold inductor cache
    try:
        if args.prime:  # one untimed run of each trainer first: the first process of an invocation can run slow
            _their_run(theirs, data, args.steps, args.their_compile)
            for mode in dict.fromkeys(ours.values()):
                _our_run(data, args.steps, mode)
        for repeat in range(args.repeats):  # alternate, so machine noise hits every trainer alike
            load.append(os.getloadavg()[0])
            runs["theirs"].append(statistics.median(_their_run(theirs, data, args.steps, args.their_compile)[args.warmup:]))
            for name, mode in ours.items():
                cold = args.cold_cache and repeat == 0 and mode != "false"
                cache = tempfile.mkdtemp(prefix="inductor-cold-") if cold else None
                scratch += [Path(cache)] if cache else []
                tps, compiled, line = _our_run(data, args.steps, mode, cache_dir=cache,
                                               cpu_autocast="bfloat16" if name.endswith("_bf16") else "none")
                runs[name].append(_steady(tps, compiled, args.warmup))
                if name in compile_s:
                    compile_s[name].append(line["compile_s"] if line else None)
            print(f"repeat {repeat} (load {load[-1]:.1f}): " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in runs.items())
                  + f" (compile s: {', '.join(f'{k} {v[-1]}' for k, v in compile_s.items())})", flush=True)
    finally:
        for folder in scratch:
            shutil.rmtree(folder, ignore_errors=True)
    row: dict[str, Any] = {name: statistics.median(v) for name, v in runs.items()}
    for name in ours:
        row[f"ratio_{name}"] = row[name] / row["theirs"]
        row[f"paired_ratio_{name}"] = statistics.median(o / t for o, t in zip(runs[name], runs["theirs"]))
    row["per_repeat"] = runs
    row["compile_s"] = compile_s
    row["load_average"] = load
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "convergence", "headnorm"])
    parser.add_argument("--theirs", help="headnorm: a checkout of Siquan-Li/Head-wise-RMSNorm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="headnorm: also sinklens train with compile=true; "
                        "throughput: torch.compile both models (compiled in the untimed warm-up steps)")
    parser.add_argument("--cold-cache", action="store_true", help="headnorm: repeat 0 compiles with a fresh inductor cache")
    parser.add_argument("--bf16", action="store_true", help="headnorm: also sinklens eager with cpu_autocast=bfloat16; "
                        "throughput (CPU): both models under CPU bfloat16 autocast")
    parser.add_argument("--their-compile", action="store_true", help="headnorm: their train.py with --compile=True")
    parser.add_argument("--prime", action="store_true", help="headnorm: one untimed run of every trainer before the "
                        "repeats (on an Intel Xeon the first run of an invocation, always theirs, was 7-15%% slower)")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.processor() or platform.machine()}, "
          f"threads {torch.get_num_threads()}" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    if args.mode == "throughput":
        args.steps = args.steps or 10
        throughput(args)
    elif args.mode == "headnorm":
        args.steps = args.steps or 12
        headnorm(args)
    else:
        args.steps = args.steps or 300
        convergence(args)


if __name__ == "__main__":
    main()
