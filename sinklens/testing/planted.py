"""Tiny models with hand-planted sink mechanisms, so analyzers can be tested against known answers.

:func:`planted_model` edits a :func:`sinklens.testing.tiny_model` in place to plant a BOS-only direction
``bos_dim``; a super neuron ``(layer, neuron)`` reading it and writing ``dim``, which nothing else writes (so
position 0 alone carries a massive value in ``dim`` from ``blocks.{layer + 1}``); optionally an eraser neuron
writing ``-dim`` back; optionally amplifiers (neuron ``amplify_neuron`` of each of ``amplify_layers`` reads ``dim``
and writes ``amplify_write`` × its activation into it: a cascade); and query–key locking in head
``(qk_layer, qk_head)`` through a shared direction ``common_dim`` of the non-BOS tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
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


class _Weights:
    """In-place writable views of one model's weights, in TransformerLens shapes."""

    def __init__(self, model: Any, arch: str):
        self.model, self.arch = model, arch
        self.bridge = transformer_lens_major() >= 4
        dims = model_dims(model)
        self.d_head, self.n_heads, self.n_kv = dims.d_head, dims.n_heads, dims.n_kv_heads
        if self.bridge:
            hf = model.original_model
            self.hf_layers = hf.model.layers if arch == "llama" else hf.transformer.h
            self.hf = hf

    def W_E(self) -> Tensor:  # [vocab, d_model]
        if not self.bridge:
            return self.model.embed.W_E
        return self.hf.model.embed_tokens.weight if self.arch == "llama" else self.hf.transformer.wte.weight

    def W_pos(self) -> Tensor | None:  # [n_ctx, d_model]
        if self.arch == "llama":
            return None
        return self.hf.transformer.wpe.weight if self.bridge else self.model.pos_embed.W_pos

    def W_in(self, layer: int) -> Tensor:  # [d_model, d_mlp]
        if not self.bridge:
            return self.model.blocks[layer].mlp.W_in
        mlp = self.hf_layers[layer].mlp
        return mlp.up_proj.weight.T if self.arch == "llama" else mlp.c_fc.weight

    def W_gate(self, layer: int) -> Tensor | None:  # [d_model, d_mlp]
        if self.arch != "llama":
            return None
        return self.hf_layers[layer].mlp.gate_proj.weight.T if self.bridge else self.model.blocks[layer].mlp.W_gate

    def b_in(self, layer: int) -> Tensor | None:  # [d_mlp]
        if not self.bridge:
            return self.model.blocks[layer].mlp.b_in
        return None if self.arch == "llama" else self.hf_layers[layer].mlp.c_fc.bias

    def W_out(self, layer: int) -> Tensor:  # [d_mlp, d_model]
        if not self.bridge:
            return self.model.blocks[layer].mlp.W_out
        mlp = self.hf_layers[layer].mlp
        return mlp.down_proj.weight.T if self.arch == "llama" else mlp.c_proj.weight

    def b_out(self, layer: int) -> Tensor | None:  # [d_model]
        if not self.bridge:
            return self.model.blocks[layer].mlp.b_out
        return None if self.arch == "llama" else self.hf_layers[layer].mlp.c_proj.bias

    def W_O(self, layer: int) -> Tensor:  # [n_heads * d_head, d_model]
        if not self.bridge:
            w = self.model.blocks[layer].attn.W_O
            return w.view(-1, w.shape[-1])
        attn = self.hf_layers[layer].self_attn if self.arch == "llama" else self.hf_layers[layer].attn
        return attn.o_proj.weight.T if self.arch == "llama" else attn.c_proj.weight

    def b_O(self, layer: int) -> Tensor | None:  # [d_model]
        if not self.bridge:
            return self.model.blocks[layer].attn.b_O
        return None if self.arch == "llama" else self.hf_layers[layer].attn.c_proj.bias

    def W_Q(self, layer: int, head: int) -> Tensor:  # [d_model, d_head]
        lo, hi = head * self.d_head, (head + 1) * self.d_head
        if not self.bridge:
            return self.model.blocks[layer].attn.W_Q[head]
        if self.arch == "llama":
            return self.hf_layers[layer].self_attn.q_proj.weight[lo:hi].T
        return self.hf_layers[layer].attn.c_attn.weight[:, lo:hi]

    def W_K(self, layer: int, kv_head: int) -> Tensor:  # [d_model, d_head]
        lo, hi = kv_head * self.d_head, (kv_head + 1) * self.d_head
        if not self.bridge:
            attn = self.model.blocks[layer].attn
            return attn._W_K[kv_head] if hasattr(attn, "_W_K") else attn.W_K[kv_head]
        if self.arch == "llama":
            return self.hf_layers[layer].self_attn.k_proj.weight[lo:hi].T
        d_model = self.hf_layers[layer].attn.c_attn.weight.shape[0]
        return self.hf_layers[layer].attn.c_attn.weight[:, d_model + lo : d_model + hi]


