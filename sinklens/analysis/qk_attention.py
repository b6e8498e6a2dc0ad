"""Exact attention weights ``exp(s_qk - lse_q)`` from queries and keys (the model's scaled, soft-capped scores; any
sink logit in ``lse_q``), a chunk of queries at a time: memory linear in the length. Rotated q/k come from
``hook_rot_q``/``hook_rot_k``, or are rotated here from ``hook_cos``/``hook_sin`` (GPT-NeoX bridges)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from sinklens.analysis._common import run_analyzer
from sinklens.display import CompactRepr
from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import K, Q, ROT_K, ROT_Q, expand_kv_heads, hook_name, model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import ATTENTION_METHODS, AttentionMethod, HookFn, RunOptions
from sinklens.probes import silent_hooks
from sinklens.streaming import BatchFold, Reducer, bound_hooks, grow
from sinklens.validate import choice, index_list
from sinklens.visibility import Visibility, attention_visibility

COS, SIN = "attn.hook_cos", "attn.hook_sin"
#: Scores per chunk (all heads and sequences of a batch): 2**24 floats, 64 MiB (at least 64 queries a chunk).
CHUNK_SCORES = 2**24
#: On the CPU at most 2**21 (8 MiB), which stays in cache: twice as fast as 2**24 at 2k tokens (RESULTS.md).
CPU_CHUNK_SCORES = 2**21
#: ``method="auto"`` reads attention from queries and keys for batches longer than this (tokens).
QK_ABOVE = 1024


def query_chunk(batch: int, n_heads: int, n_keys: int, device: torch.device) -> int:
    """Queries per chunk: :data:`CHUNK_SCORES` scores (:data:`CPU_CHUNK_SCORES` on the CPU), at least 64 queries."""
    budget = min(CHUNK_SCORES, CPU_CHUNK_SCORES) if device.type == "cpu" else CHUNK_SCORES
    return max(64, budget // (batch * n_heads * n_keys))


@dataclass(repr=False, eq=False)
class ScoreRule(CompactRepr):
    """How one layer turns a query and a key into a score: ``s = cap·tanh(scale·q·k / cap)`` (no cap: ``scale·q·k``),
    and the per-head learned sink logit that joins the softmax as a key without a value (None: none)."""

    scale: float
    soft_cap: float | None = None
    sink_logits: Tensor | None = None


def qk_sites(model: Any) -> tuple[str, ...]:
    """The per-layer sites the q/k path reads: rotated q/k where they run, else q/k plus the rotary tables, or q/k
    without rotary; an :class:`UnsupportedArchitectureError` for ALiBi or unreadable rotated queries and keys."""
    if getattr(model.cfg, "positional_embedding_type", None) == "alibi":
        raise UnsupportedArchitectureError("ALiBi adds position biases to the scores after the queries and keys; the "
                                           "q/k path cannot read them. Use method='pattern'.")
    rot = [hook_name(0, ROT_Q), hook_name(0, ROT_K)]
    if all(n in model.hook_dict for n in rot) and not silent_hooks(model, rot):
        return ROT_Q, ROT_K
    if getattr(model.cfg, "positional_embedding_type", "standard") != "rotary":
        return Q, K
    tables = [hook_name(0, COS), hook_name(0, SIN)]
    if all(n in model.hook_dict for n in tables) and not silent_hooks(model, tables):
        return Q, K, COS, SIN
    raise UnsupportedArchitectureError("The q/k path needs attn.hook_rot_q/hook_rot_k or the rotary tables "
                                       "(attn.hook_cos/hook_sin); this model runs neither. Use method='pattern'.")


def score_rule(model: Any, layer: int) -> ScoreRule:
    """The :class:`ScoreRule` of ``layer`` (from a bridge's Hugging Face module, a sinklens variant or TransformerLens'
    ``attn_scale``); an :class:`UnsupportedArchitectureError` where attention is no softmax of the hooked q/k scores."""
    attn = model.blocks[layer].attn
    hf = getattr(attn, "original_component", None)
    hf = getattr(hf, "self", hf)  # BERT keeps its scores in BertAttention.self
    if hf is not None and hasattr(hf, "scaling"):
        cap = getattr(hf, "attn_logit_softcapping", None)
        sinks = getattr(hf, "sinks", None)
        return ScoreRule(float(hf.scaling), float(cap) if cap else None, None if sinks is None else sinks.detach())
    cfg = model.cfg
    variant = getattr(attn, "variant", None)
    if variant is not None:  # a sinklens model
        sink = getattr(variant, "sink", None)
        if not (variant.uses_sdpa or isinstance(sink, Tensor)) or (variant.hook_sites and cfg.family != "llama"):
            raise UnsupportedArchitectureError(f"The q/k path needs softmax attention on the hooked queries and keys; "
                                               f"the attention variant {cfg.variant!r} is not. Use method='pattern'.")
        return ScoreRule(1 / math.sqrt(cfg.d_head), None, None if sink is None else sink.detach())
    if hf is not None:
        raise UnsupportedArchitectureError(f"{type(hf).__name__} has no 'scaling' attribute; use method='pattern'.")
    divisor = float(getattr(attn, "attn_scale", -1.0))  # TransformerLens 3.x: cfg.attn_scale (or 1), by layer if asked
    scale = 1 / divisor if divisor > 0 else 1 / math.sqrt(cfg.d_head)
    cap = getattr(cfg, "attn_scores_soft_cap", -1.0)
    return ScoreRule(scale, float(cap) if cap and cap > 0 else None, None)


def scaled_heads(q: Float[Tensor, "batch pos head d_head"], k: Float[Tensor, "batch pos kv_head d_head"],
                 rule: ScoreRule) -> tuple[Float[Tensor, "batch head pos d_head"], Float[Tensor, "batch head pos d_head"]]:
    """Scaled queries and keys per head (float32, grouped-query keys repeated): ``qh @ khᵀ`` is the raw score."""
    return q.float().transpose(1, 2) * rule.scale, expand_kv_heads(k.float().transpose(1, 2), q.shape[2])


def chunk_scores(qh: Tensor, kh: Tensor, rule: ScoreRule, queries: slice, keys: slice = slice(None)
                 ) -> Float[Tensor, "batch head query key"]:
    """The model's (soft-capped) scores of ``queries``/``keys`` of :func:`scaled_heads`, before any mask."""
    s = qh[:, :, queries] @ kh[:, :, keys].transpose(-1, -2)
    return s if rule.soft_cap is None else s.div_(rule.soft_cap).tanh_().mul_(rule.soft_cap)


