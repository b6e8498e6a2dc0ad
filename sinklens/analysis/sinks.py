"""Attention sinks: which key positions and tokens soak up attention per layer × head (:func:`find_sinks`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import run_analyzer
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.analysis.qk_attention import Columns, qk_hooks, qk_plan
from sinklens.analysis.sink_result import SinkOccurrence, SinkResult, SinkSettings, TokenSinkStats
from sinklens.hooks import PATTERN, model_dims, model_dtype
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions, settings_from
from sinklens.streaming import BatchFold, Reducer, grow, merge_statistics, per_layer_hooks

#: Softmax rows sum to 1 within this (16-bit: twice the dtype's eps); a larger mean shortfall is a virtual sink.
ROW_SUM_TOLERANCE = 1e-5


def has_sink_logits(model: Any) -> bool:
    """True if the model has learned sink logits: a ``sinks`` parameter (gpt-oss) or a SinkLM ``sink_logit``."""
    roots = [root for root in (getattr(model, "original_model", None), model) if hasattr(root, "named_parameters")]
    return getattr(getattr(model, "cfg", None), "variant", None) == "sink_logit" or any(
        name.rsplit(".", 1)[-1] == "sinks" for root in roots for name, _ in root.named_parameters())


def _merge_position_tokens(mine: Tensor, theirs: Tensor) -> Tensor:
    """Combine two per-position token records (-2 unseen, -1 varies, else the one token id seen there)."""
    n = max(mine.numel(), theirs.numel())
    mine, theirs = grow(mine, 0, n, fill=-2), grow(theirs, 0, n, fill=-2)
    agree = torch.where(mine == theirs, mine, torch.full_like(mine, -1))
    return torch.where(mine == -2, theirs, torch.where(theirs == -2, mine, agree))


@dataclass
class _SinkBatch:  # per-batch state of SinkReducer
    q_count: dict[int, Tensor]  # per layer [batch, key]: counted queries per sequence and key
    gu_count: dict[int, Tensor]  # per layer [batch, key]: every query that can see the key (Gu et al.)
    recv: Float[Tensor, "batch key"]  # layer-head-mean α_b, summed over the layers folded so far
    share: Float[Tensor, "batch key"]  # share of (layer, head) with α_b > sink_threshold, likewise


class SinkReducer(Reducer[SinkResult]):
    """Streams the attention (``hook_pattern`` or queries and keys) into a :class:`SinkResult`: received attention,
    float64 counts of sequences with ``α_b`` / ``α^Gu_b > sink_threshold``, row shortfalls and token tables."""

    statistics = ("attention", "seq_hits", "seq_counts", "gu_hits", "gu_counts", "shortfall", "n_real_queries",
                  "pos_ids", "tok_first", "tok_later", "top_vals", "top_share", "top_meta", "prepend_bos", "special_tokens",
                  "n_seq", "paths")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None, settings: SinkSettings | None = None,
                 **settings_kwargs: Any):
        self.settings = settings = settings_from(SinkSettings, settings, settings_kwargs, "SinkReducer")
        self.attention = AttentionReceivedReducer(model, layers=layers, min_query=settings.min_query)
        self.layers = self.attention.layers
        self.n_heads, self.d_vocab = model_dims(model).n_heads, model_dims(model).d_vocab
        self.tokenizer = getattr(model, "tokenizer", None)
        self.sink_logits = has_sink_logits(model)
        self.row_sum_tolerance = max(ROW_SUM_TOLERANCE, 2 * torch.finfo(model_dtype(model)).eps)
        self.plan = qk_plan(model, self.layers, settings.method)
        self.reset()

    def reset(self) -> None:
        self.attention.reset()
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        max_pos, n_layers = self.attention.max_pos, len(self.layers)
        self.seq_hits, self.gu_hits = (torch.zeros(n_layers, self.n_heads, max_pos, **f64) for _ in range(2))
        self.seq_counts, self.gu_counts = (torch.zeros(n_layers, max_pos, **f64) for _ in range(2))
        self.shortfall = torch.zeros(n_layers, self.n_heads, **f64)
        self.n_real_queries = 0.0
        self.pos_ids = torch.full((max_pos,), -2, device=self.attention.device, dtype=torch.long)  # -2 unseen, -1 varies
        # Per token id: [count, sum received, sum head share, max received], for position 0 / >= 1.
        self.tok_first, self.tok_later = torch.zeros(4, self.d_vocab, **f64), torch.zeros(4, self.d_vocab, **f64)
        self.top_vals, self.top_share = torch.zeros(0, **f64), torch.zeros(0, **f64)
        self.top_meta = torch.zeros(0, 3, device=self.attention.device, dtype=torch.long)  # sequence, position, token
        self.prepend_bos, self.special_tokens, self.n_seq = True, (), 0
        self.paths: set[str] = set()

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        b, n = batch.tokens.shape
        use_qk = self.plan.reads_qk(n)
        self.paths.add("qk" if use_qk else "pattern")
        mq = self.settings.min_query
        weights = {} if use_qk else self.attention.query_weights(batch)
        gu_weights = self.attention.visible_weights(batch) if mq and not use_qk else weights
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        state = _SinkBatch({layer: w.sum(dim=1) for layer, w in weights.items()},
                           {layer: w.sum(dim=1) for layer, w in gu_weights.items()},
                           torch.zeros(b, n, **f64), torch.zeros(b, n, **f64))
        n_layers, threshold = len(self.layers), self.settings.sink_threshold
        n_real = batch.valid.sum().double()  # real queries in the batch

        def fold(pattern: Tensor, layer: int) -> None:  # pattern: [batch, head, query, key]
            per_seq = self.attention.fold_pattern(pattern, layer, weights)  # Σ_q over counted queries
            gu_sum = per_seq
            if mq:  # Gu et al.: every query that can see k, its own included (add the rows before min_query back).
                gu_sum = per_seq + (pattern[:, :, :mq].float() * gu_weights[layer][:, None, :mq]).sum(dim=2)
            # Virtual sink: Σ_k of Gu's column sums is Σ over real queries of their rows over visible keys.
            fold_columns(layer, per_seq, gu_sum, n_real - gu_sum.double().sum(dim=(0, 2)))

        def fold_qk(cols: Columns, layer: int) -> None:
            state.q_count[layer], state.gu_count[layer] = cols.n_counted, cols.n_every
            self.attention.add(layer, cols.counted)
            fold_columns(layer, cols.counted, cols.every, cols.unattended.double())

        def fold_columns(layer: int, per_seq: Tensor, gu_sum: Tensor, unattended: Tensor) -> None:
            row = self.attention.row[layer]
            counts = state.q_count[layer][:, None, :]
            alpha = (per_seq / counts.clamp(min=1)).double()  # α_b[h, k]
            hit = (alpha > threshold) & (counts > 0)
            self.seq_hits[row, :, : alpha.shape[2]] += hit.sum(dim=0).double()
            state.recv += alpha.mean(dim=1) / n_layers
            state.share += hit.double().mean(dim=1) / n_layers
            gu_n = state.gu_count[layer][:, None, :]
            gu_alpha = (gu_sum / gu_n.clamp(min=1)).double()
            self.gu_hits[row, :, : gu_alpha.shape[2]] += ((gu_alpha > threshold) & (gu_n > 0)).sum(dim=0).double()
            self.shortfall[row] += unattended  # the mass of the real queries' rows that goes to no key they see

        hooks = (qk_hooks(self.plan.sites, self.plan.rules, self.attention.visibility, batch.valid, fold_qk, min_query=mq)
                 if use_qk else per_layer_hooks(PATTERN, self.layers, fold))
        return BatchFold(hooks, state=state)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        state: _SinkBatch = fold.state
        self.attention.count_queries(state.q_count)
        self.prepend_bos = batch.prepend_bos
        self.special_tokens = tuple(batch.special_tokens)
        for layer, row in self.attention.row.items():
            n = state.q_count[layer].shape[1]
            self.seq_counts[row, :n] += (state.q_count[layer] > 0).sum(dim=0).double()
            self.gu_counts[row, :n] += (state.gu_count[layer] > 0).sum(dim=0).double()
        self.n_real_queries += float(sum(batch.host_lengths()))
        tokens, valid = batch.tokens.to(self.pos_ids.device), batch.valid.to(self.pos_ids.device)
        first = tokens.gather(0, valid.float().argmax(dim=0, keepdim=True))[0]  # first real row per column
        same = ((tokens == first[None]) | ~valid).all(dim=0)
        here = torch.where(valid.any(dim=0), torch.where(same, first, -1), -2)  # the token at each position
        self.pos_ids = _merge_position_tokens(self.pos_ids, here)
        q_count = torch.stack(list(state.q_count.values())).amax(dim=0)  # most counted queries over layers
        n_batch, n = q_count.shape
        counted = (q_count >= self.settings.min_query_count) & batch.valid
        tokens = batch.tokens.to(counted.device)
        position = torch.arange(n, device=counted.device)
        # Every position is folded (those not counted with weight 0), so nothing waits for the device.
        for table, where in ((self.tok_first, counted & (position == 0)), (self.tok_later, counted & (position > 0))):
            ids = torch.where(where, tokens, 0).flatten()
            table[0].index_add_(0, ids, where.flatten().to(table.dtype))
            table[1].index_add_(0, ids, torch.where(where, state.recv, 0.0).flatten())
            table[2].index_add_(0, ids, torch.where(where, state.share, 0.0).flatten())
            table[3].scatter_reduce_(0, ids, torch.where(where, state.recv, -math.inf).flatten(), reduce="amax")
        if self.settings.top_k:
            where = counted & (position > 0)
            seq_idx = torch.arange(n_batch, device=counted.device)[:, None].expand(n_batch, n) + self.n_seq
            meta = torch.stack([seq_idx, position.expand(n_batch, n), tokens], dim=-1).flatten(0, 1)
            self._keep_top(torch.where(where, state.recv, -math.inf).flatten(), state.share.flatten(), meta)
        self.n_seq += batch.tokens.shape[0]

    def _keep_top(self, vals: Tensor, shares: Tensor, meta: Tensor) -> None:
        """Keep the ``top_k`` largest of the held occurrences and these (-inf: not counted)."""
        vals = torch.cat([self.top_vals, vals.to(self.top_vals.device)])
        keep = torch.sort(vals, descending=True, stable=True).indices[: self.settings.top_k]  # ties: earlier first
        self.top_vals = vals[keep]
        self.top_share = torch.cat([self.top_share, shares.to(self.top_vals.device)])[keep]
        self.top_meta = torch.cat([self.top_meta, meta.to(self.top_vals.device)])[keep]

    def merge(self, other: SinkReducer) -> None:
        """Sums add, per-token maxima take the larger, the ``top_k`` are re-selected (``other`` saw later sequences)."""
        maxima = [torch.maximum(mine[3], theirs[3].to(mine.device))
                  for mine, theirs in ((self.tok_first, other.tok_first), (self.tok_later, other.tok_later))]
        meta = other.top_meta.clone()
        meta[:, 0] += self.n_seq
        self._keep_top(other.top_vals, other.top_share, meta)
        pos_ids = _merge_position_tokens(self.pos_ids, other.pos_ids.to(self.pos_ids.device))
        merge_statistics(self, other, [name for name in self.statistics
                                       if not name.startswith("top_") and name not in ("pos_ids", "special_tokens")])
        self.pos_ids = pos_ids
        self.special_tokens = other.special_tokens or self.special_tokens  # the later batches' record, like prepend_bos
        self.tok_first[3], self.tok_later[3] = maxima

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([int(token_id)])

    def _token_stats(self, table: Tensor) -> TokenSinkStats:
        table = table.cpu()
        ids = torch.nonzero(table[0] > 0).flatten()
        count = table[0, ids]
        return TokenSinkStats(ids, [self._decode(i) for i in ids.tolist()], count.float(),
                              mean_received=(table[1, ids] / count).float(), max_received=table[3, ids].float(),
                              mean_head_share=(table[2, ids] / count).float())

    def result(self) -> SinkResult:
        base = self.attention.result()
        n = base.received.shape[-1]
        seq_counts = self.seq_counts[:, :n]
        frac = (self.seq_hits[:, :, :n] / seq_counts[:, None].clamp(min=1)).float().cpu()
        gu_frac = (self.gu_hits[:, :, :n] / self.gu_counts[:, None, :n].clamp(min=1)).float().cpu()
        unattended = (self.shortfall / max(self.n_real_queries, 1.0)).float().cpu()
        virtual = unattended if self.sink_logits or bool(unattended.abs().max() > self.row_sum_tolerance) else None
        real = self.top_vals > -math.inf  # the top list holds -inf for positions not counted while it fills
        vals, shares, meta = self.top_vals[real].tolist(), self.top_share[real].tolist(), self.top_meta[real].tolist()
        occurrences = [SinkOccurrence(seq, pos, tok, self._decode(tok), val, share)
                       for val, share, (seq, pos, tok) in zip(vals, shares, meta)]
        return SinkResult(
            received=base.received, n_queries=base.n_queries, seq_sink_frac=frac,
            n_sequences_at=seq_counts.amax(dim=0).float().cpu(),
            layers=base.layers, settings=self.settings, n_sequences=self.n_seq, prepend_bos=self.prepend_bos,
            first_tokens=self._token_stats(self.tok_first), later_tokens=self._token_stats(self.tok_later),
            top_occurrences=occurrences, gu_seq_sink_frac=gu_frac, unattended=unattended, virtual_sink=virtual,
            position_token_ids=self.pos_ids[:n].clamp(min=-1).cpu(), special_tokens=self.special_tokens,
            attention=self.attention.visibility.to_dict(), n_queries_by_layer=base.n_queries_by_layer,
            attention_path="+".join(sorted(self.paths)) or "pattern", tokenizer=self.tokenizer,
        )


def find_sinks(model: Any, inputs: Inputs | None = None, *, layers: int | Sequence[int] | None = None,
               settings: SinkSettings | None = None, options: RunOptions = RunOptions(),
               **settings_kwargs: Any) -> SinkResult:
    """Find attention sinks: received attention per layer × head × key, sink rates, sink tokens (:class:`SinkResult`);
    any field of :class:`SinkSettings` may be given as a keyword, replacing that of ``settings``.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> result = find_sinks(tiny_model(), "t5 t6 t7 t8 t9", options=RunOptions(progress=False))
        >>> result.received.shape, 0.0 <= result.sink_rate(position=0) <= 1.0  # layer, head, key (BOS + 5 words)
        (torch.Size([2, 4, 6]), True)
    """
    return run_analyzer(model, inputs, SinkReducer, where="find_sinks", options=options, kwargs=settings_kwargs,
                        settings_cls=SinkSettings, settings=settings, layers=layers)
