"""Attention variants of :class:`sinklens.sinklm.model.SinkLM`, one small class each, picked by name.

A variant changes one or more of four steps of a head's computation, which
:class:`sinklens.sinklm.model.Attention` runs in this order::

    q, k = variant.transform_qk(q, k)            # after hook_q/hook_k, before RoPE (qk_norm)
    scores = variant.logits(q·k / sqrt(d_head))  # causal mask = -inf, then hook_attn_scores
    pattern = variant.normalize(scores)          # softmax / sigmoid / softpick ..., then hook_pattern
    z = pattern @ v                              # hook_z: the raw value aggregation
    z = variant.transform_z(z, x)                # headwise_rms / gated, at the variant's own hook
    attn_out = z @ W_O

A variant with ``uses_sdpa = True`` is plain softmax attention in its middle two steps, so the model
may replace them by ``F.scaled_dot_product_attention`` (flash kernels on GPU) whenever nothing is
hooked on ``hook_attn_scores``/``hook_pattern``; the two paths compute the same function (tested).

Registered variants (``ModelConfig.variant``; options in ``ModelConfig.variant_options``):

========================  ==================================================================
``baseline``              softmax attention.
``headwise_rms``          RMSNorm of each head's output ``z[t, h]`` over ``d_head``, with a learnable
                          gain, before ``W_O`` (head-wise RMSNorm / "HeadNorm"). Hook ``attn.hook_z_normed``.
``gated``                 ``z * sigmoid(x W_G)``, x = the attention input (after ln1); head-wise
                          (one gate per head) or element-wise (Qiu et al. 2025). Hooks ``attn.hook_gate``,
                          ``attn.hook_z_gated``.
``qk_norm``               RMSNorm of q and k per head over ``d_head`` (gain shared across heads), before
                          RoPE. Hooks ``attn.hook_q_normed``, ``attn.hook_k_normed``.
``sigmoid``               ``pattern = sigmoid(q·k/sqrt(d) + b)``, causal, unnormalised (Ramapuram et al. 2024).
``sink_logit``            softmax over the keys plus one learnable per-head logit whose column is dropped
                          (gpt-oss "sinks", off-by-one softmax when the logit is 0): rows sum to < 1.
``softpick``              ``ReLU(e^x - 1) / (Σ_window |e^x - 1| + eps)`` (Zuhri et al. 2025): rows sum to
                          ≤ 1 and may be all zero.
========================  ==================================================================

Add your own with :func:`register_attention_variant`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from sinklens.errors import InvalidArgumentError
from sinklens.validate import did_you_mean, finite_number


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in the dtype its norms, softmaxes and sums run in: float32, or float64 for a float64 model."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(
    x: Float[Tensor, "*batch d"], w: Float[Tensor, "*w_shape"] | None, eps: float
) -> Float[Tensor, "*batch d"]:
    """``w ⊙ x / sqrt(mean(x², -1) + eps)`` over the last axis, computed in float32 and cast back to ``x``'s
    dtype before the gain ``w`` (None: no gain, else broadcast against the trailing axes) multiplies it.

    Examples:
        >>> rms_norm(torch.tensor([[3.0, 4.0]]), None, 0.0)  # rms of (3, 4) is sqrt(12.5)
        tensor([[0.8485, 1.1314]])
    """
    xf = at_least_float32(x)
    if hasattr(F, "rms_norm"):  # torch >= 2.4
        normed = F.rms_norm(xf, xf.shape[-1:], None, eps)
    else:
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.to(x.dtype)
    return normed if w is None else normed * w.to(x.dtype)


class AttentionVariant(nn.Module):
    """Base class of an attention variant; by itself it is softmax attention (``baseline``).

    Class attributes:
        uses_sdpa: the variant's scores → pattern step is causal softmax of ``q·k/sqrt(d_head)``,
            so the fused ``F.scaled_dot_product_attention`` may replace it.
        hook_sites: names of extra ``HookPoint`` s the attention module creates for this variant
            (e.g. ``"hook_z_normed"`` → ``blocks.{l}.attn.hook_z_normed``).
        output_site: the attention hook holding the head outputs that enter ``W_O``; :meth:`output_gain` says
            whether that output is a scalar per token and head times a fixed gain.
        defaults: accepted ``variant_options`` and their default values.
    """

    uses_sdpa: ClassVar[bool] = True
    hook_sites: ClassVar[tuple[str, ...]] = ()
    output_site: ClassVar[str] = "hook_z"
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *, n_heads: int, d_head: int, d_model: int, n_ctx: int, init_std: float = 0.02, **options: Any) -> None:
        super().__init__()
        self.check_options(options)
        self.options = {**self.defaults, **options}
        if "eps" in self.options:  # every variant's eps is a denominator guard: a positive number
            self.options["eps"] = finite_number(
                self.options["eps"], what=f"attention variant {type(self).__name__} option eps", low=0.0, low_open=True
            )
        self.n_heads, self.d_head, self.d_model, self.n_ctx, self.init_std = n_heads, d_head, d_model, n_ctx, init_std

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``options`` names an option this variant does not take."""
        unknown = sorted(set(options) - set(cls.defaults))
        if unknown:
            raise InvalidArgumentError(
                f"Unknown option(s) {unknown} for attention variant {cls.__name__}; accepted options "
                f"(with defaults) are {cls.defaults or 'none'}."
            )

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
        """``γ`` when :meth:`transform_z` is ``c[b, t, h] · (γ[h] ⊙ z[b, t, h])``: one scalar per token and head
        times a fixed gain (ones by default; the head-wise RMSNorm's gain), float32 on the CPU. None when the
        transform is not of that form (an element-wise gate). A head's output is then linear in the values at a
        fixed token, so analyzers can split it into per-key writes (value drain) with ``c`` read from
        ``attn.hook_z`` and the output site."""
        return torch.ones(self.n_heads, self.d_head)


