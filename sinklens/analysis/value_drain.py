"""Value drain: does a sink head's attention to the sink *write* anything?

A sink head sends most of its attention to one key (the sink). Either the sink's value is (nearly)
zero, so the head parks attention there and writes almost nothing (a **no-op**, Bondarenko et al.
2023's "no update"), or the sink's value carries a signal every query receives (a **broadcast**).
:class:`ValueDrainReducer` tells them apart per layer × head in one streaming pass, from
``blocks.{l}.attn.hook_v``, ``blocks.{l}.attn.hook_pattern`` (or, with ``method="qk"``, the queries and keys:
:mod:`sinklens.analysis.qk_attention`, same numbers in memory linear in the length) and, on post-norm layers, the
post-attention norm's ``hook_scale`` (``ln1_post``; on a post-LN model such as BERT ``ln1``).

**Definitions.** For layer ``l``, query head ``h`` and the sink position ``p`` (``sink_position``):

* the value of key ``k`` seen by head ``h`` is ``v_k = hook_v[b, k, h // r]`` with
  ``r = n_heads / n_kv_heads`` (grouped-query attention, as Hugging Face's ``repeat_kv``);
* the write of key ``k`` into query ``q``, **in residual units**, is the norm of what reaches the
  residual stream through that key::

      write[b, q, k] = A[b, h, q, k] · ‖C(v_k · W_O[l, h]) ⊙ g‖ / s[b, q]

  where ``A`` is ``hook_pattern``; without a post-attention norm ``g = 1``, ``s = 1``; with one
  (Gemma 2/3) ``g`` is its effective gain (:func:`~sinklens.analysis.post_attention.post_attention_gain`)
  and ``s[b, q]`` its ``hook_scale`` at the query; on a post-LN model ``C`` removes the mean over
  ``d_model`` (:func:`~sinklens.analysis.post_attention.post_attention_map`), elsewhere it is the identity.
  On a SinkLM variant that scales the aggregation before ``W_O`` as ``c[q, h] · (γ[h] ⊙ z)``
  (:func:`~sinklens.hooks.head_output_gain`), ``W_O`` becomes ``diag(γ[h]) W_O`` and ``1 / s`` becomes
  ``|c| / s``, with ``c`` read per query from ``hook_z`` and the variant's output site; an element-wise
  gate has no such scale and is refused (:func:`value_drain_reason`);
* the counted queries ``Q`` are the real queries ``q != p`` that can see the sink in layer ``l``
  (:meth:`~sinklens.visibility.Visibility.batch_mask`);
* ``attn_sink`` = mean over ``Q`` of ``A[q, p]``; ``write_sink`` = mean over ``Q`` of ``write[q, p]``;
* ``write_other`` / ``attn_other``: the same means over the pairs ``q`` in ``Q``, ``k != p`` visible to ``q``;
* ``write_share`` = ``Σ_Q write[q, p] / Σ_Q Σ_{k visible to q} write[q, k]``: the sink's share of the
  head's total write magnitude, pooled over every counted query;
* ``value_norm_sink`` = mean over sequences of ``‖v_p‖``, ``out_norm_sink`` = of ``‖v_p · W_O[l, h]‖``
  (before any norm or variant), ``value_norm_other`` / ``out_norm_other`` over every other real key.

**Classification** (:class:`ValueDrainSettings`): a head is a *sink head* when
``attn_sink >= sink_head_threshold``; a sink head is ``"no-op"`` when ``write_share < no_op_share``,
``"broadcast"`` when ``write_share >= broadcast_share`` and ``"partial"`` in between; other heads are
``"none"``.

Measured on SmolLM2-135M-Instruct (64 windows of 64 tokens, sink position 0): 201 of 270 heads are
sink heads, 7 no-op, 70 broadcast, 124 partial; median write share 0.25.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from sinklens.analysis._common import SettingsFields, check_sink_position, row_index, run_analyzer, sink_position_arg
from sinklens.analysis.post_attention import attention_output_grams, post_attention_scale_hooks
from sinklens.analysis.qk_attention import attention_columns, qk_plan, queries_and_keys
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import PATTERN, V, Z, head_output_gain, head_output_site, model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import ATTENTION_METHODS, SINK_THRESHOLD, AttentionMethod, RunOptions
from sinklens.streaming import BatchFold, Reducer, bound_hooks, per_layer_hooks
from sinklens.validate import choice, finite_number
from sinklens.visibility import attention_visibility

Kind = Literal["no-op", "broadcast", "partial", "none"]
KINDS: tuple[str, ...] = ("no-op", "broadcast", "partial", "none")


@dataclass(frozen=True)
class ValueDrainSettings:
    """Settings of a value-drain analysis.

    Attributes:
        sink_position: the key position treated as the sink (default 0).
        sink_head_threshold: a head is a sink head when its mean attention to the sink over the counted
            queries (``attn_sink``) is at least this (in (0, 1]; default 0.3, the value of Gu et al.'s ``ε``; the rule
            is sinklens' own: attention pooled over sequences, the sink's own query left out, ``>=`` where their
            sink rate uses ``>`` per sequence).
        no_op_share: a sink head whose ``write_share`` is below this is ``"no-op"`` (default 0.1: the
            sink supplies under a tenth of the head's write while taking at least ``sink_head_threshold``
            of its attention).
        broadcast_share: a sink head whose ``write_share`` is at least this is ``"broadcast"`` (default
            0.3); must be ``>= no_op_share``. Between the two a sink head is ``"partial"``.
        method: where attention is read, as :class:`~sinklens.analysis.sink_result.SinkSettings`' ``method``.
    """

    sink_position: int = 0
    sink_head_threshold: float = SINK_THRESHOLD
    no_op_share: float = 0.1
    broadcast_share: float = 0.3
    method: AttentionMethod = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_position", sink_position_arg(self.sink_position))
        set_(self, "sink_head_threshold", finite_number(self.sink_head_threshold, what="sink_head_threshold",
                                                        low=0.0, high=1.0, low_open=True))
        set_(self, "no_op_share", finite_number(self.no_op_share, what="no_op_share", low=0.0, high=1.0))
        set_(self, "broadcast_share", finite_number(self.broadcast_share, what="broadcast_share", low=0.0, high=1.0))
        set_(self, "method", choice(self.method, ATTENTION_METHODS, what="method"))
        if self.broadcast_share < self.no_op_share:
            raise InvalidArgumentError(
                f"broadcast_share={self.broadcast_share} must be >= no_op_share={self.no_op_share}."
            )


@dataclass(repr=False, eq=False)
class ValueDrain(SettingsFields, CompactRepr):
    """Per layer × head: attention to the sink against what the sink actually writes (module docstring).

    Attributes:
        attn_sink / attn_other: mean attention to the sink / to another visible key, per counted query.
        write_sink / write_other: mean write (residual units) of the sink / of another visible key into a query.
        write_share: the sink's share of the head's total write magnitude.
        value_norm_sink / value_norm_other: mean ``‖v‖`` of the sink / of the other real keys.
        out_norm_sink / out_norm_other: mean ``‖v · W_O‖`` (before any post-norm) of the same.
        n_queries: counted queries (``Q``) per layer.
        layers: the model layer of each row.
        n_sequences: sequences streamed.
        post_norm_layers: analysed layers whose writes were mapped through a post-attention norm.
        settings: the :class:`ValueDrainSettings` used (its fields also read as attributes).
    """

    attn_sink: Float[Tensor, "layer head"]
    attn_other: Float[Tensor, "layer head"]
    write_sink: Float[Tensor, "layer head"]
    write_other: Float[Tensor, "layer head"]
    write_share: Float[Tensor, "layer head"]
    value_norm_sink: Float[Tensor, "layer head"]
    value_norm_other: Float[Tensor, "layer head"]
    out_norm_sink: Float[Tensor, "layer head"]
    out_norm_other: Float[Tensor, "layer head"]
    n_queries: Float[Tensor, " layer"]
    layers: list[int]
    n_sequences: int
    post_norm_layers: list[int] = field(default_factory=list)
    settings: ValueDrainSettings = field(default_factory=ValueDrainSettings)

    def sink_heads(self) -> Bool[Tensor, "layer head"]:
        """Heads with ``attn_sink >= sink_head_threshold``."""
        return self.attn_sink >= self.settings.sink_head_threshold

    def kinds(self) -> list[list[str]]:
        """Per [layer][head]: ``"no-op"``, ``"broadcast"``, ``"partial"`` or ``"none"`` (module docstring)."""
        s = self.settings
        sink = self.sink_heads().tolist()
        share = self.write_share.tolist()
        return [
            [("none" if not sink[i][h] else "no-op" if share[i][h] < s.no_op_share
              else "broadcast" if share[i][h] >= s.broadcast_share else "partial")
             for h in range(len(share[i]))]
            for i in range(len(share))
        ]

    def kind(self, layer: int, head: int) -> str:
        """The class of one head (model layer ``layer``)."""
        return self.kinds()[row_index(self.layers, layer)][head]

    def heads(self, kind: Kind) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs of one class, in layer-then-head order."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind={kind!r}; expected one of {list(KINDS)}.")
        return [(layer, h) for i, layer in enumerate(self.layers) for h, k in enumerate(self.kinds()[i]) if k == kind]

    def counts(self) -> dict[str, int]:
        """How many heads fall in each class."""
        flat = [k for row in self.kinds() for k in row]
        return {k: flat.count(k) for k in KINDS}

    def rows(self) -> list[dict[str, Any]]:
        """One row per (layer, head) with every number and the class."""
        kinds = self.kinds()
        cols = {name: getattr(self, name).tolist() for name in (
            "attn_sink", "attn_other", "write_sink", "write_other", "write_share",
            "value_norm_sink", "value_norm_other", "out_norm_sink", "out_norm_other")}
        return [
            {"layer": layer, "head": h, "kind": kinds[i][h], **{k: v[i][h] for k, v in cols.items()}}
            for i, layer in enumerate(self.layers)
            for h in range(self.attn_sink.shape[1])
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (strict JSON via :func:`sinklens.export.to_json`): settings, per-(layer, head)
        numbers, classes and class counts."""
        return to_json({
            "definition": "sinklens value drain: write[q,k] = A[q,k] * ||(v_k W_O) * g|| / s_q in residual units "
                          "(g, s: post-attention norm gain and scale, 1 without one; on a SinkLM variant whose head "
                          "output is c_q (gamma * z), v_k W_O becomes (gamma * v_k) W_O and 1/s_q becomes |c_q|/s_q); "
                          "write_share = sum_Q write[q,sink] / sum_Q sum_k write[q,k]",
            "settings": self.settings,
            "layers": list(self.layers),
            "n_sequences": self.n_sequences,
            "post_norm_layers": list(self.post_norm_layers),
            "n_queries": self.n_queries,
            "attn_sink": self.attn_sink,
            "attn_other": self.attn_other,
            "write_sink": self.write_sink,
            "write_other": self.write_other,
            "write_share": self.write_share,
            "value_norm_sink": self.value_norm_sink,
            "value_norm_other": self.value_norm_other,
            "out_norm_sink": self.out_norm_sink,
            "out_norm_other": self.out_norm_other,
            "kinds": self.kinds(),
            "counts": self.counts(),
        }, digits=None)

