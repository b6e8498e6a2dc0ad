"""Adapters as hooks on a frozen, unmodified TransformerLens model: :class:`PrefixTuning` (Li & Liang 2021),
:class:`PrefixTuningPlus` (arXiv 2506.13674) and :class:`LoRA` (Hu et al. 2021). An adapter holds only its
trainable tensors; :meth:`Adapter.hooks` gives the ``(hook_name, fn)`` pairs that apply it (:func:`adapted`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.hooks import (
    ATTN_OUT, MLP_OUT, MLP_POST, MLP_PRE, Q, ROT_Q, SCORES, Z, hook_name, model_device, model_dims, resolve_layers,
)
from sinklens.probes import post_hoc_attention, silent_hooks
from sinklens.validate import choice, positive_int

Hooks = list[tuple[str, Any]]
LORA_TARGETS = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out")


def _param_dtype(model: Any) -> torch.dtype:
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None and p.dtype.is_floating_point else torch.float32


def prefix_refusal(model: Any) -> str | None:
    """Why prefix keys cannot join ``model``'s softmax exactly through its hooks, or None: rotated queries listed
    but never run, scores hooked after the attention ran, soft-capped scores or learned sink logits."""
    rot = hook_name(0, ROT_Q)
    if rot in model.hook_dict and silent_hooks(model, [rot]):
        return f"it lists {rot} but never runs it, so the rotated queries a prefix key must meet are not exposed"
    if (why := post_hoc_attention(model)) is not None:
        return why
    hf = getattr(model.blocks[0].attn, "original_component", None)
    if getattr(hf, "attn_logit_softcapping", None) or (getattr(model.cfg, "attn_scores_soft_cap", -1.0) or -1.0) > 0:
        return "it soft-caps its attention scores, which the prefix's scores would skip"
    if getattr(hf, "sinks", None) is not None:
        return "its learned sink logits join the softmax outside hook_attn_scores"
    return None


class Adapter(nn.Module):
    """Base: ``hooks()`` applies the adapter; while ``record`` is a dict, the hooks add per-head sums of the
    prefix's share to it (:mod:`sinklens.peft.sinks`)."""

    method: str = ""

    def __init__(self, model: Any, layers: int | Sequence[int] | None) -> None:
        super().__init__()
        self.dims = model_dims(model)
        self.layers = resolve_layers(layers, self.dims.n_layers)
        self.record: dict[tuple[int, str], Tensor] | None = None

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _note(self, layer: int, key: str, value: Tensor) -> None:
        if self.record is not None:
            self.record[layer, key] = self.record.get((layer, key), 0) + value

    def _note_shares(self, layer: int, prefix_part: Tensor, input_part: Tensor) -> None:
        """Per head, ``|prefix part| / (|prefix part| + |input part|)`` summed over the batch and queries ``>= 1``."""
        if self.record is None:
            return
        p, i = (t[:, 1:].detach().float().norm(dim=-1) for t in (prefix_part, input_part))
        share = p / (p + i).clamp_min(torch.finfo(torch.float32).tiny)
        self._note(layer, "output_share", share.sum(dim=(0, 1)))
        self._note(layer, "n_queries", torch.full_like(share[0, 0], share.shape[0] * share.shape[1]))