def rotate(x: Float[Tensor, "batch pos head d_head"], cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's rotate-half rotary embedding of the first ``cos.shape[-1]`` dims of ``x``; the rest pass."""
    d = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    rot, rest = x[..., :d], x[..., d:]
    half = torch.cat([-rot[..., d // 2:], rot[..., : d // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


@dataclass(repr=False, eq=False)
class Columns(CompactRepr):
    """One layer's attention columns in one batch: ``counted`` / ``every``: ``Σ_q weight[b, h, q, k]`` over the real
    queries ``q >= min_query`` / all that see ``k``, ``n_counted`` / ``n_every`` their number; ``to_keys``:
    ``weight[b, h, q, positions[i]]``; ``unattended``: ``Σ_q (1 - Σ_k weight)`` (sink logits' mass); ``n_keys``:
    keys each query sees; per query ``aggregated``: ``Σ_k weight · values[..., k]``, ``squares``: ``Σ_k weight²``."""

    counted: Float[Tensor, "batch head key"]
    every: Float[Tensor, "batch head key"]
    n_counted: Float[Tensor, "batch key"]
    n_every: Float[Tensor, "batch key"]
    to_keys: Float[Tensor, "batch head query n_positions"]
    unattended: Float[Tensor, " head"]
    n_keys: Float[Tensor, "batch query"]
    aggregated: Float[Tensor, "batch head query m"] | None = None
    squares: Float[Tensor, "batch head query"] | None = None


def attention_columns(
    q: Float[Tensor, "batch pos head d_head"], k: Float[Tensor, "batch pos kv_head d_head"], rule: ScoreRule,
    visibility: Visibility, layer: int, valid: Bool[Tensor, "batch pos"], *, min_query: int = 0,
    positions: Sequence[int] = (), values: Float[Tensor, "batch head key m"] | None = None, squares: bool = False,
) -> Columns:
    """One layer's :class:`Columns` from queries and keys, a chunk of queries at a time (exact float32 softmax
    over each query's visible keys)."""
    b, n, n_heads, _ = q.shape
    dev = q.device
    chunk = query_chunk(b, n_heads, n, dev)
    qh, kh = scaled_heads(q, k, rule)
    pos = torch.arange(n, device=dev)
    w = visibility.window(layer)
    sink = None if rule.sink_logits is None else rule.sink_logits.to(dev, torch.float32)[None, :, None, None]
    zeros = partial(torch.zeros, device=dev)
    out = Columns(zeros(b, n_heads, n), zeros(b, n_heads, n), zeros(b, n), zeros(b, n),
                  zeros(b, n_heads, n, len(positions)), zeros(n_heads), zeros(b, n),
                  None if values is None else zeros(b, n_heads, n, values.shape[-1]),
                  zeros(b, n_heads, n) if squares else None)
    for q0 in range(0, n, chunk):
        q1 = min(n, q0 + chunk)
        k0 = max(0, q0 - w + 1) if w is not None else 0
        k1 = q1 if visibility.causal else (min(n, q1 + w - 1) if w is not None else n)
        see = visibility.block(layer, pos[q0:q1], pos[k0:k1])[None] & valid[:, q0:q1, None] & valid[:, None, k0:k1]
        s = chunk_scores(qh, kh, rule, slice(q0, q1), slice(k0, k1))  # [b, h, chunk, keys]
        s.masked_fill_(~see[:, None], -math.inf)
        top = s.amax(dim=-1, keepdim=True) if sink is None else torch.maximum(s.amax(dim=-1, keepdim=True), sink)
        top.masked_fill_(top == -math.inf, 0.0)  # a padded query sees no key: its row stays 0
        p = s.sub_(top).exp_()  # unnormalised: weight = p / total, never divided out over the whole chunk
        total = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            to_sink = (sink - top).exp()
            total += to_sink
            out.unattended += ((to_sink / total)[..., 0] * valid[:, None, q0:q1]).sum(dim=(0, 2))
        inv = total.clamp_min_(torch.finfo(p.dtype).tiny).reciprocal_()  # [b, h, chunk, 1]
        cols = (inv.transpose(-1, -2) @ p)[:, :, 0]  # Σ over the chunk's queries of the weights, as one matmul
        n_seen = see.sum(dim=1)
        out.n_keys[:, q0:q1] = see.sum(dim=2)
        if values is not None:
            out.aggregated[:, :, q0:q1] = (p @ values[:, :, k0:k1].float()) * inv
        if squares:  # times inv twice, not inv², which overflows where a padded query's row is 0
            out.squares[:, :, q0:q1] = p.square().sum(dim=-1, keepdim=True).mul_(inv).mul_(inv)[..., 0]
        out.every[:, :, k0:k1] += cols
        out.n_every[:, k0:k1] += n_seen
        if q0 < min_query:  # leave out the rows of queries before min_query
            m = min_query - q0
            cols = cols - (p[:, :, :m] * inv[:, :, :m]).sum(dim=2)
            n_seen = n_seen - see[:, :m].sum(dim=1)
        out.counted[:, :, k0:k1] += cols
        out.n_counted[:, k0:k1] += n_seen
        for i, key in enumerate(positions):
            if k0 <= key < k1:
                out.to_keys[:, :, q0:q1, i] = p[..., key - k0] * inv[..., 0]
    return out


def queries_and_keys(acts: dict[str, Tensor], sites: Sequence[str]) -> tuple[Tensor, Tensor]:
    """The rotated queries and keys from the activations at ``sites`` (:func:`qk_sites`)."""
    q, k = acts[sites[0]], acts[sites[1]]
    if COS in acts:
        q, k = rotate(q, acts[COS], acts[SIN]), rotate(k, acts[COS], acts[SIN])
    return q, k


def qk_hooks(sites: Sequence[str], rules: dict[int, ScoreRule], visibility: Visibility,
             valid: Bool[Tensor, "batch pos"], fold: Callable[[Columns, int], None],
             **options: Any) -> list[tuple[str, HookFn]]:
    """Hooks on ``sites`` of every layer in ``rules`` that call ``fold(attention_columns(..., **options), layer)``
    once the layer's queries and keys have run."""
    pending: dict[int, dict[str, Tensor]] = {}

    def collect(act: Tensor, key: tuple[int, str]) -> None:
        layer, site = key
        pending.setdefault(layer, {})[site] = act
        if len(pending[layer]) == len(sites):
            q, k = queries_and_keys(pending.pop(layer), sites)
            fold(attention_columns(q, k, rules[layer], visibility, layer, valid, **options), layer)

    keys = [(layer, site) for layer in rules for site in sites]
    return bound_hooks([hook_name(layer, site) for layer, site in keys], keys, collect)


@dataclass(frozen=True)
class QKPlan:
    """Where a reducer reads attention weights: ``sites`` and ``rules`` of the q/k path (None: ``hook_pattern``
    only), the ``method`` asked for, and ``refused``: why ``"auto"`` falls back to the pattern on this model."""

    method: str
    sites: tuple[str, ...] | None = None
    rules: dict[int, ScoreRule] = field(default_factory=dict)
    refused: str | None = None

    def reads_qk(self, n_pos: int) -> bool:
        """True if a batch of ``n_pos`` tokens is read from queries and keys."""
        return self.sites is not None and (self.method == "qk" or n_pos > QK_ABOVE)

    def describe(self, paths: str) -> str:
        """Where attention was read (``paths``: a :class:`SinkResult`'s ``attention_path``) and why, in one line."""
        if paths == "qk":
            why = "method='qk'" if self.method == "qk" else f"sequences longer than {QK_ABOVE} tokens"
            return f"attention read from queries and keys ({why})"
        if paths != "pattern":
            return f"attention read from queries and keys for batches longer than {QK_ABOVE} tokens, from hook_pattern otherwise"
        why = ("method='pattern'" if self.method == "pattern" else f"the q/k path cannot read this model: {self.refused}"
               if self.refused else f"no sequence longer than {QK_ABOVE} tokens")
        return f"attention read from hook_pattern ({why})"


def qk_plan(model: Any, layers: Sequence[int], method: AttentionMethod) -> QKPlan:
    """The :class:`QKPlan` of ``method``: ``"auto"`` falls back to the pattern where the q/k path cannot read the
    model, ``"qk"`` raises its :class:`UnsupportedArchitectureError`."""
    method = choice(method, ATTENTION_METHODS, what="method")
    if method == "pattern":
        return QKPlan(method)
    try:
        return QKPlan(method, qk_sites(model), {layer: score_rule(model, layer) for layer in layers})
    except UnsupportedArchitectureError as e:
        if method == "qk":
            raise
        return QKPlan(method, refused=str(e))


def attention_parts(model: Any, layers: int | Sequence[int] | None, method: AttentionMethod
                    ) -> tuple[list[int], dict[int, int], QKPlan, Visibility, torch.device]:
    """An attention reducer's resolved ``layers``, their rows, its :class:`QKPlan`, the visibility and the device."""
    layers = resolve_layers(layers, model_dims(model).n_layers)
    rows = {layer: i for i, layer in enumerate(layers)}
    return layers, rows, qk_plan(model, layers, method), attention_visibility(model), model_device(model)


class KeyAttentionReducer(Reducer[Tensor]):
    """Streams queries and keys into the attention every query pays the keys at ``positions``."""

    statistics = ("weights",)

    def __init__(self, model: Any, *, positions: Sequence[int] = (0,), layers: int | Sequence[int] | None = None):
        self.positions = index_list(positions, model_dims(model).n_ctx, what="position", allow_negative=False)
        self.layers, _, self.plan, self.visibility, _ = attention_parts(model, layers, "qk")
        self.reset()

    def reset(self) -> None:
        self.weights: list[Tensor] = []

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        out: dict[int, Tensor] = {}
        hooks = qk_hooks(self.plan.sites, self.plan.rules, self.visibility, batch.valid,
                         lambda cols, layer: out.update({layer: cols.to_keys}), positions=self.positions)
        return BatchFold(hooks, state=out)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        w = torch.stack([fold.state[layer] for layer in self.layers])  # [layer, batch, head, query, position]
        self.weights.append(w.masked_fill(~batch.valid[None, :, None, :, None], math.nan))

    def result(self) -> Tensor:
        n = max((w.shape[3] for w in self.weights), default=0)
        return torch.cat([grow(w, 3, n, math.nan) for w in self.weights], dim=1).cpu()


def attention_to_keys(model: Any, inputs: Inputs | None = None, *, positions: Sequence[int] = (0,),
                      layers: int | Sequence[int] | None = None,
                      options: RunOptions = RunOptions()) -> Float[Tensor, "layer sequence head query position"]:
    """``hook_pattern[..., q, positions]`` per layer, sequence and head, from queries and keys: 0 where the query
    cannot see the key, NaN at padded queries.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> w = attention_to_keys(tiny_model(), "t5 t6 t7", positions=[0, 1], options=RunOptions(progress=False))
        >>> w.shape, float(w[0, 0, 0, 0, 0])  # layer, sequence, head, query (BOS + 3 words), key; query 0 sees only key 0
        (torch.Size([2, 1, 4, 4, 2]), 1.0)
    """
    return run_analyzer(model, inputs, KeyAttentionReducer, where="attention_to_keys", options=options,
                        positions=positions, layers=layers)
