"""Hook sites the origins measures share: the final hidden state and the unembedding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sinklens.hooks import model_dims


def final_state_site(model: Any) -> tuple[str, Callable[[Tensor], Tensor]]:
    """The hook carrying the final hidden state and the function that finishes it: ``unembed.hook_in`` on a
    bridge, else the last ``hook_resid_post`` followed by ``ln_final`` (if any). A ``HookedTransformer`` lists
    ``unembed.hook_in`` but never runs it with ``return_type=None``, which reducers use."""
    try:
        from transformer_lens import HookedTransformer  # TransformerLens 3.x only
    except ImportError:
        HookedTransformer = ()  # isinstance(model, ()) is False
    if "unembed.hook_in" in model.hook_dict and not isinstance(model, HookedTransformer):
        return "unembed.hook_in", lambda x: x
    final_norm = getattr(model, "ln_final", None)
    last = f"blocks.{model_dims(model).n_layers - 1}.hook_resid_post"
    return last, final_norm if final_norm is not None else (lambda x: x)


def unembedding(model: Any) -> tuple[Tensor, Tensor | None]:
    """``(W_U [d_model, d_vocab], b_U [d_vocab] or None)``, detached."""
    b = getattr(model, "b_U", None)
    return model.W_U.detach(), (b.detach() if isinstance(b, torch.Tensor) else None)


def logits_from_final(model: Any, final: Tensor) -> Tensor:
    """Float32 logits ``final @ W_U + b_U``, soft-capped as ``c · tanh(logits / c)`` when the model caps them."""
    w, b = unembedding(model)
    out = final.float() @ w.float().to(final.device)
    if b is not None:
        out = out + b.float().to(final.device)
    cap = float(getattr(getattr(model, "cfg", None), "output_logits_soft_cap", -1.0) or -1.0)
    return cap * torch.tanh(out / cap) if cap > 0 else out
