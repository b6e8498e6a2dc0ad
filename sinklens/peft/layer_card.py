"""The Layer Card (Xu, Liang, Dai et al., arXiv 2602.04019): which layers to fine-tune. Its quantities, computed our
way (docs/peft.md) for a linear adapter ``hook_resid_post += ΔW_ℓ a``, ``a = ln1.hook_normalized``:

* **resnorm** ``‖G_ℓ Σ_ℓ^{-1/2}‖_F``: ``G_ℓ = ∂L/∂ΔW_ℓ`` at 0 (``L`` the mean task loss), ``Σ_ℓ = E[a aᵀ]`` over
  token positions plus ``ridge·tr(Σ)/d·I``; for squared loss the best ``ΔW_ℓ`` lowers the loss by ``Res²/2``;
* **activation energy** ``tr(Σ_ℓ)/d`` (1 behind an RMSNorm) and **condition** ``λ_max/λ_min`` of ``Σ_ℓ``;
* **coupling** ``ρ_ℓm = H_ℓm / sqrt(|H_ℓℓ H_mm|)``, ``H`` the exact Hessian of ``L`` in ``t`` where
  ``ΔW_ℓ = t_ℓ G_ℓ Σ_ℓ^{-1}`` (each layer's Newton direction): 0 = additive gains; ``ρ_ℓℓ`` is the sign of
  the curvature (-1 where the quadratic model fails), and an indefinite ``H`` may give ``|ρ| > 1``;
* **cost**: parameters and training FLOPs per token (6 per parameter) of a rank-``r`` LoRA on the layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import RESID_POST, eval_mode, hook_name, layer_of, model_device, model_dims, resolve_layers
from sinklens.options import BATCH_SIZE
from sinklens.peft.adapters import LoRA
from sinklens.peft.train import Task, frozen, task_loss, train_adapter
from sinklens.validate import choice, finite_number, positive_int

INPUT_SITE = "ln1.hook_normalized"
OBJECTIVES = ("resnorm", "gain_per_param")


@dataclass(repr=False, eq=False)
class LayerCard(CompactRepr):
    """Per-layer resnorm, activation energy, condition, coupling and LoRA cost (module docstring)."""

    layers: list[int]
    resnorm: Float[Tensor, " layer"]
    activation_energy: Float[Tensor, " layer"]
    condition: Float[Tensor, " layer"]
    coupling: Float[Tensor, "layer layer"]
    lora_params: list[int]
    lora_train_flops_per_token: list[int]
    rank: int
    n_tokens: int
    ridge: float
    task: str
    base_loss: float
    placement: dict[str, Any] = field(default_factory=dict)

    def place(self, k: int, objective: str = "resnorm") -> list[int]:
        """The ``k`` layers with the largest ``"resnorm"`` or ``"gain_per_param"`` (``Res²/2`` per LoRA
        parameter), in layer order."""
        k = positive_int(k, what="k")
        if k > len(self.layers):
            raise InvalidArgumentError(f"k={k} exceeds the card's {len(self.layers)} layers.")
        objective = choice(objective, OBJECTIVES, what="objective")
        score = self.resnorm if objective == "resnorm" else self.resnorm ** 2 / 2 / torch.tensor(self.lora_params)
        top = torch.argsort(score, descending=True, stable=True)[:k]
        return sorted(self.layers[int(i)] for i in top)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> str:
        lines = [f"Layer Card on task {self.task!r} ({self.n_tokens} tokens, base loss {self.base_loss:.4f}, LoRA rank {self.rank})",
                 f"{'layer':>5} {'resnorm':>9} {'energy':>9} {'cond':>9} {'max|rho|':>9} {'params':>9}"]
        off = self.coupling.abs() - torch.diag(torch.diagonal(self.coupling.abs()))
        for i, layer in enumerate(self.layers):
            lines.append(f"{layer:>5} {float(self.resnorm[i]):>9.4f} {float(self.activation_energy[i]):>9.4f} "
                         f"{float(self.condition[i]):>9.3g} {float(off[i].max()) if len(self.layers) > 1 else 0.0:>9.3f} "
                         f"{self.lora_params[i]:>9,d}")
        if self.placement:
            p = self.placement
            lines.append(f"placement: LoRA on layers {p['layers']} recovers {p['recovered']:.1%} of all-layer LoRA's "
                         f"loss improvement ({p['base_loss']:.4f} -> top-k {p['topk_loss']:.4f}, all {p['all_loss']:.4f})")
        return "\n".join(lines)


def resnorm_from_moments(grad: Tensor, cov: Tensor, *, ridge: float = 1e-3) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖G Σ_r^{-1/2}‖_F, G Σ_r^{-1}, λ_max/λ_min)`` with ``Σ_r = Σ + ridge·tr(Σ)/d·I``, in float64."""
    g, c = grad.double(), cov.double()
    d = c.shape[0]
    c = c + ridge * torch.trace(c).clamp_min(torch.finfo(torch.float64).tiny) / d * torch.eye(d, dtype=c.dtype, device=c.device)
    evals, evecs = torch.linalg.eigh(c)
    evals = evals.clamp_min(torch.finfo(torch.float64).tiny)
    inv_sqrt = (evecs / evals.sqrt()) @ evecs.T
    direction = g @ ((evecs / evals) @ evecs.T)
    return (g @ inv_sqrt).norm(), direction, evals[-1] / evals[0]


