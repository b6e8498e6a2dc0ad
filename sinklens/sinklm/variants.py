"""Attention variants of :class:`sinklens.sinklm.model.SinkLM`, one small class each, picked by name. A variant
changes up to four steps of a head, in this order (:class:`sinklens.sinklm.model.Attention`)::

    q, k = variant.transform_qk(q, k)            # after hook_q/hook_k, before RoPE (qk_norm)
    scores = variant.logits(q·k / sqrt(d_head))  # causal mask = -inf, then hook_attn_scores
    pattern = variant.normalize(scores)          # softmax / sigmoid / softpick ..., then hook_pattern
    z = variant.transform_z(pattern @ v, x)      # after hook_z: headwise_rms / gated, at its own hook
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from sinklens.errors import InvalidArgumentError
from sinklens.validate import choice, did_you_mean, finite_number


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in the dtype its norms, softmaxes and sums run in: float32, or float64 for a float64 model."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(
    x: Float[Tensor, "*batch d"], w: Float[Tensor, "*w_shape"] | None, eps: float
) -> Float[Tensor, "*batch d"]:
    """``w ⊙ x / sqrt(mean(x², -1) + eps)`` over the last axis, in float32, cast to ``x``'s dtype before the gain."""
    xf = at_least_float32(x)
    if hasattr(F, "rms_norm"):  # torch >= 2.4
        normed = F.rms_norm(xf, xf.shape[-1:], None, eps)
    else:
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.to(x.dtype)
    return normed if w is None else normed * w.to(x.dtype)


class AttentionVariant(nn.Module):
    """Base class of an attention variant; by itself it is softmax attention (``baseline``).

    ``uses_sdpa``: the scores → pattern step is causal softmax (SDPA may replace it); ``hook_sites``: extra
    hook points of the attention module; ``output_site``: the hook holding the head outputs that enter ``W_O``;
    ``defaults``: accepted ``variant_options`` and their defaults."""

    uses_sdpa: ClassVar[bool] = True
    hook_sites: ClassVar[tuple[str, ...]] = ()
    output_site: ClassVar[str] = "hook_z"
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *, n_heads: int, d_head: int, d_model: int, n_ctx: int, init_std: float = 0.02, **options: Any) -> None:
        super().__init__()
        self.check_options(options)
        self.options = {**self.defaults, **options}
        if "eps" in self.options:  # every variant's eps is a denominator guard: a positive number
            what = f"attention variant {type(self).__name__} option eps"
            self.options["eps"] = finite_number(self.options["eps"], what=what, low=0.0, low_open=True)
        self.n_heads, self.d_head, self.d_model, self.n_ctx, self.init_std = n_heads, d_head, d_model, n_ctx, init_std

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise InvalidArgumentError if ``options`` names an option this variant does not take."""
        if unknown := sorted(set(options) - set(cls.defaults)):
            raise InvalidArgumentError(f"Unknown option(s) {unknown} for attention variant {cls.__name__}; accepted "
                                       f"options (with defaults) are {cls.defaults or 'none'}.")

    def transform_qk(
        self, q: Float[Tensor, "batch pos head d_head"], k: Float[Tensor, "batch pos kv_head d_head"], attn: nn.Module
    ) -> tuple[Tensor, Tensor]:
        """Transform queries and keys before RoPE (identity by default)."""
        return q, k

    def aggregating(
        self, q: Float[Tensor, "batch pos head d_head"], k: Float[Tensor, "batch pos kv_head d_head"]
    ) -> None:
        """See the queries and keys the aggregation runs on (after RoPE and its hooks); nothing by default."""

    def logits(self, scores: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch head query key"]:
        """The logits the normaliser sees, from scaled, causally masked (``-inf``) dot products."""
        return scores

    def normalize(self, scores: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch head query key"]:
        """Softmax; ``-inf`` logits get weight 0, and an all-``-inf`` row (a hook's doing) all zeros, not NaN."""
        pattern = F.softmax(scores, dim=-1)
        return torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)

    def transform_z(
        self, z: Float[Tensor, "batch pos head d_head"], x: Float[Tensor, "batch pos d_model"], attn: nn.Module
    ) -> Float[Tensor, "batch pos head d_head"]:
        """Transform the aggregated head outputs before ``W_O`` (identity by default)."""
        return z

    def output_gain(self) -> Float[Tensor, "head d_head"] | None:
        """``γ`` when :meth:`transform_z` is ``c[b, t, h] · (γ[h] ⊙ z[b, t, h])`` (ones by default), float32 on the
        CPU; None otherwise (an element-wise gate). Analyzers then split a head's output into per-key writes."""
        return torch.ones(self.n_heads, self.d_head)


