"""Tiny models with hand-planted sink mechanisms, to test analyzers against known answers: :func:`planted_model`
plants in a :func:`sinklens.testing.tiny_model` a BOS-only direction ``bos_dim``; a super neuron ``(layer, neuron)``
reading it and writing ``dim``, which nothing else writes (so position 0 alone carries a massive value in ``dim``
from ``blocks.{layer + 1}``); optionally an eraser neuron writing ``-dim`` back, amplifiers (neuron
``amplify_neuron`` of each of ``amplify_layers`` adds ``amplify_write`` × its activation to ``dim``) and query–key
locking in head ``(qk_layer, qk_head)`` through a direction ``common_dim`` shared by the non-BOS tokens."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal

import torch
from torch import Tensor

from sinklens.hooks import model_dims
from sinklens.testing.models import tiny_model, transformer_lens_major


@dataclass(frozen=True)
class PlantedSpec:
    """Where the mechanisms were planted (the answers a test expects)."""

    arch: str
    layer: int
    neuron: int
    dim: int
    bos_dim: int
    erase_layer: int | None = None
    erase_neuron: int | None = None
    qk_layer: int | None = None
    qk_head: int | None = None
    common_dim: int | None = None


#: Each weight as ``(TransformerLens 3.x name, Hugging Face name under the bridge for llama, for gpt2)``; None: the
#: architecture has none. :func:`_weight` returns writable views in TransformerLens shapes ``[d_in, d_out]``.
_PATHS = {
    "W_E": ("embed.W_E", "model.embed_tokens.weight", "transformer.wte.weight"),
    "W_pos": ("pos_embed.W_pos", None, "transformer.wpe.weight"),
    "W_in": ("blocks.{}.mlp.W_in", "model.layers.{}.mlp.up_proj.weight", "transformer.h.{}.mlp.c_fc.weight"),
    "W_gate": ("blocks.{}.mlp.W_gate", "model.layers.{}.mlp.gate_proj.weight", None),
    "b_in": ("blocks.{}.mlp.b_in", None, "transformer.h.{}.mlp.c_fc.bias"),
    "W_out": ("blocks.{}.mlp.W_out", "model.layers.{}.mlp.down_proj.weight", "transformer.h.{}.mlp.c_proj.weight"),
    "b_out": ("blocks.{}.mlp.b_out", None, "transformer.h.{}.mlp.c_proj.bias"),
    "W_O": ("blocks.{}.attn.W_O", "model.layers.{}.self_attn.o_proj.weight", "transformer.h.{}.attn.c_proj.weight"),
    "b_O": ("blocks.{}.attn.b_O", None, "transformer.h.{}.attn.c_proj.bias"),
    "W_Q": ("blocks.{}.attn.W_Q", "model.layers.{}.self_attn.q_proj.weight", "transformer.h.{}.attn.c_attn.weight"),
    "W_K": ("blocks.{}.attn.W_K", "model.layers.{}.self_attn.k_proj.weight", "transformer.h.{}.attn.c_attn.weight"),
}


def _weight(model: Any, arch: str, name: str, layer: int = 0, head: int | None = None) -> Tensor | None:
    """A writable view of weight ``name`` (of ``head`` for ``W_Q``/``W_K``; ``W_O``: ``[n_heads * d_head, d_model]``)."""
    tl, *hf = _PATHS[name]
    path, bridge = hf[arch == "gpt2"], transformer_lens_major() >= 4
    if path is None and (bridge or name in ("W_pos", "W_gate")):
        return None
    if not bridge:
        if name == "W_K" and hasattr(model.blocks[layer].attn, "_W_K"):  # grouped-query attention
            tl = "blocks.{}.attn._W_K"
        w = attrgetter(tl.format(layer))(model)
        if name == "W_O":
            return w.view(-1, w.shape[-1])
        return w if head is None else w[head]
    w = attrgetter(path.format(layer))(model.original_model)
    w = w.T if arch == "llama" and name != "W_E" else w  # Llama's nn.Linear weights are [d_out, d_in]
    if head is None:
        return w
    d_head = model_dims(model).d_head
    lo = head * d_head + (w.shape[0] if arch == "gpt2" and name == "W_K" else 0)  # gpt2's c_attn: [q | k | v]
    return w[:, lo:lo + d_head]


def _plant_reader(w: Callable[..., Any], layer: int, neuron: int, read_dim: int, write_dim: int, write: float, arch: str,
                  gate_dim: int | None = None, gain: float | None = None) -> None:
    """Make ``neuron`` read only ``read_dim`` (its gate ``gate_dim``, default the same) of the normalised input and
    write ``write`` into ``write_dim``; an explicit ``gain`` leaves ``b_in`` at 0 (an activation linear in the input)."""
    gain_in = gain or (2.0 if arch == "llama" else 3.0)
    w("W_in", layer)[:, neuron] = 0.0
    w("W_in", layer)[read_dim, neuron] = gain_in
    if (gate := w("W_gate", layer)) is not None:
        gate[:, neuron] = 0.0
        gate[read_dim if gate_dim is None else gate_dim, neuron] = 2.0
    b_in = w("b_in", layer)
    if b_in is not None and gate is None:  # GELU MLPs: LayerNorm's mean removal leaves ±0.3 at other tokens; bias them off
        b_in[neuron] = 0.0 if gain else -2.0 * gain_in
    w("W_out", layer)[neuron, :] = 0.0
    w("W_out", layer)[neuron, write_dim] = write


def planted_model(arch: Literal["llama", "gpt2"] = "llama", *, layer: int = 0, neuron: int = 7, dim: int = 5,
                  bos_dim: int = 2, erase_layer: int | None = None, erase_neuron: int = 11, write: float | None = None,
                  amplify_layers: tuple[int, ...] = (), amplify_neuron: int = 13, amplify_write: float = 1.0,
                  qk_layer: int | None = None, qk_head: int = 1, common_dim: int = 9,
                  **model_kwargs: Any) -> tuple[Any, PlantedSpec]:
    """A :func:`~sinklens.testing.tiny_model` (``model_kwargs``) with planted mechanisms (module docstring), and
    the :class:`PlantedSpec` of where they are.

    Examples:
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> _, cache = model.run_with_cache(model.to_tokens("t3 t4 t5"), names_filter="blocks.1.hook_resid_pre")
        >>> resid = cache["blocks.1.hook_resid_pre"][0]
        >>> bool(resid[0, 5].abs() > 100), float(resid[1:, 5].abs().max())
        (True, 0.0)
    """
    model = tiny_model(arch, **model_kwargs)
    n_layers, d_model = model.cfg.n_layers, model.cfg.d_model
    used = {dim, bos_dim} | ({common_dim} if qk_layer is not None else set())
    if len(used) != (3 if qk_layer is not None else 2) or max(used) >= d_model or min(used) < 0:
        raise ValueError(f"dim={dim}, bos_dim={bos_dim}, common_dim={common_dim} must be distinct and in [0, {d_model}).")
    if not 0 <= layer < n_layers - 1:
        raise ValueError(f"layer={layer} must leave at least one later layer: 0 <= layer < {n_layers - 1}.")
    for name, later in (("erase_layer", erase_layer), ("qk_layer", qk_layer)):
        if later is not None and not layer < later < n_layers:
            raise ValueError(f"{name}={later} must lie in ({layer}, {n_layers}).")
    w = functools.partial(_weight, model, arch)
    protected = sorted(used)
    with torch.no_grad():
        W_E = w("W_E")
        typical = float(W_E[1:].norm(dim=-1).mean())
        W_E[:, protected] = 0.0
        W_E[0, bos_dim] = 4.0 * typical
        if qk_layer is not None:
            W_E[1:, common_dim] = 2.0 * typical
        for t in [w("W_pos")] + [w(n, b) for b in range(n_layers) for n in ("W_O", "W_out", "b_O", "b_out")]:
            if t is not None:  # nothing but the plants writes into the protected dims
                t[..., protected] = 0.0
        _plant_reader(w, layer, neuron, bos_dim, dim, write or (20.0 if arch == "llama" else 250.0), arch)
        for block in amplify_layers:
            _plant_reader(w, block, amplify_neuron, dim, dim, amplify_write, arch, gate_dim=bos_dim, gain=10.0)
        if erase_layer is not None:
            # Read `dim`, then scale the write so that 99% of the BOS token's massive value is removed
            # (position 0 holds the same activations in every sequence, so one forward calibrates it).
            _plant_reader(w, erase_layer, erase_neuron, dim, dim, -1.0, arch)
            names = [f"blocks.{erase_layer}.hook_resid_pre", f"blocks.{erase_layer}.mlp.hook_post"]
            _, cache = model.run_with_cache(torch.zeros(1, 1, dtype=torch.long), names_filter=lambda n: n in names)
            massive, act = float(cache[names[0]][0, 0, dim]), float(cache[names[1]][0, 0, erase_neuron])
            w("W_out", erase_layer)[erase_neuron, dim] = -0.99 * massive / act
        if qk_layer is not None:
            # Lowest-frequency rotary component (rotate-half pairs j with j + d_head/2); any for gpt2.
            dims = model_dims(model)
            j = dims.d_head // 2 - 1
            W_Q = w("W_Q", qk_layer, qk_head)
            W_K = w("W_K", qk_layer, qk_head // (dims.n_heads // dims.n_kv_heads))
            W_Q[:] = 0.0
            W_Q[common_dim, j] = 3.0
            W_K[[common_dim, dim], :] = 0.0
            W_K[dim, j] = 3.0
    erase, qk = erase_layer is not None, qk_layer is not None
    return model, PlantedSpec(arch, layer, neuron, dim, bos_dim, erase_layer, erase_neuron if erase else None,
                              qk_layer, qk_head if qk else None, common_dim if qk else None)
