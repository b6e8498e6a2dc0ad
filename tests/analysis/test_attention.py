import pytest
import torch

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.inputs import as_batches
from sinklens.streaming import stream
from sinklens.testing import QUIET

pytestmark = pytest.mark.models


def test_streamed_attention_received_equals_full_cache(tiny):
    prompts = ["t3 t4 t5 t6 t7 t8", "t9 t10", "t11 t12 t13 t14", "t2 t2 t2 t2 t2 t2 t2 t2 t2"]
    batches = as_batches(tiny, prompts, batch_size=3)
    (got,) = stream(tiny, batches, [AttentionReceivedReducer(tiny, min_query=1)], options=QUIET)

    # Reference: one sequence at a time, full cache, plain loops.
    sums = torch.zeros(got.received.shape[0], got.received.shape[1], 10, dtype=torch.float64)
    counts = torch.zeros(10, dtype=torch.float64)
    for prompt in prompts:
        toks = tiny.to_tokens(prompt)
        _, cache = tiny.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
        n = toks.shape[1]
        for layer in range(tiny.cfg.n_layers):
            pat = cache[f"blocks.{layer}.attn.hook_pattern"][0].double()
            for k in range(n):
                for q in range(max(k, 1), n):
                    sums[layer, :, k] += pat[:, q, k]
        for k in range(n):
            counts[k] += len(range(max(k, 1), n))
    ref = (sums / counts).float()
    assert got.received.shape == ref.shape
    torch.testing.assert_close(got.received, ref, equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.n_queries, counts.float())
