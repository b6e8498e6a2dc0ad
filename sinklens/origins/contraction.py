"""Contraction of token representations at init, by sublayer (*Transformers Are Born Biased*, arXiv
2602.05927; no public code, measures defined here). Sites: ``embed``, ``attn l`` (residual right after the
attention write), ``mlp l`` (``hook_resid_post``), ``final``; counted positions: all, or ``>= 1`` after a BOS.
With ``û = h / ‖h‖`` (zero states left out, counted in ``zero_states``): ``inter[t] = mean_{n ≠ m} cos(h[n, t],
h[m, t])``, ``intra = mean_n mean_{t ≠ t'} cos(h[n, t], h[n, t'])``; ``direction``: top eigenvector of
``Σ h hᵀ``, ``direction_stability``: ``|cos|`` of even and odd sequences' directions; ``alignment``:
``cos(final direction, W_U[:, j])``; ``mlp_act_mean``: mean ``f(mlp.hook_pre)`` against ``E[f(z)]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.export import to_json
from sinklens.hooks import MLP_POST, MLP_PRE, RESID_POST, RESID_PRE, hook_name, model_device, model_dims
from sinklens.inputs import TokenBatch
from sinklens.options import RunOptions, settings_from
from sinklens.origins.preference import RandomInputs, stream_random
from sinklens.origins.sites import final_state_site, unembedding
from sinklens.residual_sites import after_attention_hooks
from sinklens.residual_units import moe_reason
from sinklens.streaming import BatchFold, Reducer, merge_statistics

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh,
                **dict.fromkeys(("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), partial(F.gelu, approximate="tanh"))}


def activation_name(model: Any) -> str:
    """The MLP nonlinearity's name from ``cfg.act_fn`` (SinkLM: ``silu`` for llama, ``gelu_new`` for gpt2)."""
    name = getattr(model.cfg, "act_fn", None)
    if name is None and getattr(model.cfg, "family", None) is not None:
        name = "silu" if model.cfg.family == "llama" else "gelu_new"
    return str(name)


def activation_mean_at_zero(name: str) -> float:
    """``E[f(z)]`` for ``z ~ N(0, 1)`` (trapezoid rule, 24001 points on [-12, 12]); NaN for unknown ``f``."""
    if (fn := _ACTIVATIONS.get(name)) is None:
        return float("nan")
    z = torch.linspace(-12, 12, 24001, dtype=torch.float64)
    density = torch.exp(-z * z / 2) / (2 * torch.pi) ** 0.5
    return float(torch.trapezoid(fn(z) * density, z))


@dataclass(repr=False, eq=False)
class SiteStats(CompactRepr):
    """Concentration at one site (module docstring); ``direction_share = λ₁ / trace``,
    ``direction_mean_cos``: cosine of ``direction`` with the mean direction ``Σ h / ‖Σ h‖``."""

    name: str
    inter: Float[Tensor, " pos"]
    inter_mean: float
    intra: float
    direction: Float[Tensor, " d_model"] | None = None
    direction_share: float | None = None
    direction_stability: float | None = None
    direction_mean_cos: float | None = None
    zero_states: int = 0


