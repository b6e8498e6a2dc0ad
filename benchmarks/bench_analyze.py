"""Benchmark: ``sinklens.analyze`` against a plain forward pass with attention patterns exposed.

Time: in one process, on the same batches, alternating reference and ``analyze`` runs
(reference, analyze, reference, analyze, ...) after one warm-up of each; reports the ratio of
medians. The reference is the embedded model's forward (``return_type=None``, eager attention)
with a no-op hook on every ``hook_pattern`` — what any analysis that reads attention must pay.

Memory: peak resident memory (``ru_maxrss``) of fresh subprocesses that load the model and run
either the reference or ``analyze`` over N prompts, for two values of N; "flat in the number of
prompts" means the peak for the larger N is no bigger than for the smaller one (plus noise).

Usage::

    python benchmarks/bench_analyze.py                      # 64 prompts x 128 tokens, batch 8
    python benchmarks/bench_analyze.py --prompts 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch


def _batches(model, n_prompts: int, seq_len: int, batch_size: int):
    """``n_prompts`` windows of exactly ``seq_len`` tokens (BOS + natural text from stdlib docstrings)."""
    from sinklens.inputs import as_batches
    from sinklens.prompts import stdlib_text_prompts

    text = " ".join(stdlib_text_prompts(None, n_chars=4000))  # all of them
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"][: n_prompts * (seq_len - 1)]
    if len(ids) < n_prompts * (seq_len - 1):
        raise ValueError(f"Not enough stdlib text for {n_prompts} x {seq_len} tokens.")
    body = torch.tensor(ids).view(n_prompts, seq_len - 1)
    bos = torch.full((n_prompts, 1), model.tokenizer.bos_token_id)
    batches = as_batches(model, torch.cat([bos, body], dim=1), batch_size=batch_size, prepend_bos=True)
    return batches, n_prompts * seq_len


def _reference(model, batches) -> None:
    n_layers = model.cfg.n_layers
    hooks = [(f"blocks.{layer}.attn.hook_pattern", lambda act, hook: None) for layer in range(n_layers)]
    with torch.inference_mode(), model.hooks(fwd_hooks=hooks):
        for batch in batches:
            model(batch.tokens, return_type=None)


def _analyze(model, batches) -> None:
    from sinklens import RunOptions, analyze

    analyze(model, batches, options=RunOptions(progress=False))


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def peak_rss_mib(mode: str, n_prompts: int, seq_len: int, batch_size: int) -> float:
    """Peak RSS (MiB) of a fresh process that loads the model and runs ``mode`` once."""
    code = (
        "import resource, sys; sys.path.insert(0, 'benchmarks'); import bench_analyze as b; "
        "from sinklens import load_model; m = load_model(device='cpu'); "
        f"bs, _ = b._batches(m, {n_prompts}, {seq_len}, {batch_size}); "
        f"(b._reference if '{mode}' == 'reference' else b._analyze)(m, bs); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-prompts", type=int, nargs=2, default=[16, 64], metavar=("N_SMALL", "N_LARGE"))
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    from sinklens import load_model

    model = load_model(device="cpu")
    batches, n_tokens = _batches(model, args.prompts, args.seq_len, args.batch_size)
    print(f"{len(batches)} batches, {n_tokens} tokens; torch threads {torch.get_num_threads()}", file=sys.stderr)
    _reference(model, batches[:1])
    _analyze(model, batches[:1])
    ref, ana = [], []
    for _ in range(args.repeats):
        ref.append(_timed(_reference, model, batches))
        ana.append(_timed(_analyze, model, batches))
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "torch": torch.__version__,
        "prompts": args.prompts, "seq_len": args.seq_len, "batch_size": args.batch_size, "tokens": n_tokens,
        "reference_s": [round(x, 2) for x in ref],
        "analyze_s": [round(x, 2) for x in ana],
        "time_ratio": round(statistics.median(ana) / statistics.median(ref), 3),
    }
    if not args.skip_memory:
        small, large = args.memory_prompts
        for mode in ("reference", "analyze"):
            for n in (small, large):
                result[f"peak_rss_mib_{mode}_{n}"] = round(peak_rss_mib(mode, n, args.seq_len, args.batch_size), 1)
        result["analyze_peak_growth"] = round(
            result[f"peak_rss_mib_analyze_{large}"] / result[f"peak_rss_mib_analyze_{small}"], 3)
    result["this_process_peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