class Baseline(AttentionVariant):
    """Causal softmax attention."""


class HeadwiseRMSNorm(AttentionVariant):
    """Head-wise RMSNorm: ``z_normed[t, h] = g_h ⊙ z[t, h] / sqrt(mean_d z[t, h, d]² + eps)``.

    As the method's authors define it (``HeadRMSNorm`` in Siquan-Li/Head-wise-RMSNorm): RMS over ``d_head``
    of each head's output before ``W_O``, eps 1e-6, a learnable gain ``[n_heads, d_head]`` (``gain="per_head"``)
    or ``[d_head]`` (``"shared"``). ``init="first_token"`` (default) calibrates the gain with their formula
    (the first token's output std on a standard-normal input), averaged over 8 seeded draws
    (:func:`sinklens.sinklm.model.calibrate_headwise_gains`); ``init="ones"`` leaves it at 1. The raw
    aggregation stays at ``attn.hook_z``, the normalised output is at ``attn.hook_z_normed``. Unlike the
    authors, :meth:`SinkLM.param_groups` never decays the gain.
    """

    hook_sites = ("hook_z_normed",)
    output_site = "hook_z_normed"
    defaults: ClassVar[dict[str, Any]] = {"gain": "per_head", "init": "first_token", "eps": 1e-6}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        if self.options["gain"] not in ("per_head", "shared"):
            raise InvalidArgumentError(f"headwise_rms gain must be 'per_head' or 'shared', got {self.options['gain']!r}.")
        if self.options["init"] not in ("first_token", "ones"):
            raise InvalidArgumentError(f"headwise_rms init must be 'first_token' or 'ones', got {self.options['init']!r}.")
        shape = (self.n_heads, self.d_head) if self.options["gain"] == "per_head" else (self.d_head,)
        self.gain = nn.Parameter(torch.ones(shape))
        self.gain._no_weight_decay = True  # type: ignore[attr-defined]

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        return attn.hook_z_normed(rms_norm(z, self.gain, self.options["eps"]))

    def output_gain(self) -> Tensor:
        """The gain, ``[n_heads, d_head]`` (a shared one repeated per head); ``c = 1 / rms(z)``."""
        return self.gain.detach().float().cpu().expand(self.n_heads, self.d_head).clone()