class Baseline(AttentionVariant):
    """Causal softmax attention."""


class HeadwiseRMSNorm(AttentionVariant):
    """Head-wise RMSNorm: ``z_normed[t, h] = g_h ⊙ z[t, h] / sqrt(mean_d z[t, h, d]² + eps)`` before ``W_O``, at
    ``attn.hook_z_normed``. As ``HeadRMSNorm`` in Siquan-Li/Head-wise-RMSNorm: gain ``[n_heads, d_head]``
    (``gain="per_head"``) or ``[d_head]`` (``"shared"``); ``init="first_token"`` calibrates it with their formula,
    averaged over 8 draws (:func:`sinklens.sinklm.model.calibrate_headwise_gains`), ``"ones"`` leaves 1. Unlike the
    authors, the gain is never weight-decayed."""

    hook_sites = ("hook_z_normed",)
    output_site = "hook_z_normed"
    defaults: ClassVar[dict[str, Any]] = {"gain": "per_head", "init": "first_token", "eps": 1e-6}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        per_head = choice(self.options["gain"], ("per_head", "shared"), what="headwise_rms gain") == "per_head"
        choice(self.options["init"], ("first_token", "ones"), what="headwise_rms init")
        self.gain = nn.Parameter(torch.ones((self.n_heads, self.d_head) if per_head else (self.d_head,)))
        self.gain._no_weight_decay = True  # type: ignore[attr-defined]

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        return attn.hook_z_normed(rms_norm(z, self.gain, self.options["eps"]))

    def output_gain(self) -> Tensor:
        """The gain, ``[n_heads, d_head]`` (a shared one repeated per head); ``c = 1 / rms(z)``."""
        return self.gain.detach().float().cpu().expand(self.n_heads, self.d_head).clone()