def coupling_from_hessian(hessian: Tensor) -> Tensor:
    """``ρ_ℓm = H_ℓm / sqrt(|H_ℓℓ H_mm|)`` (1 on the diagonal where ``H_ℓℓ ≠ 0``; 0 in any row whose ``H_ℓℓ`` is 0)."""
    diag = hessian.diagonal().abs().sqrt()
    denom = diag[:, None] * diag[None, :]
    return torch.where(denom > 0, hessian / denom.clamp_min(torch.finfo(hessian.dtype).tiny), torch.zeros_like(hessian))


def layer_card(model: Any, task: Task, *, layers: int | Sequence[int] | None = None, n_rows: int = 8,
               rank: int = 8, ridge: float = 1e-3, coupling: bool = True) -> LayerCard:
    """The Layer Card of ``model`` on ``task``'s first ``n_rows`` training rows: one backward gives every ``G``
    and ``Σ``; the coupling takes one double-backward pass per layer (restrict ``layers`` on CPU).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> from sinklens.peft.train import keyword_task
        >>> model = tiny_model()
        >>> card = layer_card(model, keyword_task(model, n_rows=24, seq_len=8))
        >>> card.coupling.shape, bool((card.resnorm > 0).all())
        (torch.Size([2, 2]), True)
    """
    dims, device = model_dims(model), model_device(model)
    layers, ridge = resolve_layers(layers, dims.n_layers), finite_number(ridge, what="ridge", low=0.0)
    tokens = task.train[:positive_int(n_rows, what="n_rows")].to(device)
    acts: dict[int, Tensor] = {}

    def take(x: Tensor, hook: Any) -> None:
        acts[layer_of(hook.name)] = x.detach()

    def hooks(deltas: dict[int, Tensor]) -> list:  # resid_post += ΔW_ℓ a_ℓ, a_ℓ read at ln1.hook_normalized
        return [h for layer in layers for h in ((hook_name(layer, INPUT_SITE), take), (hook_name(layer, RESID_POST),
                lambda r, hook, layer=layer: r + acts[layer].to(r) @ deltas[layer].to(r).T))]

    with eval_mode(model), frozen(model):
        zeros = {layer: torch.zeros(dims.d_model, dims.d_model, device=device, requires_grad=True) for layer in layers}
        with model.hooks(fwd_hooks=hooks(zeros)):
            loss = task_loss(model(tokens), tokens, task.loss_mask)
        grads = torch.autograd.grad(loss, [zeros[layer] for layer in layers])
        flat = [acts[layer].reshape(-1, dims.d_model).float() for layer in layers]
        covs = [a.T @ a / a.shape[0] for a in flat]
        resnorm, directions, condition = zip(*(resnorm_from_moments(g, c, ridge=ridge) for g, c in zip(grads, covs)))
        hessian = torch.zeros(len(layers), len(layers), dtype=torch.float64, device=device)
        if coupling:
            t = torch.zeros(len(layers), device=device, requires_grad=True)
            deltas = {layer: t[i] * directions[i].float() for i, layer in enumerate(layers)}
            with model.hooks(fwd_hooks=hooks(deltas)):
                loss_t = task_loss(model(tokens), tokens, task.loss_mask)
            (grad_t,) = torch.autograd.grad(loss_t, t, create_graph=True)
            for i in range(len(layers)):
                row = torch.autograd.grad(grad_t[i], t, retain_graph=i + 1 < len(layers), allow_unused=True)[0]
                hessian[i] = row.double() if row is not None else 0.0
            hessian = (hessian + hessian.T) / 2
    params = [LoRA(model, rank, layers=[layer]).n_params() for layer in layers]
    energy = torch.stack([torch.trace(c) for c in covs]) / dims.d_model
    return LayerCard(layers, torch.stack(resnorm).float().cpu(), energy.float().cpu(),
                     torch.stack(condition).float().cpu(), coupling_from_hessian(hessian).float().cpu(),
                     params, [6 * p for p in params], rank, tokens.numel(), ridge, task.name, float(loss.detach()))


def placement_check(model: Any, task: Task, card: LayerCard, *, k: int, objective: str = "resnorm",
                    steps: int = 100, lr: float = 1e-3, batch_size: int = BATCH_SIZE, seed: int = 0) -> dict[str, Any]:
    """LoRA on the card's top-``k`` layers and on all layers, same budget: ``recovered = (L_base - L_topk) /
    (L_base - L_all)`` of the eval loss, stored in ``card.placement``."""
    chosen = card.place(k, objective)
    runs = {name: train_adapter(model, LoRA(model, card.rank, layers=layers, seed=seed), task, steps=steps, lr=lr,
                                batch_size=batch_size, seed=seed) for name, layers in (("topk", chosen), ("all", None))}
    base = runs["all"].eval_before["loss"]
    topk, full = runs["topk"].eval_after["loss"], runs["all"].eval_after["loss"]
    gain = base - full
    card.placement = {"layers": chosen, "objective": objective, "k": k, "steps": steps, "base_loss": base,
                      "topk_loss": topk, "all_loss": full, "recovered": (base - topk) / gain if gain > 0 else float("nan"),
                      "topk_params": runs["topk"].n_params, "all_params": runs["all"].n_params}
    return card.placement
