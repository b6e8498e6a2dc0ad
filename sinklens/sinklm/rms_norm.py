"""RMSNorm for :class:`~sinklens.sinklm.model.SinkLM`, with a closed-form backward on CPU.

``rms_norm(x, w, eps) = w ⊙ x / sqrt(mean_d(x²) + eps)``, normalising over the last axis of ``x``
in float32. It serves the model's pre-norms (``w`` of shape ``[d_model]``), head-wise RMSNorm
(``w`` of shape ``[n_heads, d_head]`` over ``z[batch, pos, head, d_head]``, normalising each head
over ``d_head``) and QK-norm.

Why a kernel of its own: on a CPU, ``F.rms_norm`` is a composite of ``pow``, ``mean``, ``rsqrt``
and two ``mul`` (there is no fused CPU kernel in torch 2.13), so autograd saves and re-reads four
activations and runs about ten element-wise passes for the backward. :class:`_RMSNormFunction`
saves ``x̂ = x / rms`` and ``1/rms`` only and computes the gradients in closed form::

    dw = Σ_rows dy ⊙ x̂
    dx = (1/rms) ⊙ (g − x̂ ⊙ mean_d(g ⊙ x̂)),   g = dy ⊙ w

Measured forward + backward on the project's 2-core CPU: 1.65 vs 3.10 ms for ``[16, 256, 256]``
with a ``[256]`` gain, 2.2 vs 3.5 ms for head-wise ``[16, 256, 4, 64]`` with a ``[4, 64]`` gain
(``benchmarks/RESULTS.md``). Same float32 arithmetic up to
summation order (tested against ``F.rms_norm`` and float64). It runs only where
:func:`~sinklens.sinklm.dispatch.eager_cpu_float32` holds and a gradient is needed; elsewhere
(CUDA, bfloat16, autocast, ``torch.compile``, inference) ``F.rms_norm`` runs. The closed-form
backward is not itself differentiable: a second derivative through it (``create_graph=True``)
raises torch's ``once_differentiable`` error instead of returning a wrong number; compute such
derivatives in float64, where ``F.rms_norm`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from torch.autograd.function import once_differentiable

from sinklens.sinklm.dispatch import at_least_float32, eager_cpu_float32

__all__ = ["rms_norm"]


class _RMSNormFunction(torch.autograd.Function):
    """``w ⊙ x / sqrt(mean(x², -1) + eps)`` (``w`` may be None) with the closed-form backward above."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor | None, eps: float) -> Tensor:  # type: ignore[override]
        d = x.shape[-1]
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()
        x_hat = x * inv_rms
        ctx.save_for_backward(x_hat, inv_rms, w)
        return x_hat if w is None else x_hat * w

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_hat, inv_rms, w = ctx.saved_tensors
        grad_w = None
        if w is not None and ctx.needs_input_grad[1]:
            grad_w = (dy * x_hat).reshape(-1, *w.shape).sum(0)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        g = dy * w if w is not None else dy.clone()
        mean_gx = torch.linalg.vecdot(g, x_hat, dim=-1).unsqueeze(-1).div_(x_hat.shape[-1])
        return g.addcmul_(x_hat, mean_gx, value=-1).mul_(inv_rms), grad_w, None


def rms_norm(
    x: Float[Tensor, "*batch d"], w: Float[Tensor, "*w_shape"] | None, eps: float
) -> Float[Tensor, "*batch d"]:
    """``w ⊙ x / sqrt(mean(x², -1) + eps)``: the RMS over the last axis of ``x``, computed in
    float32; the normalised ``x`` is cast to ``x``'s dtype before ``w`` (or None, for no gain)
    multiplies it, broadcast against the trailing axes of ``x``.

    Examples:
        >>> x = torch.tensor([[3.0, 4.0]])
        >>> rms_norm(x, None, 0.0)  # rms of (3, 4) is sqrt(12.5)
        tensor([[0.8485, 1.1314]])
    """
    trailing = w is None or tuple(w.shape) == tuple(x.shape[x.ndim - w.ndim :])
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))
    if needs_grad and trailing and eager_cpu_float32(x, *([] if w is None else [w])):
        return _RMSNormFunction.apply(x, w, eps)
    fused = hasattr(F, "rms_norm")  # torch >= 2.4
    if fused and w is not None and w.ndim == 1 and x.dtype == w.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    xf = at_least_float32(x)
    normed = F.rms_norm(xf, xf.shape[-1:], None, eps) if fused else xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.to(x.dtype)
    return normed if w is None else normed * w.to(x.dtype)