def value_drain_reason(model: Any) -> str | None:
    """Why value drain cannot be measured on ``model``, or None when it can.

    A key's write ``A[q, k] · (v_k ⊙ m_q) · W_O`` is defined when a head's output is linear in its values at
    a fixed query. That holds where ``W_O`` reads the aggregation ``hook_z`` itself (``m = 1``) and for a
    sinklens :class:`~sinklens.sinklm.model.SinkLM` variant whose output is ``c[q, h] · (γ[h] ⊙ z)``
    (:func:`~sinklens.hooks.head_output_gain`: head-wise RMSNorm, variance calibration, a head-wise gate).
    An element-wise gate (``gated``, ``granularity="elementwise"``) mixes a per-coordinate factor of the
    query into every key's write, which the analysis does not split, so it refuses there.
    """
    site = head_output_site(model)
    if site == Z:
        return None
    bad = [layer for layer in range(model_dims(model).n_layers) if head_output_gain(model, layer) is None]
    if not bad:
        return None
    return (f"the model transforms each head's aggregated output before W_O coordinate by coordinate "
            f"(W_O reads blocks.{{l}}.{site}, not a scalar multiple of blocks.{{l}}.{Z}; layers {bad}), so a "
            "key's write is not split by this analysis")


def _output_scale(z: Float[Tensor, "batch pos head d_head"], out: Float[Tensor, "batch pos head d_head"],
                  gain: Float[Tensor, "head d_head"]) -> Float[Tensor, "batch pos head"]:
    """``c`` with ``out = c · (γ ⊙ z)`` per (batch, token, head): the least-squares fit ``⟨out, γz⟩ / ‖γz‖²``,
    exact for a transform of that form; 0 where ``γ ⊙ z`` is 0 (the head wrote nothing there)."""
    gz = z * gain
    den = gz.square().sum(-1)
    return torch.where(den > 0, (out * gz).sum(-1) / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(den))