@dataclass(repr=False, eq=False)
class ContractionResult(CompactRepr):
    """Per-site concentration, sublayer shares, final-direction alignment and MLP asymmetry."""

    sites: list[SiteStats]
    n_layers: int
    alignment: Float[Tensor, " vocab"]
    mlp_post_mean: Float[Tensor, " layer"]
    activation: str | None
    activation_mean_at_zero: float
    n_sequences: int
    prepend_bos: bool
    mlp_skipped: str | None = None
    mlp_act_mean: Float[Tensor, " layer"] | None = None
    gated_mlp: bool = False

    def site(self, name: str) -> SiteStats:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"No site {name!r}; sites are {[s.name for s in self.sites]}.")

    def share(self, key: str = "inter_mean") -> Float[Tensor, "layer 2"]:
        """``[layer, (attn, mlp)]`` change of ``key`` (``"inter_mean"`` or ``"intra"``) across each
        sublayer, divided by the total change from ``embed`` to the last ``mlp`` site."""
        values = torch.tensor([getattr(s, key) for s in self.sites if s.name != "final"], dtype=torch.float64)
        d = (values[1:] - values[:-1]).view(self.n_layers, 2)
        return d / d.sum()

    def alignment_rank(self, token: int) -> int:
        """0-based rank of ``token`` when all tokens are sorted by decreasing alignment."""
        return int((self.alignment > self.alignment[token]).sum())

    def asymmetry_text(self) -> str:
        """One line on the MLP nonlinearity's asymmetry ``E[f(z)]``, or why it was not measured."""
        if self.mlp_skipped is not None:
            return f"MLP asymmetry not measured: {self.mlp_skipped}"
        text = f"{self.activation}: E[f(z)] = {self.activation_mean_at_zero:.3f} for z ~ N(0, 1)"
        if self.mlp_act_mean is not None:
            text += f"; measured mean f({'gate pre-activation' if self.gated_mlp else 'pre'}) by layer " + " ".join(
                f"{float(v):.3g}" for v in self.mlp_act_mean)
        return text

    def summary(self) -> dict[str, Any]:
        """Strict JSON (NaN as None) for ``origins.json``: site statistics, :meth:`share`, the MLP asymmetry."""
        return to_json({
            "sites": [{"site": s.name, "inter": s.inter_mean, "intra": s.intra, "zero_states": s.zero_states,
                       **({"direction_share": s.direction_share, "direction_stability": s.direction_stability,
                           "direction_vs_mean_cos": s.direction_mean_cos} if s.direction is not None else {})}
                      for s in self.sites],
            "share_inter": self.share("inter_mean").tolist(), "share_intra": self.share("intra").tolist(),
            "activation": self.activation, "activation_mean_at_zero": self.activation_mean_at_zero,
            "mlp_act_mean": None if self.mlp_act_mean is None else self.mlp_act_mean.tolist(),
            "mlp_post_mean": self.mlp_post_mean.tolist(), "gated_mlp": self.gated_mlp, "mlp_skipped": self.mlp_skipped,
            "n_sequences": self.n_sequences,
        }, digits=None)

    def to_dict(self) -> dict[str, Any]:
        """:meth:`summary` plus ``inter_by_position``, ``n_layers``, ``prepend_bos`` and ``alignment``."""
        summary = self.summary()
        for row, site in zip(summary["sites"], self.sites):
            row["inter_by_position"] = site.inter
        return to_json({**summary, "n_layers": self.n_layers, "prepend_bos": self.prepend_bos,
                        "alignment": self.alignment}, digits=None)


