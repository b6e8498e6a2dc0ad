"""Independent references for the visibility tests: plain Hugging Face attentions, one sequence at a time.

Nothing here imports sinklens' visibility, attention or sink code: which query sees which key is written
out from the Hugging Face config by hand, so a wrong :mod:`sinklens.visibility` cannot agree with it.
"""

from __future__ import annotations

import torch


def real_sequences(batches) -> list[torch.Tensor]:
    """The real token ids of every sequence (padding dropped), in order."""
    return [b.tokens[i, b.valid[i]].cpu() for b in batches for i in range(b.tokens.shape[0])]


def hf_attentions(hf, ids: torch.Tensor) -> list[torch.Tensor]:
    """``[head, query, key]`` attention probabilities of one unpadded sequence, per layer (float64)."""
    with torch.no_grad():
        out = hf(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), output_attentions=True)
    return [a[0].double() for a in out.attentions]


def visible_by_hand(config, layer: int, n: int, *, encoder: bool) -> torch.Tensor:
    """``[query, key]`` bool: the keys a query sees in ``layer``, written out from the HF config."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    if encoder:
        return torch.ones(n, n, dtype=torch.bool)
    seen = k <= q
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and (types is None or types[layer] == "sliding_attention")
    if sliding:
        seen = seen & (q - k < window)
    return seen
