"""Value drain: a sink head whose sink value is (nearly) zero parks attention there and writes little (a
**no-op**, Bondarenko et al. 2023); one whose sink value carries a signal **broadcasts** it (:class:`ValueDrain`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import SettingsFields, check_sink_position, run_analyzer, sink_position_arg
from sinklens.analysis.post_attention import attention_output_grams, post_attention_scale_hooks
from sinklens.analysis.qk_attention import attention_columns, attention_parts, queries_and_keys
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import PATTERN, V, Z, expand_kv_heads, head_output_gain, head_output_site, model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import ATTENTION_METHODS, SINK_THRESHOLD, AttentionMethod, RunOptions
from sinklens.streaming import BatchFold, Reducer, bound_hooks, per_layer_hooks
from sinklens.validate import choice, finite_number

Kind = Literal["no-op", "broadcast", "partial", "none"]
KINDS: tuple[str, ...] = get_args(Kind)
#: The per-(layer, head) numbers of a :class:`ValueDrain`.
NUMBERS = ("attn_sink", "attn_other", "write_sink", "write_other", "write_share",
           "value_norm_sink", "value_norm_other", "out_norm_sink", "out_norm_other")


@dataclass(frozen=True)
class ValueDrainSettings:
    """A sink head has ``attn_sink >= sink_head_threshold`` (default Gu et al.'s ``ε``, but pooled over sequences,
    sink query left out); it is ``"no-op"`` when ``write_share < no_op_share``, ``"broadcast"`` when
    ``write_share >= broadcast_share``, else ``"partial"``. ``method`` as ``SinkSettings.method``."""

    sink_position: int = 0
    sink_head_threshold: float = SINK_THRESHOLD
    no_op_share: float = 0.1
    broadcast_share: float = 0.3
    method: AttentionMethod = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_position", sink_position_arg(self.sink_position))
        for name, low_open in (("sink_head_threshold", True), ("no_op_share", False), ("broadcast_share", False)):
            set_(self, name, finite_number(getattr(self, name), what=name, low=0.0, high=1.0, low_open=low_open))
        set_(self, "method", choice(self.method, ATTENTION_METHODS, what="method"))
        if self.broadcast_share < self.no_op_share:
            raise InvalidArgumentError(f"broadcast_share={self.broadcast_share} must be >= "
                                       f"no_op_share={self.no_op_share}.")


@dataclass(repr=False, eq=False)
class ValueDrain(SettingsFields, CompactRepr):
    """Per layer × head: attention to the sink ``p`` against what the sink writes.

    Key ``k`` writes ``write[b, q, k] = A[b, h, q, k] · ‖C(v_k W_O[l, h]) ⊙ g‖ / s[b, q]`` into query ``q`` in
    residual units: ``A`` from ``hook_pattern`` (or queries and keys), ``v_k`` from ``hook_v`` (kv head ``h // r``);
    ``g``/``s``: a post-attention norm's gain and ``hook_scale`` (``C`` centres on post-LN), else 1; on a SinkLM
    variant with output ``c[q, h] · (γ[h] ⊙ z)``, ``W_O`` becomes ``diag(γ[h]) W_O`` and ``1/s`` ``|c|/s``.
    The counted queries ``Q`` are the real ``q != p`` that see the sink in that layer.

    Attributes:
        attn_sink / write_sink: mean over ``Q`` of ``A[q, p]`` / ``write[q, p]``; attn_other / write_other:
            mean over the pairs (``q`` in ``Q``, visible real ``k != p``).
        write_share: ``Σ_Q write[q, p] / Σ_Q Σ_k write[q, k]``, the sink's share of the head's write.
        value_norm_* / out_norm_*: mean ``‖v‖`` / ``‖v W_O‖`` (before any norm) of the sink / other real keys.
        n_queries: ``|Q|`` per layer.
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

    def kinds(self) -> list[list[str]]:
        """Per [layer][head]: ``"no-op"``, ``"broadcast"``, ``"partial"`` or ``"none"`` (see the settings)."""
        s = self.settings
        sink, share = (self.attn_sink >= s.sink_head_threshold).tolist(), self.write_share.tolist()
        return [["none" if not is_sink else "no-op" if x < s.no_op_share else "broadcast" if x >= s.broadcast_share
                 else "partial" for is_sink, x in zip(sink_row, share_row)] for sink_row, share_row in zip(sink, share)]

    def heads(self, kind: Kind) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs of one class, in layer-then-head order."""
        kind = choice(kind, KINDS, what="kind")
        return [(layer, h) for i, layer in enumerate(self.layers) for h, k in enumerate(self.kinds()[i]) if k == kind]

    def counts(self) -> dict[str, int]:
        """How many heads fall in each class."""
        flat = sum(self.kinds(), [])
        return {k: flat.count(k) for k in KINDS}

    def rows(self) -> list[dict[str, Any]]:
        """One row per (layer, head) with every number and the class."""
        kinds = self.kinds()
        cols = {name: getattr(self, name).tolist() for name in NUMBERS}
        return [{"layer": layer, "head": h, "kind": kinds[i][h], **{k: v[i][h] for k, v in cols.items()}}
                for i, layer in enumerate(self.layers) for h in range(self.attn_sink.shape[1])]

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON-ready: settings, per-(layer, head) numbers, classes and class counts."""
        return to_json({
            "definition": "sinklens value drain: write[q,k] = A[q,k] * ||(v_k W_O) * g|| / s_q in residual units "
                          "(g, s: post-attention norm gain and scale, 1 without one; on a SinkLM variant whose head "
                          "output is c_q (gamma * z), v_k W_O becomes (gamma * v_k) W_O and 1/s_q becomes |c_q|/s_q); "
                          "write_share = sum_Q write[q,sink] / sum_Q sum_k write[q,k]",
            "settings": self.settings, "layers": list(self.layers), "n_sequences": self.n_sequences,
            "post_norm_layers": list(self.post_norm_layers), "n_queries": self.n_queries,
            **{name: getattr(self, name) for name in NUMBERS},
            "kinds": self.kinds(), "counts": self.counts(),
        }, digits=None)


def value_drain_reason(model: Any) -> str | None:
    """Why value drain cannot be measured on ``model``, or None: ``W_O`` must read ``hook_z`` or
    ``c[q, h] · (γ[h] ⊙ z)`` (:func:`~sinklens.hooks.head_output_gain`), not an element-wise gated output."""
    site = head_output_site(model)
    bad = [] if site == Z else [layer for layer in range(model_dims(model).n_layers)
                                if head_output_gain(model, layer) is None]
    return None if not bad else (f"the model transforms each head's aggregated output before W_O coordinate by coordinate "
            f"(W_O reads blocks.{{l}}.{site}, not a scalar multiple of blocks.{{l}}.{Z}; layers {bad}), so a "
            "key's write is not split by this analysis")


def _quad_norm(v: Float[Tensor, "batch key head d_head"], gram: Float[Tensor, "head d_head d_head"]) -> Tensor:
    """``sqrt(v G vᵀ)`` per (batch, key, head): the norm of ``v W`` for ``G = W Wᵀ`` without forming ``v W``."""
    return (torch.einsum("bkhd,hde->bkhe", v, gram) * v).sum(-1).clamp(min=0).sqrt()


class ValueDrainReducer(Reducer[ValueDrain]):
    """Streams ``hook_v``, the attention, any ``hook_scale`` and a SinkLM variant's ``hook_z`` and output site into
    per-layer float64 sums; a layer is folded once all its hooks have fired."""

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None,
                 settings: ValueDrainSettings = ValueDrainSettings()):
        reason = value_drain_reason(model)
        if reason is not None:
            raise UnsupportedArchitectureError(f"Value drain is not supported for this model: {reason}.")
        self.dims, self.settings = model_dims(model), settings
        self.layers, self.row, self.plan, self.visibility, self.device = attention_parts(model, layers, settings.method)
        self.scale_hooks = post_attention_scale_hooks(model, self.layers)
        self.post_norm = list(self.scale_hooks)
        gram, gram_res = attention_output_grams(model, self.layers)  # [layer, head, d_head, d_head], float64
        self.gram = gram.to(self.device).float()
        self.output_site = head_output_site(model)
        gain = torch.stack([head_output_gain(model, layer) for layer in self.layers]).to(self.device, torch.float64)
        self.gain = gain.float()  # [layer, head, d_head]
        self.gram_res = (gram_res.to(self.device) * gain[..., :, None] * gain[..., None, :]).float()  # diag(γ) G diag(γ)
        self.reset()

    statistics = ("sums", "n_q", "n_pairs", "n_keys", "n_seq")

    def reset(self) -> None:
        n_l, n_h = len(self.layers), self.dims.n_heads
        zeros = lambda *shape: torch.zeros(*shape, device=self.device, dtype=torch.float64)  # noqa: E731
        self.sums = {name: zeros(n_l, n_h) for name in NUMBERS + ("write_total",) if name != "write_share"}
        self.n_q, self.n_pairs, self.n_keys = zeros(n_l), zeros(n_l), zeros(n_l)
        self.n_seq = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.settings.sink_position)
        valid = batch.valid.to(self.device)
        waiting: dict[int, dict[str, Tensor]] = {}
        transformed = {"z", "out"} if self.output_site != Z else set()  # c[q, h] from the aggregation and the output
        attention = set(self.plan.sites) if self.plan.reads_qk(batch.tokens.shape[1]) else {PATTERN}
        needed = {layer: {"v"} | attention | transformed | ({"scale"} if layer in self.post_norm else set())
                  for layer in self.layers}

        def keep(name: str, act: Tensor, layer: int) -> None:
            got = waiting.setdefault(layer, {})
            last = set(got) | {name} == needed[layer]  # the layer's last hook: fold now, no need for a copy
            got[name] = act.detach().to(self.device, torch.float32, copy=not last)  # one device for every statistic
            if last:
                self._fold_layer(layer, waiting.pop(layer), valid)

        sites = {"v": V, **{site: site for site in attention}}
        sites |= {"z": Z, "out": self.output_site} if transformed else {}
        hooks = [hook for name, site in sites.items() for hook in per_layer_hooks(site, self.layers, partial(keep, name))]
        hooks += bound_hooks(list(self.scale_hooks.values()), self.post_norm, partial(keep, "scale"))
        return BatchFold(hooks)

    def _fold_layer(self, layer: int, acts: dict[str, Tensor], valid: Tensor) -> None:
        row, p = self.row[layer], self.settings.sink_position
        v = expand_kv_heads(acts["v"][..., None], self.dims.n_heads)[..., 0]  # [batch, key, head, d_head]
        b, n_pos = v.shape[:2]
        valid = valid[:, :n_pos]
        value_norm = v.norm(dim=-1)  # [batch, key, head]
        out_norm = _quad_norm(v, self.gram[row])  # ‖v_k W_O[h]‖
        transformed = "out" in acts  # ‖C((γ ⊙ v_k) W_O[h]) ⊙ g‖:
        res_norm = _quad_norm(v, self.gram_res[row]) if layer in self.post_norm or transformed else out_norm
        inv_scale = torch.ones(b, 1, n_pos, device=v.device, dtype=v.dtype)  # [b, head, q]: c[q, h] / s[b, q]
        if layer in self.post_norm:
            inv_scale = inv_scale / acts["scale"].reshape(b, 1, n_pos)  # 1 / s[b, q]
        if transformed:  # c with out = c · (γ ⊙ z): the exact least-squares fit ⟨out, γz⟩ / ‖γz‖², 0 where γz = 0
            gz = acts["z"] * self.gain[row]
            den = gz.square().sum(-1)  # [b, q, head]
            c = torch.where(den > 0, (acts["out"] * gz).sum(-1) / den.clamp(min=torch.finfo(den.dtype).tiny), 0.0)
            inv_scale = inv_scale * c.transpose(1, 2)
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
        keys = valid.clone()
        keys[:, p] = False
        added = {"attn_sink": attn_sink, "write_sink": write_sink, "write_total": write_total,
                 "write_other": write_total - write_sink, "attn_other": attn_total - attn_sink,  # all pairs but (q, p)
                 "value_norm_sink": value_norm[:, p].sum(0), "out_norm_sink": out_norm[:, p].sum(0),
                 "value_norm_other": torch.where(keys[:, :, None], value_norm, zero).sum(dim=(0, 1)),
                 "out_norm_other": torch.where(keys[:, :, None], out_norm, zero).sum(dim=(0, 1))}
        for name, total in added.items():
            self.sums[name][row] += total.double()
        self.n_q[row] += queries.sum()
        self.n_pairs[row] += n_pairs - queries.sum()
        self.n_keys[row] += keys.sum()

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n_seq += batch.tokens.shape[0]

    def result(self) -> ValueDrain:
        if self.n_seq == 0:
            raise InvalidArgumentError("No sequences were streamed; nothing to measure.")
        s, n_q, n_pairs, n_keys = self.sums, self.n_q[:, None], self.n_pairs[:, None], self.n_keys[:, None]
        per = {"attn_sink": n_q, "write_sink": n_q, "attn_other": n_pairs, "write_other": n_pairs,
               "value_norm_sink": self.n_seq, "out_norm_sink": self.n_seq, "value_norm_other": n_keys,
               "out_norm_other": n_keys}
        return ValueDrain(**{name: (s[name] / count).float().cpu() for name, count in per.items()},
                          write_share=(s["write_sink"] / s["write_total"]).float().cpu(),
                          n_queries=self.n_q.float().cpu(), layers=list(self.layers), n_sequences=self.n_seq,
                          post_norm_layers=list(self.post_norm), settings=self.settings)


def measure_value_drain(model: Any, inputs: Inputs | None = None, *, layers: int | Sequence[int] | None = None,
                        settings: ValueDrainSettings | None = None, options: RunOptions = RunOptions(),
                        **settings_kwargs: Any) -> ValueDrain:
    """Measure, per layer × head, attention to the sink against what the sink writes (:class:`ValueDrain`); any
    field of :class:`ValueDrainSettings` may be given as a keyword, replacing that of ``settings``.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> drain = measure_value_drain(tiny_model(), ["t5 t6 t7 t8", "t3 t4"], options=RunOptions(progress=False))
        >>> drain.write_share.shape, sorted(drain.counts())
        (torch.Size([2, 4]), ['broadcast', 'no-op', 'none', 'partial'])
    """
    return run_analyzer(model, inputs, ValueDrainReducer, where="measure_value_drain", options=options,
                        kwargs=settings_kwargs, settings_cls=ValueDrainSettings, settings=settings, layers=layers)
