"""Benchmark: time and peak memory of ``sinklens.fingerprint`` on the embedded SmolLM2-135M.

The issue's size is 2000 random sequences x 256 tokens (both models: 2 x 512,000 tokens through a
135M-parameter model). On a shared 2-core CPU that takes hours, so by default this measures smaller
``N`` in fresh subprocesses (model A = SmolLM2-135M-Instruct, model B = the same architecture at
init, seed 0), fits time = a + b·N and extrapolates to N = 2000; it also times the statistical test
alone (bottom-k, softmax, Kendall τ over k ≤ 400 dimensions) at the full N on synthetic features.

Memory: ``ru_maxrss`` after loading both models and after the fingerprint; the difference is what
the fingerprint adds (hidden states are reduced to the last position inside the hook, so it grows
only by the ``N x d_model`` feature matrices).

Usage::

    python benchmarks/bench_fingerprint.py                       # N = 16, 32; L = 256; batch 8
    python benchmarks/bench_fingerprint.py --samples 2000        # the full size (GPU or patience)
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from importlib.metadata import version


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def child(n: int, seq_len: int, batch_size: int, threads: int) -> dict:
    import torch

    import sinklens
    from sinklens.options import RunOptions

    torch.set_num_threads(threads)
    a = sinklens.load_model("smollm2-135m", device="cpu", check_patterns=False)
    b = sinklens.load_model("smollm2-135m@init:0", device="cpu", check_patterns=False)
    loaded = _rss_mib()
    start = time.perf_counter()
    result = sinklens.fingerprint(a, b, n_samples=n, seq_len=seq_len, options=RunOptions(batch_size=batch_size, progress=False))
    seconds = time.perf_counter() - start
    return {"n": n, "seq_len": seq_len, "seconds": seconds, "rss_after_load_mib": loaded, "rss_peak_mib": _rss_mib(),
            "p_value": result.p_value, "n_dims": result.n_dims}


def statistic_only(n: int, d: int = 576) -> float:
    import torch

    from sinklens.origins.fingerprint import seedprint_test

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    start = time.perf_counter()
    seedprint_test(a, b)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", type=int, default=2000, help="N to extrapolate to")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.seq_len, args.batch_size, args.threads)))
        return
    import torch
    import transformers

    print(f"python {platform.python_version()}, torch {torch.__version__}, transformer-lens {version('transformer-lens')}, "
          f"transformers {transformers.__version__}, {platform.machine()}, threads {args.threads}")
    rows = []
    for n in args.samples:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--seq-len", str(args.seq_len),
                              "--batch-size", str(args.batch_size), "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"N={n:>5} x L={args.seq_len}: {row['seconds']:.1f} s, peak RSS {row['rss_peak_mib']:.0f} MiB "
              f"(after loading both models {row['rss_after_load_mib']:.0f} MiB), p = {row['p_value']:.3g}, k = {row['n_dims']}")
    if len(rows) >= 2:
        (n0, t0), (n1, t1) = (rows[0]["n"], rows[0]["seconds"]), (rows[-1]["n"], rows[-1]["seconds"])
        slope = (t1 - t0) / (n1 - n0)
        fixed = t0 - slope * n0
        est = fixed + slope * args.target
        print(f"linear fit: {fixed:.1f} s + {slope:.2f} s/sequence -> N={args.target}: about {est / 60:.0f} min "
              f"({est / 3600:.1f} h) on this machine (extrapolated, not measured)")
    print(f"statistical test alone at N={args.target}, d=576 (k <= 400): {statistic_only(args.target):.2f} s")


if __name__ == "__main__":
    main()