class PrefixTuning(Adapter):
    """Prefix-tuning: ``n_prefix`` trainable keys/values per layer and key/value head, inside the softmax.

    Applied exactly at ``hook_z``: with ``a`` the log-normaliser of the input's scores and ``b`` the prefix's,
    ``z' = z·e^a/(e^a+e^b) + Σ_p e^{s_p}/(e^a+e^b) v_p``, attention over ``[prefix; input]``. Prefix keys meet
    the query after rotary (free vectors in the rotated space, as cached keys are) and the model's
    ``attn_scale``. ``reparam=True``: ``MLP(E)``, ``E[n_prefix, d_model]`` through ``Linear → tanh → Linear``
    (Li & Liang; the ``peft`` library's ``PrefixEncoder``); else parameters drawn ``N(0, init_std²)``."""

    method = "prefix"

    def __init__(self, model: Any, n_prefix: int = 8, *, layers: int | Sequence[int] | None = None,
                 reparam: bool = True, init_std: float = 1.0, seed: int = 0) -> None:
        super().__init__(model, layers)
        if (why := prefix_refusal(model)) is not None:
            raise UnsupportedArchitectureError(f"prefix-tuning cannot run on this model: {why}; use prefix-plus or lora.")
        self.n_prefix = positive_int(n_prefix, what="n_prefix")
        d = self.dims
        self.q_site = ROT_Q if hook_name(0, ROT_Q) in model.hook_dict else Q  # after rotary where there is one
        scale = getattr(model.cfg, "attn_scale", None)  # what hook_attn_scores divides q·k by
        self.scale = float(scale) if isinstance(scale, (int, float)) and scale > 0 else math.sqrt(d.d_head)
        device, dtype, gen = model_device(model), _param_dtype(model), torch.Generator().manual_seed(seed)
        shape = (len(self.layers), 2, self.n_prefix, d.n_kv_heads, d.d_head)
        self.reparam = bool(reparam)
        if self.reparam:
            self.embedding = nn.Parameter(torch.randn(self.n_prefix, d.d_model, generator=gen).to(device, dtype))
            self.mlp = nn.Sequential(nn.Linear(d.d_model, d.d_model), nn.Tanh(),
                                     nn.Linear(d.d_model, math.prod(shape) // self.n_prefix))
            with torch.no_grad():
                for p in self.mlp.parameters():
                    p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=gen) / math.sqrt(p.shape[-1]))
            self.mlp.to(device, dtype)
        else:
            self.kv = nn.Parameter((torch.randn(shape, generator=gen) * init_std).to(device, dtype))

    def keys_values(self) -> Tensor:
        """``[layer, 2 (key, value), prefix, kv_head, d_head]``, in ``self.layers`` order."""
        if not self.reparam:
            return self.kv
        out = self.mlp(self.embedding)  # (P, L·2·kv·d)
        d = self.dims
        return out.view(self.n_prefix, len(self.layers), 2, d.n_kv_heads, d.d_head).permute(1, 2, 0, 3, 4)

    def hooks(self) -> Hooks:
        state: dict[str, Any] = {}
        hooks: Hooks = []
        group = self.dims.n_heads // self.dims.n_kv_heads
        for i, layer in enumerate(self.layers):
            def take_q(q: Tensor, hook: Any, i: int = i) -> None:
                if i == 0:  # the first adapted layer computes every layer's prefix once per forward
                    state["kv"] = self.keys_values()
                kv = state["kv"][i].to(q)  # (2, P, kv, d)
                k, v = (t.repeat_interleave(group, dim=1) for t in (kv[0], kv[1]))  # (P, head, d)
                state["scores", i] = torch.einsum("bqhd,phd->bhqp", q, k) / self.scale  # (B, head, Q, P)
                state["v", i] = v

            def take_scores(scores: Tensor, hook: Any, i: int = i) -> None:
                state["lse", i] = torch.logsumexp(scores.float(), dim=-1)  # (B, head, Q): masked keys are -inf/min
                state["s0", i] = scores[..., 0].float()

            def mix(z: Tensor, hook: Any, i: int = i, layer: int = layer) -> Tensor:
                sp = state.pop(("scores", i)).float()
                lse_in, s0 = state.pop(("lse", i)), state.pop(("s0", i))
                if sp.shape[2] != z.shape[1]:
                    raise InvalidArgumentError("prefix-tuning needs a full forward pass (no KV cache); "
                                               "use generate(..., use_past_kv_cache=False).")
                total = torch.logaddexp(lse_in, torch.logsumexp(sp, dim=-1))
                w_in = torch.exp(lse_in - total)  # (B, head, Q): attention mass left to the input
                w_p = torch.exp(sp - total[..., None])  # (B, head, Q, P)
                input_part = z * w_in.transpose(1, 2)[..., None].to(z.dtype)
                prefix_part = torch.einsum("bhqp,phd->bqhd", w_p.to(z.dtype), state.pop(("v", i)))
                if self.record is not None:  # queries from position 1 on (position 0 sees only itself)
                    self._note(layer, "prefix_mass", w_p.sum(-1)[:, :, 1:].sum(dim=(0, 2)).detach())
                    self._note(layer, "pos0_mass", torch.exp(s0 - total)[:, :, 1:].sum(dim=(0, 2)).detach())
                    self._note_shares(layer, prefix_part, input_part)
                return input_part + prefix_part

            hooks += [(hook_name(layer, self.q_site), take_q), (hook_name(layer, SCORES), take_scores), (hook_name(layer, Z), mix)]
        return hooks


