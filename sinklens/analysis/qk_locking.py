"""Query–key locking: how well the sink token's key lines up with the other positions' queries (:class:`QKLocking`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import TINY, check_sink_position, run_analyzer, sink_position_arg
from sinklens.analysis.qk_attention import attention_parts, chunk_scores, query_chunk, scaled_heads
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import K, Q, ROT_K, ROT_Q, SCORES, expand_kv_heads, hook_name, model_dims
from sinklens.probes import post_hoc_attention, silent_hooks
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import AttentionMethod, RunOptions
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks
from sinklens.validate import positive_int
#: The per-(layer, head) numbers of a :class:`QKLocking`.
NUMBERS = ("key_query_energy", "key_pc_cosine", "pc_energy", "pos_share_sink", "pos_share_other",
           "mean_score_sink", "mean_score_other")


def qk_locking_reason(model: Any) -> str | None:
    """Why query-key locking cannot be measured on ``model`` (rotated q/k never run, scores fired post hoc), or None."""
    if silent := silent_hooks(model, [hook_name(0, ROT_Q), hook_name(0, ROT_K)]):
        return (f"the model lists {silent} but never runs them, so the rotated queries and keys that make the "
                "attention scores are not exposed")
    return post_hoc_attention(model)


@dataclass(repr=False, eq=False)
class QKLocking(CompactRepr):
    """Query–key locking per layer × head, over the real queries other than the sink that see it in that layer
    (rotated queries and keys on rotary models, at ``q_site``/``k_site``; grouped-query keys repeated).

    Attributes:
        key_query_energy: ``Σ (q · k̂_sink)² / Σ ||q||²`` pooled over sequences and queries (``k̂_sink`` the unit
            sink key of the same sequence): the share of query energy along the sink key.
        key_pc_cosine: norm of the projection of the unit mean sink key onto the top ``n_components`` eigenvectors
            of ``Σ q qᵀ``; pc_energy: their share of query energy.
        pos_share_sink / pos_share_other: share of positive scores (scaled, soft-capped ``q·k``) of those queries
            against the sink key / every other real key they see; mean_score_sink / mean_score_other: the means.
        n_queries: (sequence, query) pairs that see the sink, the most over the analysed layers.
    """

    layers: list[int]
    sink_position: int
    n_components: int
    q_site: str
    k_site: str
    key_query_energy: Float[Tensor, "layer head"]
    key_pc_cosine: Float[Tensor, "layer head"]
    pc_energy: Float[Tensor, "layer head"]
    pos_share_sink: Float[Tensor, "layer head"]
    pos_share_other: Float[Tensor, "layer head"]
    mean_score_sink: Float[Tensor, "layer head"]
    mean_score_other: Float[Tensor, "layer head"]
    n_queries: int

    def rows(self) -> list[dict[str, Any]]:
        """One row per layer × head with every statistic (DataFrame-ready)."""
        return [{"layer": layer, "head": h} | {n: float(getattr(self, n)[i, h]) for n in NUMBERS}
                for i, layer in enumerate(self.layers) for h in range(self.key_query_energy.shape[1])]

    def to_dict(self) -> dict[str, Any]:
        return to_json({"layers": self.layers, "sink_position": self.sink_position, "n_components": self.n_components,
                        "q_site": self.q_site, "k_site": self.k_site, "n_queries": self.n_queries, "rows": self.rows()})


class QKLockingReducer(Reducer[QKLocking]):
    """Streams per layer × head the pooled ``Σ q qᵀ``, the summed sink key, the query energy along each sequence's
    sink key and score sums (from ``hook_attn_scores``, or from queries and keys by ``method``)."""

    statistics = ("gram", "key_sum", "along", "total", "pos_sink", "pos_other", "sum_sink", "sum_other",
                  "cnt_sink", "cnt_other")

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | Sequence[int] | None = None,
                 n_components: int = 1, method: AttentionMethod = "auto"):
        d = model_dims(model)
        n_components = positive_int(n_components, what="n_components")
        if n_components > d.d_head:
            raise InvalidArgumentError(f"n_components must be in [1, {d.d_head}] (d_head), got {n_components}.")
        self.sink, self.n_components, self.n_heads, self.d_head = sink_position_arg(sink_position), n_components, d.n_heads, d.d_head
        reason = qk_locking_reason(model)
        if reason is not None:
            raise UnsupportedArchitectureError(f"Query-key locking is not supported for this model: {reason}.")
        self.layers, self.row, self.plan, self.visibility, self.device = attention_parts(model, layers, method)
        self.q_site, self.k_site = (ROT_Q, ROT_K) if hook_name(self.layers[0], ROT_Q) in model.hook_dict else (Q, K)
        self.reset()

    def reset(self) -> None:
        zeros = partial(torch.zeros, len(self.layers), device=self.device, dtype=torch.float64)  # [layer, ...]
        H, dh = self.n_heads, self.d_head
        self.gram, self.key_sum = zeros(H, dh, dh), zeros(H, dh)
        self.along, self.total, self.pos_sink, self.pos_other, self.sum_sink, self.sum_other = (zeros(H) for _ in range(6))
        self.cnt_sink, self.cnt_other = zeros(1), zeros(1)

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)
        s, valid = self.sink, batch.valid
        n = valid.shape[1]
        pos = torch.arange(n, device=valid.device)
        from_qk = self.plan.reads_qk(n)
        pending: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

        def sink_queries(layer: int) -> Tensor:  # [b, q]: the real queries other than the sink that see it
            return self.visibility.block(layer, pos, pos[s:s + 1])[None, :, 0] & valid & valid[:, s:s + 1] & (pos != s)

        def fold_scores(layer: int, scores: Callable[[slice], Tensor], chunk: int) -> None:
            i = self.row[layer]
            for q0 in range(0, n, chunk):
                rows = slice(q0, min(n, q0 + chunk))
                see = self.visibility.block(layer, pos[rows], pos)[None] & valid[:, rows, None] & valid[:, None, :]
                qmask = (see[:, :, s] & (pos[rows] != s))[:, None]  # [b, 1, q]
                other = qmask[..., None] & (see & (pos != s))[:, None]  # [b, 1, q, k]
                sc = scores(rows).float()  # [b, h, q, k]
                at_sink = sc[..., s]  # a query that cannot see the sink may score -inf there (TransformerLens 3.x)
                self.pos_sink[i] += ((at_sink > 0) & qmask).sum(dim=(0, 2)).double()
                self.sum_sink[i] += torch.where(qmask, at_sink, 0.0).sum(dim=(0, 2)).double()
                self.pos_other[i] += ((sc > 0) & other).sum(dim=(0, 2, 3)).double()
                self.sum_other[i] += torch.where(other, sc, 0.0).sum(dim=(0, 2, 3)).double()
                self.cnt_sink[i] += qmask.sum()
                self.cnt_other[i] += other.sum()

        def pair(layer: int, kind: str, value: tuple[Tensor, Tensor]) -> None:  # the queries wait for the keys
            i = self.row[layer]
            pending[(i, kind)] = value
            if (i, "q") in pending and (i, "k") in pending:
                (gram, q), (key, k) = pending.pop((i, "q")), pending.pop((i, "k"))
                unit = key / key.norm(dim=-1, keepdim=True).clamp_min(TINY)
                self.along[i] += torch.einsum("bhi,bhij,bhj->h", unit, gram, unit).double()
                if from_qk:
                    rule = self.plan.rules[layer]
                    qh, kh = scaled_heads(q, k, rule)
                    fold_scores(layer, lambda rows: chunk_scores(qh, kh, rule, rows),
                                query_chunk(q.shape[0], self.n_heads, n, q.device))

        def fold_q(act: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]
            i = self.row[layer]
            q = act.float() * sink_queries(layer)[:, :, None, None]
            qt = q.permute(0, 2, 3, 1)  # [batch, head, d_head, pos]
            gram = qt @ qt.transpose(-1, -2)  # [batch, head, d_head, d_head]
            self.gram[i] += gram.sum(0).double()
            self.total[i] += gram.diagonal(dim1=-2, dim2=-1).sum(dim=(0, -1)).double()
            pair(layer, "q", (gram, act))

        def fold_k(act: Tensor, layer: int) -> None:  # [batch, pos, kv_head, d_head]
            i = self.row[layer]
            key = expand_kv_heads(act[:, s].float()[..., None], self.n_heads)[..., 0]  # [batch, head, d_head]
            self.key_sum[i] += key.sum(0).double()
            pair(layer, "k", (key, act))

        hooks = per_layer_hooks(self.q_site, self.layers, fold_q) + per_layer_hooks(self.k_site, self.layers, fold_k)
        if not from_qk:
            hooks += per_layer_hooks(SCORES, self.layers, lambda act, layer: fold_scores(layer, lambda rows: act[:, :, rows], n))
        return BatchFold(hooks)

    def result(self) -> QKLocking:
        # Many small eigenproblems: one thread is ~10x faster than several on CPU (thread start-up dominates).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            evals, evecs = torch.linalg.eigh(self.gram)  # ascending; [layer, head, dh], [layer, head, dh, dh]
        finally:
            torch.set_num_threads(threads)
        top = evecs[..., -self.n_components :]  # [layer, head, dh, r]
        key = self.key_sum / self.key_sum.norm(dim=-1, keepdim=True).clamp_min(TINY)
        cos = torch.einsum("lhi,lhir->lhr", key, top).norm(dim=-1)
        pc_energy = evals[..., -self.n_components :].sum(-1) / evals.sum(-1).clamp_min(TINY)
        cs, co = (torch.where(c > 0, c, float("nan")) for c in (self.cnt_sink, self.cnt_other))
        numbers = dict(key_query_energy=self.along / self.total.clamp_min(TINY), key_pc_cosine=cos, pc_energy=pc_energy,
                       pos_share_sink=self.pos_sink / cs, pos_share_other=self.pos_other / co,
                       mean_score_sink=self.sum_sink / cs, mean_score_other=self.sum_other / co)
        return QKLocking(layers=list(self.layers), sink_position=self.sink, n_components=self.n_components,
                         q_site=self.q_site, k_site=self.k_site, n_queries=int(self.cnt_sink.max()),
                         **{name: t.float().cpu() for name, t in numbers.items()})


def query_key_locking(model: Any, inputs: Inputs | None = None, *, sink_position: int = 0,
                      layers: int | Sequence[int] | None = None, n_components: int = 1,
                      method: AttentionMethod = "auto", options: RunOptions = RunOptions()) -> QKLocking:
    """Measure query–key locking on the sink key per layer × head (:class:`QKLocking`); ``method`` as in
    :func:`~sinklens.analysis.sinks.find_sinks` (``"auto"``: scores from queries and keys above a length).

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, qk_layer=1, qk_head=1)
        >>> lock = query_key_locking(model, "t3 t4 t5 t6 t7 t8")
        >>> float(lock.pos_share_sink[1, 1]), bool(lock.key_pc_cosine[1, 1] > 0.9)
        (1.0, True)
    """
    return run_analyzer(model, inputs, QKLockingReducer, where="query_key_locking", options=options,
                        sink_position=sink_position, layers=layers, n_components=n_components, method=method)