def _quad_norm(v: Float[Tensor, "batch key head d_head"], gram: Float[Tensor, "head d_head d_head"]) -> Tensor:
    """``sqrt(v G vᵀ)`` per (batch, key, head): the norm of ``v W`` for ``G = W Wᵀ`` without forming ``v W``."""
    return (torch.einsum("bkhd,hde->bkhe", v, gram) * v).sum(-1).clamp(min=0).sqrt()


class ValueDrainReducer(Reducer[ValueDrain]):
    """Streams ``hook_v``, ``hook_pattern`` or the queries and keys (``settings.method``), the post-attention norm's
    ``hook_scale`` on post-norm layers and ``hook_z`` with a SinkLM variant's output site where one transforms the
    aggregation into a :class:`ValueDrain`.

    Per layer it keeps float64 sums over the counted queries (``Σ A[q, p]``, ``Σ write[q, p]``, the total
    write, the other keys' write and attention and their pair count, the query count) and over keys
    (``Σ ‖v‖``, ``Σ ‖v W_O‖`` for the sink and for the other real keys). A layer's activations wait in
    the batch's fold state until all of its hooks have fired, then are folded and dropped.
    """

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None,
                 settings: ValueDrainSettings = ValueDrainSettings()):
        reason = value_drain_reason(model)
        if reason is not None:
            raise UnsupportedArchitectureError(f"Value drain is not supported for this model: {reason}.")
        dims = model_dims(model)
        self.dims, self.settings = dims, settings
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.plan = qk_plan(model, self.layers, settings.method)
        self.device = model_device(model)
        self.visibility = attention_visibility(model)
        self.scale_hooks = post_attention_scale_hooks(model, self.layers)
        self.post_norm = list(self.scale_hooks)
        # ‖v W_O[h]‖² = v G vᵀ with G = W_O[h] W_O[h]ᵀ; in residual units W_O[h] diag(g) takes W_O[h]'s place.
        gram, gram_res = attention_output_grams(model, self.layers)  # [layer, head, d_head, d_head], float64
        self.gram = gram.to(self.device).float()
        # A SinkLM variant's head output is c[q, h] · (γ[h] ⊙ z): a key's write goes through diag(γ[h]) W_O[h].
        self.output_site = head_output_site(model)
        gain = torch.stack([head_output_gain(model, layer) for layer in self.layers]).to(self.device, torch.float64)
        self.gain = gain.float()  # [layer, head, d_head]
        self.gram_res = (gram_res.to(self.device) * gain[..., :, None] * gain[..., None, :]).float()
        if dims.n_heads % dims.n_kv_heads:
            raise InvalidArgumentError(f"{dims.n_heads} query heads cannot share {dims.n_kv_heads} key/value heads evenly.")
        # Query head h reads key/value head h // r (Hugging Face repeat_kv / repeat_interleave order).
        self.kv_of = torch.arange(dims.n_heads, device=self.device) // (dims.n_heads // dims.n_kv_heads)
        self.reset()

    statistics = ("sums", "n_q", "n_pairs", "n_keys", "n_seq")

    def reset(self) -> None:
        n_l, n_h = len(self.layers), self.dims.n_heads
        zeros = lambda *shape: torch.zeros(*shape, device=self.device, dtype=torch.float64)  # noqa: E731
        self.sums = {name: zeros(n_l, n_h) for name in (
            "attn_sink", "write_sink", "write_total", "write_other", "attn_other",
            "vn_sink", "vn_other", "on_sink", "on_other")}
        self.n_q = zeros(n_l)
        self.n_pairs = zeros(n_l)
        self.n_keys = zeros(n_l)
        self.n_seq = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.settings.sink_position)
        valid = batch.valid.to(self.device)
        waiting: dict[int, dict[str, Tensor]] = {}
        transformed = {"z", "out"} if self.output_site != Z else set()  # c[q, h] from the aggregation and the output
        attention = set(self.plan.sites) if self.plan.reads_qk(batch.tokens.shape[1]) else {PATTERN}
        needed = {layer: {"v"} | attention | transformed | ({"scale"} if layer in self.post_norm else set())
                  for layer in self.layers}

        def keep(name: str) -> Any:
            def fold(act: Tensor, layer: int) -> None:
                got = waiting.setdefault(layer, {})
                last = set(got) | {name} == needed[layer]  # the layer's last hook: fold now, no need for a copy
                got[name] = act.detach().to(self.device, torch.float32, copy=not last)  # one device for every statistic
                if last:
                    self._fold_layer(layer, waiting.pop(layer), valid)

            return fold

        hooks = per_layer_hooks(V, self.layers, keep("v"))
        for site in attention:
            hooks += per_layer_hooks(site, self.layers, keep(site))
        if transformed:
            hooks += per_layer_hooks(Z, self.layers, keep("z"))
            hooks += per_layer_hooks(self.output_site, self.layers, keep("out"))
        hooks += bound_hooks(list(self.scale_hooks.values()), self.post_norm, keep("scale"))
        return BatchFold(hooks, state=waiting)

    def _fold_layer(self, layer: int, acts: dict[str, Tensor], valid: Tensor) -> None:
        row, p = self.row[layer], self.settings.sink_position
        v = acts["v"]  # [batch, key, kv_head, d_head]
        if v.shape[2] != self.dims.n_heads:
            v = v[:, :, self.kv_of]  # [batch, key, head, d_head]
        b, n_pos = v.shape[:2]
        valid = valid[:, :n_pos]
        value_norm = v.norm(dim=-1)  # [batch, key, head]
        out_norm = _quad_norm(v, self.gram[row])  # ‖v_k W_O[h]‖
        transformed = "out" in acts
        if layer in self.post_norm or transformed:
            res_norm = _quad_norm(v, self.gram_res[row])  # ‖C((γ ⊙ v_k) W_O[h]) ⊙ g‖
        else:
            res_norm = out_norm
        inv_scale = torch.ones(b, 1, n_pos, device=v.device, dtype=v.dtype)  # [b, head, q]: c[q, h] / s[b, q]
        if layer in self.post_norm:
            inv_scale = inv_scale / acts["scale"].reshape(b, 1, n_pos)  # 1 / s[b, q]
        if transformed:
            inv_scale = inv_scale * _output_scale(acts["z"], acts["out"], self.gain[row]).transpose(1, 2)
        pos = torch.arange(n_pos, device=v.device)
        queries = self.visibility.block(layer, pos, pos[p: p + 1])[None, :, 0] & valid & valid[:, p: p + 1]
        queries[:, p] = False  # Q: real queries != p that see the sink
        # write[b, h, q, k] = A[b, h, q, k] ‖v_k W_O[h]‖ |c[b, q, h]| / s[b, q], over the pairs (q in Q, k seen by q).
        zero = torch.zeros((), device=v.device, dtype=v.dtype)
        inv_q = torch.where(queries[:, None], inv_scale.abs(), zero).expand(-1, self.dims.n_heads, -1)  # [b, h, q]
        key_norm = torch.where(valid[:, :, None], res_norm, zero).permute(0, 2, 1)  # [b, h, k]
        if PATTERN in acts:  # summed over q first (float32, 1 pass over A): Σ_q A and Σ_q A |c| / s per key
            pairs = self.visibility.batch_mask(layer, valid) & queries[:, :, None]  # [b, q, k]
            masked = acts[PATTERN].masked_fill(~pairs[:, None], 0.0)  # NaN/inf outside the pairs never enter
            attn_k = masked.sum(2)  # [b, h, k]
            write_k = torch.einsum("bhqk,bhq->bhk", masked, inv_q) * key_norm
            attn_sink, write_sink = attn_k[..., p].sum(0), write_k[..., p].sum(0)  # pairs (q, p): exactly q in Q
            attn_total, write_total = attn_k.sum(dim=(0, 2)), write_k.sum(dim=(0, 2))
            n_pairs = pairs.sum()
        else:  # per query from queries and keys: A[q, p], Σ_k A[q, k] ‖·‖_k and Σ_k A[q, k]
            q, k = queries_and_keys(acts, self.plan.sites)
            values = torch.stack([key_norm, torch.ones_like(key_norm)], dim=-1)  # [b, h, k, 2]
            cols = attention_columns(q, k, self.plan.rules[layer], self.visibility, layer, valid, positions=[p],
                                     values=values)
            to_sink = cols.to_keys[..., 0]  # [b, h, q]
            attn_sink = (to_sink * queries[:, None]).sum(dim=(0, 2))
            write_sink = ((to_sink * inv_q).sum(2) * key_norm[..., p]).sum(0)
            write_total = (cols.aggregated[..., 0] * inv_q).sum(dim=(0, 2))
            attn_total = (cols.aggregated[..., 1] * queries[:, None]).sum(dim=(0, 2))
            n_pairs = (cols.n_keys * queries).sum()
        s = self.sums
        s["attn_sink"][row] += attn_sink.double()
        s["write_sink"][row] += write_sink.double()
        s["write_total"][row] += write_total.double()
        s["write_other"][row] += (write_total - write_sink).double()  # the other keys: every pair but (q, p)
        s["attn_other"][row] += (attn_total - attn_sink).double()
        keys = valid.clone()
        keys[:, p] = False
        k_mask = keys[:, :, None]  # [batch, key, 1]
        s["vn_sink"][row] += value_norm[:, p].sum(0).double()
        s["on_sink"][row] += out_norm[:, p].sum(0).double()
        s["vn_other"][row] += torch.where(k_mask, value_norm, zero).sum(dim=(0, 1)).double()
        s["on_other"][row] += torch.where(k_mask, out_norm, zero).sum(dim=(0, 1)).double()
        self.n_q[row] += queries.sum()
        self.n_pairs[row] += n_pairs - queries.sum()
        self.n_keys[row] += keys.sum()

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        if fold.state:
            raise RuntimeError(f"Value drain: hooks of layers {sorted(fold.state)} did not all fire in this forward pass.")
        self.n_seq += batch.tokens.shape[0]

    def result(self) -> ValueDrain:
        if self.n_seq == 0:
            raise InvalidArgumentError("No sequences were streamed; nothing to measure.")
        s = self.sums

        def per(total: Tensor, count: Tensor | int) -> Tensor:
            count = count[:, None] if isinstance(count, Tensor) else count
            return (total / count).float().cpu()

        return ValueDrain(
            attn_sink=per(s["attn_sink"], self.n_q),
            attn_other=per(s["attn_other"], self.n_pairs),
            write_sink=per(s["write_sink"], self.n_q),
            write_other=per(s["write_other"], self.n_pairs),
            write_share=(s["write_sink"] / s["write_total"]).float().cpu(),
            value_norm_sink=per(s["vn_sink"], self.n_seq),
            value_norm_other=per(s["vn_other"], self.n_keys),
            out_norm_sink=per(s["on_sink"], self.n_seq),
            out_norm_other=per(s["on_other"], self.n_keys),
            n_queries=self.n_q.float().cpu(),
            layers=list(self.layers),
            n_sequences=self.n_seq,
            post_norm_layers=list(self.post_norm),
            settings=self.settings,
        )


def measure_value_drain(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    settings: ValueDrainSettings | None = None,
    options: RunOptions = RunOptions(),
    **settings_kwargs: Any,
) -> ValueDrain:
    """Measure, per layer × head, attention to the sink against what the sink writes (module docstring).

    Args:
        inputs: prompts, token ids or :class:`~sinklens.inputs.TokenBatch` es (default: the built-in prompts).
        layers: which layers (default all).
        settings: sink position and classification thresholds (default ``ValueDrainSettings()``).
        **settings_kwargs: any field of :class:`ValueDrainSettings` as a keyword (``sink_position=``,
            ``sink_head_threshold=``, ...), replacing that of ``settings``.
        options: batching, BOS, truncation, extra hooks (e.g. an intervention) and progress bar.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> drain = measure_value_drain(tiny_model(), ["t5 t6 t7 t8", "t3 t4"], options=RunOptions(progress=False))
        >>> drain.write_share.shape, sorted(drain.counts())
        (torch.Size([2, 4]), ['broadcast', 'no-op', 'none', 'partial'])
    """
    return run_analyzer(model, inputs, ValueDrainReducer, where="measure_value_drain", options=options,
                        kwargs=settings_kwargs, settings_cls=ValueDrainSettings, settings=settings, layers=layers)
