"""Benchmark: prefix-tuning, Prefix-Tuning+ and LoRA on the embedded SmolLM2, and the Layer Card's placement.

Three parts, one process, CPU float32, the offline text task (standard-library docstrings):

1. shares: untrained prefixes of growing length (the usual MLP reparametrisation) and a Prefix-Tuning+
   memory (``init_std`` 0.02), measured on inputs of growing length (``measure_prefix_sinks``);
2. training: prefix (P = 8), prefix-plus and LoRA (rank 8) with the same steps and batches; final eval
   losses, then the trained prefix's shares;
3. Layer Card on every layer (coupling included), and LoRA on its top-k layers by resnorm against LoRA on
   all layers with the same steps (``placement_check``).

Usage::

    python benchmarks/bench_peft.py --parts shares,train     # RESULTS.md: shares and the three methods
    python benchmarks/bench_peft.py --parts card --seq-len 32 --steps 10   # RESULTS.md: the Layer Card
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--parts", default="shares,train,card", help="comma-separated: shares, train, card")
    parser.add_argument("--out", default=None, help="write everything as strict JSON")
    args = parser.parse_args()

    import sinklens
    from sinklens.export import write_json
    from sinklens.peft import PrefixTuning, PrefixTuningPlus, make_adapter
    from sinklens.peft.layer_card import layer_card, placement_check
    from sinklens.peft.sinks import measure_prefix_sinks
    from sinklens.peft.train import text_task, train_adapter

    torch.manual_seed(0)
    start = time.perf_counter()
    model = sinklens.load_model()
    task = text_task(model, n_rows=96, seq_len=args.seq_len, n_eval=16)
    lengths = sorted({n for n in (4, 8, 16, 32, 64, 128) if n < args.seq_len} | {args.seq_len})
    rows = task.eval[:4]
    out = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "args": vars(args)}

    parts = set(args.parts.split(","))
    adapters = [PrefixTuning(model, p, seed=1) for p in (1, 4, 16, 64)] + [PrefixTuningPlus(model, init_std=0.02, seed=1)]
    if "shares" in parts:
        shares = measure_prefix_sinks(model, adapters, rows, input_lengths=lengths)
        print(shares.summary(), flush=True)
        out["shares_untrained"] = shares.to_dict()

    runs = {}
    methods = [("prefix", {"n_prefix": 8}, 1e-4), ("prefix-plus", {}, 1e-4), ("lora", {"rank": 8}, 1e-3)]
    for method, kwargs, lr in methods if "train" in parts else []:
        adapter = make_adapter(model, method, **kwargs)
        runs[method] = train_adapter(model, adapter, task, steps=args.steps, lr=lr, batch_size=args.batch_size)
        print(runs[method].summary(), flush=True)
        if method == "prefix":
            trained = measure_prefix_sinks(model, [adapter], rows, input_lengths=lengths)
            print(trained.summary(), flush=True)
            out["shares_trained_prefix"] = trained.to_dict()
    out["training"] = {m: r.to_dict() for m, r in runs.items()}

    if "card" in parts:
        t = time.perf_counter()
        card = layer_card(model, task, n_rows=4, rank=8)
        out["card_seconds"] = time.perf_counter() - t
        placement_check(model, task, card, k=args.top_k, steps=args.steps, lr=1e-3, batch_size=args.batch_size)
        print(card.summary(), flush=True)
        out["layer_card"] = card.to_dict()
    out["seconds"] = time.perf_counter() - start
    print(f"total {out['seconds']:.0f} s")
    if args.out:
        write_json(args.out, out)
    else:
        print(json.dumps({k: out[k] for k in ("machine", "torch", "args", "seconds")}))


if __name__ == "__main__":
    main()