class _SiteAccumulator:
    """Running sums of one site: ``Σ_n û[n, t]``, non-zero counts, intra-cosine terms, (``directions``) moments."""

    def __init__(self, name: str, seq_len: int, d: int, device: torch.device, directions: bool) -> None:
        self.name, self.directions = name, directions
        zeros = partial(torch.zeros, dtype=torch.float64, device=device)
        self.unit_sum, self.nonzero, self.n = zeros(seq_len, d), zeros(seq_len), 0  # nonzero: k_t
        self.intra_terms, self.intra_count = zeros(()), zeros(())  # intra_count: sequences with k_n >= 2
        if directions:
            self.moments, self.sums = zeros(2, d, d), zeros(2, d)  # even / odd sequences

    def fold(self, h: Tensor, first: int, start_index: int) -> None:  # h: [batch, pos, d]
        raw = h.detach()
        h = raw.double()
        norm = h.norm(dim=-1, keepdim=True)
        u = h / norm.clamp_min(1e-300)  # a zero state stays 0 and is not counted in k
        live = (norm[..., 0] > 0).double()  # [batch, pos]
        self.unit_sum += u.sum(dim=0)
        self.nonzero += live.sum(dim=0)
        k = live[:, first:].sum(dim=1)  # k_n over the counted positions
        pairs = k >= 2
        term = (u[:, first:].sum(dim=1).pow(2).sum(dim=-1) - k) / (k * (k - 1)).clamp_min(1)
        self.intra_terms += term[pairs].sum()
        self.intra_count += pairs.sum()
        self.n += h.shape[0]
        if self.directions:
            hc = raw[:, first:].float()  # float32 products (fast on CPU), float64 running sums
            parity = (torch.arange(h.shape[0], device=h.device) + start_index) % 2
            for half in (0, 1):
                rows = hc[parity == half].reshape(-1, h.shape[-1])
                self.moments[half] += (rows.T @ rows).double()
                self.sums[half] += rows.sum(dim=0).double()

    def merge(self, other: _SiteAccumulator, *, swap_halves: bool = False) -> None:
        """Add ``other``'s sums (later sequences); ``swap_halves``: its even sequences are odd ones overall."""
        for name in ("unit_sum", "nonzero", "intra_terms", "intra_count"):
            getattr(self, name).add_(getattr(other, name).to(self.unit_sum.device))
        self.n += other.n
        if self.directions:
            order = [1, 0] if swap_halves else [0, 1]
            self.moments += other.moments[order].to(self.moments.device)
            self.sums += other.sums[order].to(self.sums.device)

    @staticmethod
    def _top(m: Tensor, s: Tensor) -> tuple[Tensor, float]:
        evals, evecs = torch.linalg.eigh(m)
        v = evecs[:, -1]
        if float(v @ s) < 0:
            v = -v
        return v, float(evals[-1] / evals.clamp_min(0).sum().clamp_min(1e-300))

    def result(self, first: int) -> SiteStats:
        k = self.nonzero
        inter = ((self.unit_sum.pow(2).sum(dim=-1) - k) / (k * (k - 1))).where(k >= 2, float("nan"))
        inter_mean = float(inter[first:].nanmean())  # NaN when no position has a pair
        intra = float(self.intra_terms) / pairs if (pairs := float(self.intra_count)) > 0 else float("nan")
        zero = int(round(self.n * (k.numel() - first) - float(k[first:].sum())))
        stats = SiteStats(self.name, inter.float().cpu(), inter_mean, intra, zero_states=zero)
        if self.directions:
            m, s = self.moments.sum(0), self.sums.sum(0)
            v, share = self._top(m, s)
            (v0, _), (v1, _) = (self._top(self.moments[half], self.sums[half]) for half in (0, 1))
            stats.direction, stats.direction_share = v.float().cpu(), share
            stats.direction_stability = float((v0 @ v1).abs())
            stats.direction_mean_cos = float(v @ (s / s.norm().clamp_min(1e-300)))
        return stats


