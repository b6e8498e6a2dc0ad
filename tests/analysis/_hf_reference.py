"""Independent references for the visibility tests: plain Hugging Face attentions, one sequence at a time
(and :func:`perturb_post_attention_norms`, which the residual-unit references share).

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


def perturb_post_attention_norms(family: str, *hf_models) -> None:
    """Give the norm after each attention a gain far from 1 (40 on dimension 3; Gemma stores ``w`` for a gain
    ``1 + w``) in every Hugging Face model given, so residual units differ from raw writes: Gemma 2's
    ``post_attention_layernorm``, and BERT's post-LN attention LayerNorm (with a bias as well)."""
    for hf in hf_models:
        if family == "gemma2":
            norms = [(layer.post_attention_layernorm, None) for layer in hf.model.layers]
        elif family == "bert":
            norms = [(layer.attention.output.LayerNorm, "bias") for layer in hf.bert.encoder.layer]
        else:
            continue
        with torch.no_grad():
            for norm, bias in norms:
                w = torch.linspace(-0.5, 2.0, norm.weight.numel())
                w[3] = 40.0
                norm.weight.copy_(w)
                if bias is not None:
                    norm.bias.copy_(torch.linspace(1.0, -1.0, norm.weight.numel()))