class Gated(AttentionVariant):
    """Gated attention (Qiu et al. 2025): ``z'[t, h] = z[t, h] ⊙ sigmoid(x[t] W_G[h])``.

    ``x`` is the attention input (the ln1 output, the same hidden state the q/k/v projections
    read); the gate multiplies the aggregated head output before ``W_O`` (the paper's best
    position, G1). ``granularity="elementwise"`` (default): ``W_G [n_heads, d_model, d_head]``, one
    gate per head dimension; ``"headwise"``: ``W_G [n_heads, d_model]``, one scalar per head.
    No bias. Hooks: ``attn.hook_gate`` (sigmoid output, ``[batch, pos, head, d_head]`` or
    ``[batch, pos, head]``) and ``attn.hook_z_gated`` (gated head output).
    """

    hook_sites = ("hook_gate", "hook_z_gated")
    output_site = "hook_z_gated"
    defaults: ClassVar[dict[str, Any]] = {"granularity": "elementwise"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        granularity = self.options["granularity"]
        if granularity == "elementwise":
            self.W_G = nn.Parameter(torch.empty(self.n_heads, self.d_model, self.d_head))
        elif granularity == "headwise":
            self.W_G = nn.Parameter(torch.empty(self.n_heads, self.d_model))
        else:
            raise InvalidArgumentError(f"gated granularity must be 'elementwise' or 'headwise', got {granularity!r}.")
        nn.init.normal_(self.W_G, std=self.init_std)

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        if self.W_G.ndim == 3:
            gate = attn.hook_gate(torch.sigmoid(torch.einsum("bpd,hdk->bphk", x, self.W_G.to(x.dtype))))
            return attn.hook_z_gated(z * gate)
        gate = attn.hook_gate(torch.sigmoid(torch.einsum("bpd,hd->bph", x, self.W_G.to(x.dtype))))
        return attn.hook_z_gated(z * gate[..., None])

    def output_gain(self) -> Tensor | None:
        """Ones for a head-wise gate (``c`` is the gate); None for an element-wise one."""
        return None if self.W_G.ndim == 3 else super().output_gain()


class QKNorm(AttentionVariant):
    """RMSNorm of every query and key head over ``d_head`` before RoPE, gains ``[d_head]`` shared by heads.

    As in OLMo-2 / Qwen3. The raw projections stay at ``attn.hook_q``/``hook_k``; the normalised
    ones are at ``attn.hook_q_normed``/``hook_k_normed`` (RoPE'd ones at ``hook_rot_q/k`` for llama).
    """

    hook_sites = ("hook_q_normed", "hook_k_normed")
    defaults: ClassVar[dict[str, Any]] = {"eps": 1e-6}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        self.q_gain = nn.Parameter(torch.ones(self.d_head))
        self.k_gain = nn.Parameter(torch.ones(self.d_head))

    def transform_qk(self, q: Tensor, k: Tensor, attn: nn.Module) -> tuple[Tensor, Tensor]:
        eps = self.options["eps"]
        q = attn.hook_q_normed(rms_norm(q, self.q_gain, eps))
        k = attn.hook_k_normed(rms_norm(k, self.k_gain, eps))
        return q, k


class SigmoidAttention(AttentionVariant):
    """Sigmoid attention: ``pattern[q, k] = sigmoid(q·k/sqrt(d_head) + b)`` for ``k <= q``, else 0.

    Unnormalised (rows need not sum to 1). ``bias="neg_log_n"`` (default) uses ``b = -log(n)``
    with ``n = n_ctx``, the training sequence length, as recommended by Ramapuram et al. 2024
    ("Theory, analysis, and best practices for sigmoid self-attention", b ≈ -log n keeps the
    initial attention norm near softmax's); a number sets ``b`` directly (``0.0`` is the sigmoid
    baseline of the head-wise RMSNorm authors). ``b`` is included in ``hook_attn_scores``.
    """

    uses_sdpa = False
    defaults: ClassVar[dict[str, Any]] = {"bias": "neg_log_n"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        bias = self.options["bias"]
        if bias == "neg_log_n":
            self.bias = -math.log(self.n_ctx)
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool):
            self.bias = float(bias)
        else:
            raise InvalidArgumentError(f"sigmoid bias must be 'neg_log_n' or a number, got {bias!r}.")

    def logits(self, scores: Tensor) -> Tensor:
        return scores + self.bias

    def normalize(self, scores: Tensor) -> Tensor:
        return torch.sigmoid(at_least_float32(scores)).to(scores.dtype)  # sigmoid(-inf) = 0 masks


class SinkLogit(AttentionVariant):
    """Softmax with one learnable logit ``s_h`` per head in an extra, value-less key column.

    ``pattern[q, k] = exp(x_qk) / (exp(s_h) + Σ_{k' <= q} exp(x_qk'))``: the column absorbs
    ``exp(s_h) / (...)`` of the mass, so rows sum to less than 1 ("attention sinks" in gpt-oss;
    with ``s_h = 0`` fixed this is the off-by-one softmax). ``hook_attn_scores`` and
    ``hook_pattern`` hold the real keys only; the sink logit is the parameter ``sink`` ``[n_heads]``,
    initialised to ``init`` (default 0.0).
    """

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
    """Softpick (Zuhri et al. 2025): ``ReLU(e^x - 1) / (Σ_{window} |e^x - 1| + eps)``.

    The window is the keys with a finite logit (the causal window, minus anything a hook set to
    ``-inf``). As in the authors' stable form, numerator and denominator are multiplied by
    ``e^{-m}`` with ``m`` the (detached) row maximum over the window, here clamped at 0 so nothing
    overflows; the computed function is therefore
    ``ReLU(e^x - 1) / (Σ |e^x - 1| + eps · e^{max(m, 0)})``. ``e^{x-m} - e^{-m}`` is evaluated as
    ``-e^{x-m}·expm1(-x)`` for ``x >= 0`` and ``e^{-m}·expm1(x)`` for ``x < 0`` (no cancellation
    near ``x = 0``). Rows sum to ≤ 1 and are all zero when every logit is ≤ 0.
    """

    uses_sdpa = False
    defaults: ClassVar[dict[str, Any]] = {"eps": 1e-6}

    def normalize(self, scores: Tensor) -> Tensor:
        x = at_least_float32(scores)
        window = torch.isfinite(x)
        x = torch.where(window, x, torch.zeros_like(x))  # keep inf out of both branches (NaN-free grads)
        m = torch.where(window, x, torch.full_like(x, -torch.inf)).amax(dim=-1, keepdim=True)
        m = m.clamp(min=0.0).detach()
        positive = -torch.exp(x - m) * torch.expm1(-x.clamp(min=0.0))
        negative = torch.exp(-m) * torch.expm1(x.clamp(max=0.0))
        shifted = torch.where(window, torch.where(x >= 0, positive, negative), torch.zeros_like(x))
        pattern = F.relu(shifted) / (shifted.abs().sum(dim=-1, keepdim=True) + self.options["eps"])
        return pattern.to(scores.dtype)


_VARIANTS: dict[str, type[AttentionVariant]] = {}


def register_attention_variant(name: str, cls: type[AttentionVariant]) -> type[AttentionVariant]:
    """Register an :class:`AttentionVariant` subclass under ``name``; raises ``ValueError`` if taken.

    Examples:
        >>> class Mine(AttentionVariant):
        ...     pass
        >>> _ = register_attention_variant("doctest_mine", Mine)
        >>> get_attention_variant("doctest_mine") is Mine
        True
        >>> register_attention_variant("baseline", Mine)
        Traceback (most recent call last):
        ...
        ValueError: Attention variant 'baseline' is already registered (Baseline)...
    """
    if name in _VARIANTS:
        raise ValueError(
            f"Attention variant {name!r} is already registered ({_VARIANTS[name].__name__}); pick another name."
        )
    if not (isinstance(cls, type) and issubclass(cls, AttentionVariant)):
        raise TypeError(f"An attention variant must subclass AttentionVariant, got {cls!r}.")
    _VARIANTS[name] = cls
    return cls


def get_attention_variant(name: str) -> type[AttentionVariant]:
    """The variant class registered under ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _VARIANTS[name]
    except KeyError:
        raise InvalidArgumentError(f"Unknown attention variant {name!r}{did_you_mean(name, _VARIANTS)}; known variants "
                                   f"are {sorted(_VARIANTS)}.") from None


def attention_variants() -> list[str]:
    """Names of all registered attention variants."""
    return sorted(_VARIANTS)


for _name, _cls in [
    ("baseline", Baseline),
    ("headwise_rms", HeadwiseRMSNorm),
    ("gated", Gated),
    ("qk_norm", QKNorm),
    ("sigmoid", SigmoidAttention),
    ("sink_logit", SinkLogit),
    ("softpick", Softpick),
]:
    register_attention_variant(_name, _cls)


# --- variance calibration (origins helper, issue 9) ------------------------------------------------
CalibrationMode = Literal["amplify", "attenuate", "position_amplify", "position_attenuate"]
CALIBRATION_MODES: tuple[str, ...] = ("amplify", "attenuate", "position_amplify", "position_attenuate")


class VarianceCalibrated(AttentionVariant):
    """Variance-calibrated softmax attention: each head's output ``z_t`` times a per-position factor.

    Aggregation shrinks a head output's variance by ``s_t = Σ_j A_tj²`` (for values of variance σ²,
    independent across positions: ``Var(z_t) = σ² s_t``; ``s_t = 1/(t+1)`` under uniform causal
    attention and always 1 at ``t = 0``, which is the positional discrepancy of *Transformers Are
    Born Biased*, arXiv 2602.05927). The paper names calibration strategies that amplify or
    attenuate by position but publishes no code; the four modes (option ``mode``) are our
    definitions from that law, each causal (the factor at ``t`` depends only on positions ``≤ t``)
    and each making ``Var(z_t)`` position-independent under uniform attention:

    ==========================  ==========================================  ============================
    mode                        factor at query ``t`` (per batch row, head)  variance under uniform attn
    ==========================  ==========================================  ============================
    ``amplify`` (default)       ``1 / sqrt(s_t)``                            σ² (the first token's)
    ``attenuate``               ``sqrt(s_ref / s_t)``, ``s_ref = 1/n_ctx``   σ²/n_ctx (the last one's)
    ``position_amplify``        ``sqrt(t + 1)``                              σ²
    ``position_attenuate``      ``sqrt((t + 1) / n_ctx)``                    σ²/n_ctx
    ==========================  ==========================================  ============================

    ``attenuate``'s reference is the contraction of the most-aggregated position a causal model can
    have, the last position of a full context under uniform attention (``1/n_ctx``): a constant, so
    no future token leaks in (a per-sequence ``min_t s_t``, as in the post-hoc intervention
    :func:`sinklens.interventions.calibration.variance_calibration`, would read later queries).
    The ``position_*`` modes are data-independent (the law's factor, not the actual pattern's).
    The data-dependent modes leave a head that attends only to one key (``s_t = 1``, e.g. a
    dormant head on BOS) at factor 1 (``amplify``) or ``1/sqrt(n_ctx)`` (``attenuate``), so
    relative to spread attention they *reward* concentrating on one key; the positional modes
    scale a BOS-attending head's output by ``sqrt(t + 1)`` like any other.

    The raw aggregation stays at ``attn.hook_z``; the calibrated output, which enters ``W_O``, is
    at ``attn.hook_z_calibrated``. Explicit path (data-dependent modes): ``s_t`` from the attention
    weights (after ``hook_attn_scores`` edits). Fast path (SDPA for ``z``): ``s_t = exp(LSE_j(2 x_tj)
    − 2 LSE_j(x_tj))`` from the causal logits ``x``, recomputed from this layer's queries and keys
    (so it still builds the ``T × T`` logits, but no pattern), from the queries and keys the aggregation
    runs on, so edits at ``hook_rot_q``/``hook_rot_k`` count. The two paths compute the same function (tested).
    """

    hook_sites = ("hook_z_calibrated",)
    output_site = "hook_z_calibrated"
    defaults: ClassVar[dict[str, Any]] = {"mode": "amplify"}

    def __init__(self, **sizes_and_options: Any) -> None:
        super().__init__(**sizes_and_options)
        if self.options["mode"] not in CALIBRATION_MODES:
            raise InvalidArgumentError(
                f"variance_calibrated mode must be one of {list(CALIBRATION_MODES)}, got {self.options['mode']!r}."
            )
        self.mode: str = self.options["mode"]
        self._qk: tuple[Tensor, Tensor] | None = None
        self._sumsq: Tensor | None = None

    def aggregating(self, q: Tensor, k: Tensor) -> None:
        self._qk = (q, k) if self.mode in ("amplify", "attenuate") else None

    def normalize(self, scores: Tensor) -> Tensor:
        pattern = super().normalize(scores)
        if self.mode in ("amplify", "attenuate"):
            self._sumsq = at_least_float32(pattern).pow(2).sum(dim=-1)  # (B, nh, T)
        return pattern

    def _sumsq_from_logits(self, attn: nn.Module) -> Tensor:
        q, k = self._qk  # (B, T, nh, hs): those the aggregation ran on (after RoPE and hook_rot_q/k edits)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        x = (at_least_float32(q) @ at_least_float32(k).transpose(-2, -1)) / math.sqrt(self.d_head)  # (B, nh, T, T)
        T = x.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        x = x.masked_fill(~causal, float("-inf"))
        return torch.exp(torch.logsumexp(2 * x, dim=-1) - 2 * torch.logsumexp(x, dim=-1))

    def factor(self, z: Tensor, attn: nn.Module) -> Float[Tensor, "batch pos head 1"]:
        """The multiplier of ``z`` for this forward (see the table in the class docstring), float32 (float64 for a
        float64 model)."""
        T = z.shape[1]
        if self.mode.startswith("position_"):
            f = torch.arange(1, T + 1, device=z.device, dtype=torch.promote_types(z.dtype, torch.float32)).sqrt()
            if self.mode == "position_attenuate":
                f = f / math.sqrt(self.n_ctx)
            return f[None, :, None, None]
        s = self._sumsq if self._sumsq is not None else self._sumsq_from_logits(attn)
        f = torch.where(s > 0, s, torch.ones_like(s)).rsqrt().transpose(1, 2)[..., None]  # (B, T, nh, 1)
        return f / math.sqrt(self.n_ctx) if self.mode == "attenuate" else f

    def transform_z(self, z: Tensor, x: Tensor, attn: nn.Module) -> Tensor:
        f = self.factor(z, attn)
        self._sumsq, self._qk = None, None
        return attn.hook_z_calibrated(z * f.to(z.dtype))


register_attention_variant("variance_calibrated", VarianceCalibrated)
