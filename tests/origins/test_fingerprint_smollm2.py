"""SeedPrint on the embedded SmolLM2: a copy fine-tuned for a few CPU steps keeps its lineage (slow)."""

from __future__ import annotations

import pytest
import torch

from sinklens.options import RunOptions
from sinklens.origins.fingerprint import final_hidden_states, seedprint_test

pytestmark = [pytest.mark.slow, pytest.mark.models]


def test_finetuned_smollm2_keeps_its_lineage():
    from sinklens import builtin_prompts, load_model

    original = load_model("smollm2-135m", device="cpu", check_patterns=False)
    opts = RunOptions(batch_size=25, progress=False)
    feats = dict(n_samples=100, seq_len=16, vocab_limit=32000, options=opts)
    h_orig = final_hidden_states(original, **feats)

    tuned = load_model("smollm2-135m", device="cpu", check_patterns=False)  # a separate copy
    tokens = tuned.to_tokens(builtin_prompts()[:4], padding_side="right")[:, :32]
    opt = torch.optim.AdamW(tuned.parameters(), lr=1e-4)
    tuned.train()
    for _ in range(3):
        loss = tuned(tokens, return_type="loss")
        loss.backward()
        opt.step()
        opt.zero_grad()
    tuned.eval()
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(tuned.parameters(), original.parameters()))
    assert moved > 1e-5  # the weights did change
    h_tuned = final_hidden_states(tuned, **feats)
    same = seedprint_test(h_orig, h_tuned)
    assert same.same_lineage and same.p_value < 0.01
    del tuned
    fresh = load_model("smollm2-135m@init:0", device="cpu", check_patterns=False)
    other = seedprint_test(h_orig, final_hidden_states(fresh, **feats))
    assert not other.same_lineage