class ContractionReducer(Reducer[ContractionResult]):
    """Streams :class:`ContractionResult` (one forward per batch; ``d_model²`` moments at direction sites)."""

    statistics = ("acc", "mlp_post", "mlp_act", "mlp_count", "seen")

    def __init__(self, model: Any, seq_len: int, *, prepend_bos: bool = False) -> None:
        dims = model_dims(model)
        self.model, self.dims, self.seq_len, self.prepend_bos = model, dims, seq_len, prepend_bos
        self.first, self.device = (1 if prepend_bos else 0), model_device(model)
        self.final_site, self.finish = final_state_site(model)
        self.mlp_skipped = moe_reason(model)
        # gated (hook_post = f(gate) · up): layer 0 exposes mlp.hook_pre_linear
        self.gated = not self.mlp_skipped and hook_name(0, "mlp.hook_pre_linear") in model.hook_dict
        self.act_fn = _ACTIVATIONS.get(activation_name(model))
        self.mlp_means = bool(dims.d_mlp) and self.mlp_skipped is None and all(
            hook_name(i, MLP_POST) in model.hook_dict for i in range(dims.n_layers))
        self.names = ["embed", *(f"{kind} {i}" for i in range(dims.n_layers) for kind in ("attn", "mlp")), "final"]
        self.reset()

    def reset(self) -> None:
        d = self.dims.d_model
        self.acc = {name: _SiteAccumulator(name, self.seq_len, d, self.device, not name.startswith("attn"))
                    for name in self.names}  # no directions right after attention
        self.mlp_post = torch.zeros(self.dims.n_layers, dtype=torch.float64, device=self.device)
        self.mlp_act = torch.zeros(self.dims.n_layers, dtype=torch.float64, device=self.device)
        self.mlp_count = self.seen = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        start, first, layers = self.seen, self.first, range(self.dims.n_layers)

        def fold(site: str, act: Tensor) -> None:
            self.acc[site].fold(act, first, start)

        def mean_into(out: Tensor, i: int, f: Callable[[Tensor], Tensor] = lambda x: x) -> Callable[..., None]:
            def add(act: Tensor, hook: Any) -> None:
                out[i] += f(act[:, first:].double()).mean(dim=-1).sum()
            return add

        hooks = [(hook_name(0, RESID_PRE), lambda act, hook: fold("embed", act))]
        hooks += [(hook_name(i, RESID_POST), lambda act, hook, i=i: fold(f"mlp {i}", act)) for i in layers]
        hooks += after_attention_hooks(self.model, layers, lambda i, x: fold(f"attn {i}", x))
        hooks.append((self.final_site, lambda act, hook: fold("final", self.finish(act))))
        if self.mlp_means:  # each layer's mean mlp.hook_post, and mean f(mlp.hook_pre) of a gated MLP
            hooks += [(hook_name(i, MLP_POST), mean_into(self.mlp_post, i)) for i in layers]
            if self.gated and self.act_fn is not None:
                hooks += [(hook_name(i, MLP_PRE), mean_into(self.mlp_act, i, self.act_fn)) for i in layers]
        return BatchFold(hooks)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.seen += batch.tokens.shape[0]
        self.mlp_count += batch.tokens.shape[0] * (batch.tokens.shape[1] - self.first)

    def merge(self, other: ContractionReducer) -> None:
        """Sums add; ``other``'s even/odd halves swap after an odd number of sequences (global index)."""
        for name, acc in self.acc.items():
            acc.merge(other.acc[name], swap_halves=self.seen % 2 == 1)
        merge_statistics(self, other, ("mlp_post", "mlp_act", "mlp_count", "seen"))

    def result(self) -> ContractionResult:
        sites = [self.acc[name].result(self.first) for name in self.names]
        w = unembedding(self.model)[0].float().cpu()
        alignment = (sites[-1].direction @ w) / w.norm(dim=0).clamp_min(1e-30)
        act, count, nan = activation_name(self.model), max(self.mlp_count, 1), float("nan")
        asymmetry = activation_mean_at_zero(act)
        mlp_post_mean = (self.mlp_post / count).float().cpu()
        if self.mlp_skipped is not None:  # cfg.act_fn is not the experts' nonlinearity either: no name to report
            asymmetry, act = nan, None
            mlp_post_mean.fill_(nan)
        mlp_act_mean = (self.mlp_act / count).float().cpu() if self.gated else mlp_post_mean.clone()  # f(pre) = post
        if self.gated and self.act_fn is None:  # f(pre) cannot be computed for an unknown f
            mlp_act_mean.fill_(nan)
        return ContractionResult(
            sites=sites, n_layers=self.dims.n_layers, alignment=alignment, mlp_post_mean=mlp_post_mean,
            activation=act, activation_mean_at_zero=asymmetry, n_sequences=self.seen, prepend_bos=self.prepend_bos,
            mlp_skipped=self.mlp_skipped, mlp_act_mean=mlp_act_mean, gated_mlp=self.gated,
        )


def contraction(
    model: Any, random: RandomInputs | None = None, *,
    options: RunOptions = RunOptions(progress=False, desc="contraction"), **random_kwargs: Any,
) -> ContractionResult:
    """Inter- and intra-sequence concentration per sublayer (module docstring) on
    :class:`~sinklens.origins.preference.RandomInputs` (``random``, or its fields as keywords).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> res = contraction(tiny_model(), n_sequences=8, seq_len=4)
        >>> [s.name for s in res.sites]
        ['embed', 'attn 0', 'mlp 0', 'attn 1', 'mlp 1', 'final']
    """
    random = settings_from(RandomInputs, random, random_kwargs, "contraction", argument="random")
    return stream_random(model, random, ContractionReducer(model, random.seq_len, prepend_bos=random.prepend_bos), options)