class PrefixTuningPlus(Adapter):
    """Prefix-Tuning+ (PrefixMemory-Tuning): each head's output ``z += φ(q)ᵀ M``, outside the softmax.

    ``φ = elu + 1`` on the pre-rotary query ``attn.hook_q``; one ``M[d_head, d_head]`` per layer and query head,
    ``N(0, init_std²)`` (default 0: training starts from the frozen model); added at ``attn.hook_z``, before
    ``W_O``. What comes from the paper and what is ours: docs/peft.md."""

    method = "prefix-plus"

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None, init_std: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__(model, layers)
        d, gen = self.dims, torch.Generator().manual_seed(seed)
        memory = torch.randn(len(self.layers), d.n_heads, d.d_head, d.d_head, generator=gen) * init_std
        self.memory = nn.Parameter(memory.to(model_device(model), _param_dtype(model)))

    def hooks(self) -> Hooks:
        state: dict[int, Tensor] = {}
        hooks: Hooks = []
        for i, layer in enumerate(self.layers):
            def take_q(q: Tensor, hook: Any, i: int = i) -> None:
                state[i] = q

            def add_bias(z: Tensor, hook: Any, i: int = i, layer: int = layer) -> Tensor:
                phi = F.elu(state.pop(i)) + 1  # positive, so φ(q)ᵀφ(s) is a valid similarity
                bias = torch.einsum("bqhd,hde->bqhe", phi, self.memory[i].to(z))
                self._note_shares(layer, bias, z)
                return z + bias

            hooks += [(hook_name(layer, Q), take_q), (hook_name(layer, Z), add_bias)]
        return hooks


