"""Benchmark: sink statistics from queries and keys (``find_sinks(method="qk")``) against the pattern path and a
plain forward, on the embedded SmolLM2 (CPU), one random-token sequence per length. ``--model sinklm`` runs a
randomly initialised sinklens Llama (SinkLM) of SmolLM2's shape instead, whose own attention is SDPA (the
bridge's is eager), so the forward it is compared with keeps its fused kernel.

Each (mode, length) runs in a fresh process that loads the model, runs a 16-token warm-up of the same mode, notes
its resident memory, then runs the mode once on ``T`` tokens: ``time_s`` is that run (``cpu_s`` its CPU time over
all threads, steadier than wall time on a shared machine), ``peak_mib`` the process's
peak resident memory (``ru_maxrss``) and ``extra_mib`` the peak above the memory before the run (model, warm-up and
interpreter excluded; 0 when loading peaked higher). Modes: ``forward`` (the model alone, ``return_type=None``),
``pattern`` and ``qk`` (``find_sinks`` with that method). For ``qk`` it also prints how many sink positions were
found and how many of them lie in the last 10% of the keys.

Usage::

    python benchmarks/bench_qk_memory.py                    # 512 1024 2048 4096
    python benchmarks/bench_qk_memory.py --lengths 512 1024 --modes qk forward
    python benchmarks/bench_qk_memory.py --model sinklm --lengths 512 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import torch

CHILD = """
import json, resource, time, torch
from sinklens import RunOptions, load_model
from sinklens.analysis.sinks import find_sinks
mode, n = {mode!r}, {n}
if {model!r} == "sinklm":
    from sinklens.sinklm.config import ModelConfig
    from sinklens.sinklm.model import SinkLM
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(n_ctx=max(n, 16), n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_mlp=1536,
                               d_vocab=49152)).eval()
else:
    model = load_model(device="cpu")
def run(T):
    tokens = torch.randint(0, model.cfg.d_vocab, (1, T), generator=torch.Generator().manual_seed(T))
    if getattr(model, "tokenizer", None) is not None:
        tokens[:, 0] = model.tokenizer.bos_token_id
    if mode == "forward":
        with torch.inference_mode():
            model(tokens, return_type=None)
        return None
    return find_sinks(model, tokens, method=mode, options=RunOptions(progress=False, batch_size=1))
run(16)
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
start, cpu = time.perf_counter(), time.process_time()
result = run(n)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = dict(mode=mode, T=n, time_s=round(seconds, 2), cpu_s=round(cpu, 2), peak_mib=round(peak), extra_mib=round(max(0.0, peak - before)))
if result is not None:
    sinks = result.sink_positions
    out.update(path=result.attention_path, n_sink_positions=len(sinks), in_last_10pct=sum(k >= 0.9 * n for k in sinks))
print(json.dumps(out))
"""


def measure(mode: str, n: int, model: str = "smollm2") -> dict:
    code = CHILD.format(mode=mode, n=n, model=model)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        return {"mode": mode, "T": n, "error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--modes", nargs="+", default=["forward", "qk", "pattern"], choices=["forward", "qk", "pattern"])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "sinklm"],
                        help="the embedded SmolLM2 (bridge, eager attention) or a SinkLM of its shape (SDPA)")
    args = parser.parse_args()
    print(json.dumps({"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                      "threads": torch.get_num_threads()}))
    for n in args.lengths:
        for mode in args.modes:
            print(json.dumps(measure(mode, n, args.model)), flush=True)


if __name__ == "__main__":
    main()