class Gated(AttentionVariant):
    """Gated attention (Qiu et al. 2025, position G1): ``z'[t, h] = z[t, h] ⊙ sigmoid(x[t] W_G[h])``, x the ln1 output.
    ``granularity="elementwise"``: ``W_G [n_heads, d_model, d_head]``; ``"headwise"``: ``[n_heads, d_model]``.
    No bias. Hooks ``attn.hook_gate`` (the sigmoid) and ``attn.hook_z_gated``."""

    hook_sites = ("hook_gate", "hook_z_gated")
    output_site = "hook_z_gated"
    defaults: ClassVar[dict[str, Any]] = {"granularity": "elementwise"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        granularity = choice(self.options["granularity"], ("elementwise", "headwise"), what="gated granularity")
        headwise = granularity == "headwise"
        shape = (self.n_heads, self.d_model) if headwise else (self.n_heads, self.d_model, self.d_head)
        self.W_G = nn.Parameter(torch.empty(shape))
        nn.init.normal_(self.W_G, std=self.init_std)

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        spec = "bpd,hdk->bphk" if self.W_G.ndim == 3 else "bpd,hd->bph"
        gate = attn.hook_gate(torch.sigmoid(torch.einsum(spec, x, self.W_G.to(x.dtype))))
        return attn.hook_z_gated(z * (gate if gate.ndim == 4 else gate[..., None]))

    def output_gain(self) -> Tensor | None:
        """Ones for a head-wise gate (``c`` is the gate); None for an element-wise one."""
        return None if self.W_G.ndim == 3 else super().output_gain()


class QKNorm(AttentionVariant):
    """RMSNorm of every query and key head over ``d_head`` before RoPE, gains ``[d_head]`` shared by heads
    (OLMo-2, Qwen3); at ``attn.hook_q_normed``/``hook_k_normed``."""

    hook_sites = ("hook_q_normed", "hook_k_normed")
    defaults: ClassVar[dict[str, Any]] = {"eps": 1e-6}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        self.q_gain, self.k_gain = nn.Parameter(torch.ones(self.d_head)), nn.Parameter(torch.ones(self.d_head))

    def transform_qk(self, q: Tensor, k: Tensor, attn: nn.Module) -> tuple[Tensor, Tensor]:
        eps = self.options["eps"]
        return attn.hook_q_normed(rms_norm(q, self.q_gain, eps)), attn.hook_k_normed(rms_norm(k, self.k_gain, eps))


class SigmoidAttention(AttentionVariant):
    """Sigmoid attention: ``pattern[q, k] = sigmoid(q·k/sqrt(d_head) + b)`` for ``k <= q``, else 0 (rows unnormalised).
    ``bias="neg_log_n"``: ``b = -log(n_ctx)`` (Ramapuram et al. 2024); a number sets ``b``. ``b`` is in
    ``hook_attn_scores``."""

    uses_sdpa = False
    defaults: ClassVar[dict[str, Any]] = {"bias": "neg_log_n"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        bias = self.options["bias"]
        if bias != "neg_log_n" and (isinstance(bias, bool) or not isinstance(bias, (int, float))):
            raise InvalidArgumentError(f"sigmoid bias must be 'neg_log_n' or a number, got {bias!r}.")
        self.bias = -math.log(self.n_ctx) if bias == "neg_log_n" else float(bias)

    def logits(self, scores: Tensor) -> Tensor:
        return scores + self.bias

    def normalize(self, scores: Tensor) -> Tensor:
        return torch.sigmoid(at_least_float32(scores)).to(scores.dtype)  # sigmoid(-inf) = 0 masks


class SinkLogit(AttentionVariant):
    """Softmax with one learnable logit ``s_h`` per head in an extra, value-less key column (gpt-oss "sinks").
    ``pattern[q, k] = exp(x_qk) / (exp(s_h) + Σ_{k' <= q} exp(x_qk'))``: rows sum to less than 1; ``s_h = 0``
    is the off-by-one softmax. The hooks hold the real keys only; ``sink`` starts at ``init`` (0.0)."""

    uses_sdpa = False
    defaults: ClassVar[dict[str, Any]] = {"init": 0.0}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        self.sink = nn.Parameter(torch.full((self.n_heads,), float(self.options["init"])))
        self.sink._no_weight_decay = True  # type: ignore[attr-defined]

    def normalize(self, scores: Tensor) -> Tensor:
        b, h, q, _ = scores.shape
        sink = self.sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, q, 1)
        return F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


class Softpick(AttentionVariant):
    """Softpick (Zuhri et al. 2025): ``ReLU(e^x - 1) / (Σ_window |e^x - 1| + eps)`` over the finite logits, in the
    authors' stable form (both sides times ``e^{-m}``, ``m`` the detached row max clamped at 0), so the function is
    ``ReLU(e^x - 1) / (Σ |e^x - 1| + eps · e^{max(m, 0)})``, with ``expm1`` near 0. Rows sum to ≤ 1."""

    uses_sdpa = False
    defaults: ClassVar[dict[str, Any]] = {"eps": 1e-6}

    def normalize(self, scores: Tensor) -> Tensor:
        x = at_least_float32(scores)
        window = torch.isfinite(x)
        x = torch.where(window, x, torch.zeros_like(x))  # keep inf out of both branches (NaN-free grads)
        m = torch.where(window, x, torch.full_like(x, -torch.inf)).amax(dim=-1, keepdim=True).clamp(min=0.0).detach()
        positive = -torch.exp(x - m) * torch.expm1(-x.clamp(min=0.0))
        negative = torch.exp(-m) * torch.expm1(x.clamp(max=0.0))
        shifted = torch.where(window, torch.where(x >= 0, positive, negative), torch.zeros_like(x))
        pattern = F.relu(shifted) / (shifted.abs().sum(dim=-1, keepdim=True) + self.options["eps"])
        return pattern.to(scores.dtype)


_VARIANTS: dict[str, type[AttentionVariant]] = {}


def register_attention_variant(name: str, cls: type[AttentionVariant]) -> type[AttentionVariant]:
    """Register an :class:`AttentionVariant` subclass under ``name``; raises ``ValueError`` if taken."""
    if name in _VARIANTS:
        raise ValueError(f"Attention variant {name!r} is already registered ({_VARIANTS[name].__name__}); pick "
                         "another name.")
    if not (isinstance(cls, type) and issubclass(cls, AttentionVariant)):
        raise TypeError(f"An attention variant must subclass AttentionVariant, got {cls!r}.")
    _VARIANTS[name] = cls
    return cls


def get_attention_variant(name: str) -> type[AttentionVariant]:
    """The variant class registered under ``name``; InvalidArgumentError listing the known names otherwise."""
    try:
        return _VARIANTS[name]
    except KeyError:
        raise InvalidArgumentError(f"Unknown attention variant {name!r}{did_you_mean(name, _VARIANTS)}; known variants "
                                   f"are {sorted(_VARIANTS)}.") from None


def attention_variants() -> list[str]:
    """Names of all registered attention variants."""
    return sorted(_VARIANTS)


class VarianceCalibrated(AttentionVariant):
    """Variance-calibrated softmax attention: each head's output ``z_t`` times a per-position factor, at
    ``attn.hook_z_calibrated``. Aggregation scales a head output's variance by ``s_t = Σ_j A_tj²`` (``1/(t+1)`` under
    uniform causal attention: the positional discrepancy of *Transformers Are Born Biased*, arXiv 2602.05927). The
    paper publishes no code; our causal modes each make ``Var(z_t)`` position-independent under uniform attention:
    ``amplify`` ``1/sqrt(s_t)``; ``attenuate`` ``sqrt(s_ref/s_t)``, ``s_ref = 1/n_ctx``; ``position_amplify``
    ``sqrt(t+1)``; ``position_attenuate`` ``sqrt((t+1)/n_ctx)``. ``s_t`` comes from the pattern, or on the SDPA
    path from ``exp(LSE(2x) - 2 LSE(x))`` of the logits."""

    hook_sites = ("hook_z_calibrated",)
    output_site = "hook_z_calibrated"
    defaults: ClassVar[dict[str, Any]] = {"mode": "amplify"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        modes = ("amplify", "attenuate", "position_amplify", "position_attenuate")
        self.mode = choice(self.options["mode"], modes, what="variance_calibrated mode")
        self._qk: tuple[Tensor, Tensor] | None = None
        self._sumsq: Tensor | None = None

    def aggregating(self, q: Tensor, k: Tensor) -> None:
        self._qk = (q, k) if self.mode in ("amplify", "attenuate") else None

    def normalize(self, scores: Tensor) -> Tensor:
        pattern = super().normalize(scores)
        if self.mode in ("amplify", "attenuate"):
            self._sumsq = at_least_float32(pattern).pow(2).sum(dim=-1)  # (B, nh, T)
        return pattern

    def _sumsq_from_logits(self) -> Tensor:
        q, k = self._qk  # (B, T, nh, hs): those the aggregation ran on (after RoPE and hook_rot_q/k edits)
        q, k = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
        x = (at_least_float32(q) @ at_least_float32(k).transpose(-2, -1)) / math.sqrt(self.d_head)  # (B, nh, T, T)
        T = x.shape[-1]
        x = x.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return torch.exp(torch.logsumexp(2 * x, dim=-1) - 2 * torch.logsumexp(x, dim=-1))

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        """``z`` times this forward's factor (see the modes above), computed in at least float32."""
        if self.mode.startswith("position_"):
            f = torch.arange(1, z.shape[1] + 1, device=z.device, dtype=torch.promote_types(z.dtype, torch.float32)).sqrt()
            f = (f / math.sqrt(self.n_ctx) if self.mode == "position_attenuate" else f)[None, :, None, None]
        else:
            s = self._sumsq if self._sumsq is not None else self._sumsq_from_logits()
            f = torch.where(s > 0, s, torch.ones_like(s)).rsqrt().transpose(1, 2)[..., None]  # (B, T, nh, 1)
            f = f / math.sqrt(self.n_ctx) if self.mode == "attenuate" else f
        self._sumsq, self._qk = None, None
        return attn.hook_z_calibrated(z * f.to(z.dtype))


for _name, _cls in [("baseline", Baseline), ("headwise_rms", HeadwiseRMSNorm), ("gated", Gated),
                    ("qk_norm", QKNorm), ("sigmoid", SigmoidAttention), ("sink_logit", SinkLogit),
                    ("softpick", Softpick), ("variance_calibrated", VarianceCalibrated)]:
    register_attention_variant(_name, _cls)
