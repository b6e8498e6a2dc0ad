"""The dense products ``x @ w`` of :class:`~sinklens.sinklm.model.SinkLM`, through oneDNN on CPU.

PyTorch's float32 ``aten::mm`` on x86 CPUs calls MKL's ``sgemm``. On the project's AMD EPYC
(Zen 4, 2 cores) that measured 120–170 GFLOP/s for the trainer's shapes, where oneDNN's float32
inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel inductor uses for CPU inference)
measured 165–210 GFLOP/s for the forward product ``x @ w`` and the input gradient ``g @ wᵀ``
(``benchmarks/RESULTS.md``). :func:`matmul` sends those two products to oneDNN and keeps the weight
gradient ``xᵀ g`` on ``aten`` (oneDNN measured no faster there).

It is the same float32 arithmetic: oneDNN's default math mode for f32 is strict (no bf16 or tf32
inside); results differ from ``aten``'s only in summation order, ≈1e-7 relative (tested).

Backends (:data:`CpuMatmul`), chosen per process with :func:`set_cpu_matmul` (the trainer sets
``TrainConfig.cpu_matmul``): ``"auto"`` (default) uses oneDNN when this torch build has the kernel
and it passes a numerical self-check against a float64 product, else ``aten``; ``"onednn"``
insists (an error when it is missing); ``"aten"`` never uses it. Whatever the backend, a product
runs on ``aten`` when it is not a CPU float32 one, under autocast, or inside ``torch.func``
transforms; see :func:`sinklens.sinklm.dispatch.cpu_float32`. A ``torch.compile``-d model calls
the oneDNN product as the custom operator ``torch.ops.sinklens.onednn_mm`` (torch >= 2.4):
inductor fuses the element-wise work between the products and calls oneDNN for them (a compiled
``headnorm-cpu`` step on the AMD EPYC: 1.05× an eager one, where with inductor's own ``aten::mm``
it was no faster). ``"auto"`` is resolved (the self-check) once, when this module is imported, so
that no trace runs it; ``torch.export`` keeps ``aten``'s products, so an exported program loads
without sinklens.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import CpuMatmul
from sinklens.sinklm.dispatch import cpu_float32, is_compiling, is_exporting
from sinklens.validate import choice

__all__ = ["CpuMatmul", "cpu_matmul_backend", "matmul", "set_cpu_matmul"]

CPU_MATMULS: tuple[str, ...] = typing.get_args(CpuMatmul)

_backend: dict[str, str | None] = {"requested": "auto", "resolved": None, "reason": None}


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    """oneDNN's ``x @ weightᵀ`` (``weight`` is ``[out, in]``, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@functools.cache
def _onednn_problem() -> str | None:
    """Why oneDNN cannot serve :func:`matmul` in this process, or None when it can (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no torch.ops.mkldnn._linear_pointwise"
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*shape, generator=gen, device="cpu") for shape in ((3, 5, 16), (16, 12), (3, 5, 12)))
    try:
        products = (_linear(x, w.T), _linear(g, w))
    except RuntimeError as error:
        return f"oneDNN's inner product failed a self-check ({str(error).splitlines()[0]})"
    expected = (x.double() @ w.double(), g.double() @ w.double().T)
    for got, want in zip(products, expected):
        if got.shape != want.shape or not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5):
            return "oneDNN's inner product disagreed with a float64 product in a self-check"
    return None


def set_cpu_matmul(mode: CpuMatmul | str = "auto") -> str:
    """Choose the CPU float32 matmul backend of :func:`matmul` for this process; returns the one in
    use (``"onednn"`` or ``"aten"``). :func:`sinklens.train.loop.train` sets ``TrainConfig.cpu_matmul``
    for the run and restores the previous choice afterwards.

    Raises:
        InvalidArgumentError: ``mode`` is not one of :data:`CPU_MATMULS`, or ``"onednn"`` was asked
            for and this torch build cannot provide it (the message says why).
    """
    mode = choice(mode, CPU_MATMULS, what="cpu_matmul")
    problem = None if mode == "aten" else _onednn_problem()
    if mode == "onednn" and problem is not None:
        raise InvalidArgumentError(f"cpu_matmul='onednn' is not available: {problem}; use 'auto' or 'aten'.")
    resolved = "aten" if mode == "aten" or problem is not None else "onednn"
    _backend.update(requested=mode, resolved=resolved, reason=problem if mode == "auto" else None)
    return resolved


def _resolved() -> str | None:
    if _backend["resolved"] is None:
        set_cpu_matmul(_backend["requested"] or "auto")
    return _backend["resolved"]


def cpu_matmul_backend() -> dict[str, str | None]:
    """``{"requested", "resolved", "reason"}``: the backend asked for, the one in use, and why
    ``"auto"`` fell back to ``aten`` (None when it did not)."""
    _resolved()
    return dict(_backend)


def _weight_grad(x: Tensor, grad: Tensor) -> Tensor:
    """``xᵀ g`` over every leading dimension, on aten (oneDNN measured no faster there)."""
    return x.reshape(-1, x.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])


class _OneDnnMatmul(torch.autograd.Function):
    """``x @ w`` with the forward and the input gradient on oneDNN, the weight gradient on aten (eager)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return _linear(x, w.T)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad_x = _linear(grad, w) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(x, grad) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _define_onednn_mm() -> Any:
    """The custom operator ``sinklens::onednn_mm(x, w) = x @ w`` that a ``torch.compile``-d model
    calls, with :class:`_OneDnnMatmul`'s gradients, or None on a torch without
    ``torch.library.custom_op`` (< 2.4; compiled products then stay on ``aten``).

    Dynamo would trace an ``autograd.Function`` back into its operations; a custom operator stays one
    opaque kernel in the graph, and inductor fuses the element-wise work around it. Eager steps keep
    :class:`_OneDnnMatmul`, whose dispatch costs less (custom operator 0.99× its step time, measured).
    """
    custom_op = getattr(getattr(torch, "library", None), "custom_op", None)
    if custom_op is None:
        return None

    @custom_op("sinklens::onednn_mm", mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor")
    def onednn_mm(x: Tensor, w: Tensor) -> Tensor:
        return _linear(x, w.T)

    @onednn_mm.register_fake
    def _(x: Tensor, w: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[1]))

    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        # the operator again, so that the compiled backward graph keeps it opaque too
        grad_x = onednn_mm(grad, w.T) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(x, grad) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w

    onednn_mm.register_autograd(backward, setup_context=setup_context)
    return onednn_mm


_onednn_mm = _define_onednn_mm()


def matmul(x: Float[Tensor, "*batch d_in"], w: Float[Tensor, "d_in d_out"]) -> Float[Tensor, "*batch d_out"]:
    """``x @ w``, on oneDNN when the backend is ``"onednn"`` and this is a CPU float32 product
    outside autocast and ``torch.func`` transforms (compiled or not); on ``aten`` otherwise.

    Examples:
        >>> x, w = torch.randn(2, 3, 8), torch.randn(8, 4)
        >>> torch.allclose(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
        True
    """
    if w.ndim != 2 or x.ndim < 2 or x.numel() == 0 or not cpu_float32(x, w, compiling=True):
        return x @ w
    if is_compiling():
        # the backend as resolved (no self-check inside a trace); an exported program keeps aten's products
        onednn = _onednn_mm is not None and _backend["resolved"] == "onednn" and not is_exporting()
        return _onednn_mm(x, w) if onednn else x @ w
    if _resolved() != "onednn":
        return x @ w
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _OneDnnMatmul.apply(x, w)
    return _linear(x, w.T)


_resolved()  # once per process, at import: a torch.compile trace must not run the self-check (it breaks the graph)