def _plant_reader(w: _Weights, layer: int, neuron: int, read_dim: int, write_dim: int, write: float, arch: str,
                  gate_dim: int | None = None, gain: float | None = None) -> None:
    """Make ``neuron`` read only ``read_dim`` (its gate ``gate_dim``, default the same) of the normalised input and
    write ``write`` into ``write_dim``; an explicit ``gain`` leaves ``b_in`` at 0 (an activation linear in the input)."""
    gain_in = gain or (2.0 if arch == "llama" else 3.0)
    w.W_in(layer)[:, neuron] = 0.0
    w.W_in(layer)[read_dim, neuron] = gain_in
    gate = w.W_gate(layer)
    if gate is not None:
        gate[:, neuron] = 0.0
        gate[read_dim if gate_dim is None else gate_dim, neuron] = 2.0
    b_in = w.b_in(layer)
    if b_in is not None and gate is None:  # GELU MLPs: LayerNorm's mean removal leaves ±0.3 at other tokens; bias them off
        b_in[neuron] = 0.0 if gain else -2.0 * gain_in
    w.W_out(layer)[neuron, :] = 0.0
    w.W_out(layer)[neuron, write_dim] = write


def planted_model(
    arch: Literal["llama", "gpt2"] = "llama",
    *,
    layer: int = 0,
    neuron: int = 7,
    dim: int = 5,
    bos_dim: int = 2,
    erase_layer: int | None = None,
    erase_neuron: int = 11,
    write: float | None = None,
    amplify_layers: tuple[int, ...] = (),
    amplify_neuron: int = 13,
    amplify_write: float = 1.0,
    qk_layer: int | None = None,
    qk_head: int = 1,
    common_dim: int = 9,
    **model_kwargs: Any,
) -> tuple[Any, PlantedSpec]:
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
    if erase_layer is not None and not layer < erase_layer < n_layers:
        raise ValueError(f"erase_layer={erase_layer} must lie in ({layer}, {n_layers}).")
    if qk_layer is not None and not layer < qk_layer < n_layers:
        raise ValueError(f"qk_layer={qk_layer} must lie in ({layer}, {n_layers}).")
    w = _Weights(model, arch)
    protected = sorted(used)
    with torch.no_grad():
        W_E = w.W_E()
        typical = float(W_E[1:].norm(dim=-1).mean())
        W_E[:, protected] = 0.0
        W_E[0, bos_dim] = 4.0 * typical
        if qk_layer is not None:
            W_E[1:, common_dim] = 2.0 * typical
        W_pos = w.W_pos()
        if W_pos is not None:
            W_pos[:, protected] = 0.0
        for block in range(n_layers):  # nothing but the plants writes into the protected dims
            w.W_O(block)[:, protected] = 0.0
            w.W_out(block)[:, protected] = 0.0
            for bias in (w.b_O(block), w.b_out(block)):
                if bias is not None:
                    bias[protected] = 0.0
        _plant_reader(w, layer, neuron, bos_dim, dim, write or (20.0 if arch == "llama" else 250.0), arch)
        for block in amplify_layers:
            _plant_reader(w, block, amplify_neuron, dim, dim, amplify_write, arch, gate_dim=bos_dim, gain=10.0)
        if erase_layer is not None:
            # Read `dim`, then scale the write so that 99% of the BOS token's massive value is removed
            # (position 0 holds the same activations in every sequence, so one forward calibrates it).
            _plant_reader(w, erase_layer, erase_neuron, dim, dim, -1.0, arch)
            names = [f"blocks.{erase_layer}.hook_resid_pre", f"blocks.{erase_layer}.mlp.hook_post"]
            _, cache = model.run_with_cache(torch.zeros(1, 1, dtype=torch.long), names_filter=lambda n: n in names)
            massive = float(cache[names[0]][0, 0, dim])
            act = float(cache[names[1]][0, 0, erase_neuron])
            w.W_out(erase_layer)[erase_neuron, dim] = -0.99 * massive / act
        if qk_layer is not None:
            # Lowest-frequency rotary component (rotate-half pairs j with j + d_head/2); any for gpt2.
            j = w.d_head // 2 - 1
            kv_head = qk_head // (w.n_heads // w.n_kv)
            W_Q, W_K = w.W_Q(qk_layer, qk_head), w.W_K(qk_layer, kv_head)
            W_Q[:] = 0.0
            W_Q[common_dim, j] = 3.0
            W_K[common_dim, :] = 0.0
            W_K[dim, :] = 0.0
            W_K[dim, j] = 3.0
    spec = PlantedSpec(
        arch=arch, layer=layer, neuron=neuron, dim=dim, bos_dim=bos_dim,
        erase_layer=erase_layer, erase_neuron=erase_neuron if erase_layer is not None else None,
        qk_layer=qk_layer, qk_head=qk_head if qk_layer is not None else None,
        common_dim=common_dim if qk_layer is not None else None,
    )
    return model, spec