class LoRA(Adapter):
    """Low-rank adapters ``h += (x A) B · alpha/rank`` (``A ~ U(±1/sqrt(d_in))``, ``B = 0``).

    By hook site: ``W_Q/W_K/W_V`` read ``ln1.hook_normalized`` and add to ``attn.hook_q/k/v``; ``W_O`` reads
    ``attn.hook_z`` and adds to ``hook_attn_out``; ``W_in`` reads ``ln2.hook_normalized`` and adds to
    ``mlp.hook_pre_linear`` (gated MLP) or ``mlp.hook_pre``; ``W_out`` reads ``mlp.hook_post`` and adds to
    ``hook_mlp_out``. Inputs are taken before the norm's weight: ``diag(w) A`` spans the same updates."""

    method = "lora"

    def __init__(self, model: Any, rank: int = 8, *, layers: int | Sequence[int] | None = None,
                 targets: Sequence[str] = LORA_TARGETS, alpha: float | None = None, seed: int = 0) -> None:
        super().__init__(model, layers)
        self.rank = positive_int(rank, what="rank")
        self.alpha = float(alpha) if alpha is not None else float(self.rank)
        if not targets or any(t not in LORA_TARGETS for t in targets):
            raise InvalidArgumentError(f"LoRA targets {list(targets)!r}: each must be one of {', '.join(LORA_TARGETS)}.")
        d, kv = self.dims, self.dims.n_kv_heads * self.dims.d_head
        gated = bool(getattr(model.cfg, "gated_mlp", False))
        self.sites = {  # target -> (input site, output site, d_in, d_out)
            "W_Q": ("ln1.hook_normalized", Q, d.d_model, d.n_heads * d.d_head),
            "W_K": ("ln1.hook_normalized", "attn.hook_k", d.d_model, kv),
            "W_V": ("ln1.hook_normalized", "attn.hook_v", d.d_model, kv),
            "W_O": (Z, ATTN_OUT, d.n_heads * d.d_head, d.d_model),
            "W_in": ("ln2.hook_normalized", "mlp.hook_pre_linear" if gated else MLP_PRE, d.d_model, d.d_mlp),
            "W_out": (MLP_POST, MLP_OUT, d.d_mlp, d.d_model),
        }
        self.targets = [t for t in LORA_TARGETS if t in targets and (d.d_mlp or t not in ("W_in", "W_out"))]
        missing = [hook_name(0, s) for t in self.targets for s in self.sites[t][:2] if hook_name(0, s) not in model.hook_dict]
        if missing:
            raise UnsupportedArchitectureError(f"LoRA needs the hook sites {sorted(set(missing))}, which this model lacks.")
        device, dtype, gen = model_device(model), _param_dtype(model), torch.Generator().manual_seed(seed)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for layer in self.layers:
            for t in self.targets:
                d_in, d_out = self.sites[t][2:]
                a = (torch.rand(d_in, self.rank, generator=gen) * 2 - 1) / math.sqrt(d_in)
                self.A[f"{layer}_{t}"] = nn.Parameter(a.to(device, dtype))
                self.B[f"{layer}_{t}"] = nn.Parameter(torch.zeros(self.rank, d_out, device=device, dtype=dtype))

    def hooks(self) -> Hooks:
        state: dict[tuple[int, str], Tensor] = {}
        hooks: Hooks = []
        for layer in self.layers:
            for site in dict.fromkeys(self.sites[t][0] for t in self.targets):  # each input site once
                def take(x: Tensor, hook: Any, layer: int = layer, site: str = site) -> None:
                    state[layer, site] = x.flatten(2) if x.dim() == 4 else x
                hooks.append((hook_name(layer, site), take))
            for t in self.targets:
                def add(h: Tensor, hook: Any, layer: int = layer, t: str = t) -> Tensor:
                    a, b = self.A[f"{layer}_{t}"].to(h), self.B[f"{layer}_{t}"].to(h)
                    return h + ((state[layer, self.sites[t][0]] @ a) @ b * (self.alpha / self.rank)).view(h.shape)
                hooks.append((hook_name(layer, self.sites[t][1]), add))
        return hooks


_CLASSES = {c.method: c for c in (PrefixTuning, PrefixTuningPlus, LoRA)}
METHODS: tuple[str, ...] = tuple(_CLASSES)


def make_adapter(model: Any, method: str, **kwargs: Any) -> Adapter:
    """The adapter named ``method`` (one of :data:`METHODS`), built with ``kwargs``."""
    return _CLASSES[choice(method, METHODS, what="PEFT method")](model, **kwargs)


@contextmanager
def adapted(model: Any, adapter: Adapter) -> Iterator[Any]:
    """``model`` with ``adapter`` applied inside the block (hooks removed at the end, also on an error).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> model = tiny_model()
        >>> lora = LoRA(model, rank=2)
        >>> with adapted(model, lora):
        ...     logits = model(torch.tensor([[1, 2, 3]]))
        >>> tuple(logits.shape)
        (1, 3, 64)
    """
    with model.hooks(fwd_hooks=adapter.hooks()):
        yield model
