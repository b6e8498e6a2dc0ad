"""Token preference at init (*Transformers Are Born Biased*, arXiv 2602.05927; measures defined here): the
mean next-token distribution ``mean_probs[t, j] = (1/N) Σ_n softmax(logits[n, t])_j`` and argmax counts
over ``N`` seeded uniform random sequences (optionally after a BOS), of causal models only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dims
from sinklens.inputs import TokenBatch, random_token_batches
from sinklens.options import SEQ_LEN, RunOptions, checked_options, settings_from
from sinklens.origins.sites import final_state_site, logits_from_final
from sinklens.streaming import R, BatchFold, Reducer, stream
from sinklens.validate import as_seed, positive_int
from sinklens.visibility import attention_direction


@dataclass(repr=False, eq=False)
class TokenPreference(CompactRepr):
    """Mean next-token distribution ``mean_probs`` ``[pos, vocab]`` (logits from the final state, soft-capped as
    the model does; float32 softmax, float64 sums) and argmax counts (tied maxima counted in ``argmax_ties``
    instead) over ``n_sequences`` random sequences; pooled summaries skip a BOS."""

    mean_probs: Float[Tensor, "pos vocab"]
    argmax_counts: Int[Tensor, "pos vocab"]
    n_sequences: int
    prepend_bos: bool
    argmax_ties: Int[Tensor, " pos"] | None = None

    @property
    def first_counted(self) -> int:
        return 1 if self.prepend_bos and self.mean_probs.shape[0] > 1 else 0

    @property
    def probs(self) -> Float[Tensor, " vocab"]:
        """The pooled mean next-token distribution over the counted positions."""
        return self.mean_probs[self.first_counted :].mean(dim=0)

    @property
    def argmax_total(self) -> Int[Tensor, " vocab"]:
        return self.argmax_counts[self.first_counted :].sum(dim=0)

    @property
    def max_median_ratio(self) -> float:
        """``max probs / median probs`` (the lower median)."""
        return float(self.probs.max() / self.probs.median())

    def top(self, k: int = 10) -> list[dict[str, Any]]:
        """The ``k`` most probable tokens: ``{"token", "prob", "rel_uniform"}`` (``prob · d_vocab``)."""
        p = self.probs
        values, ids = torch.topk(p, min(k, p.numel()))
        return [{"token": int(i), "prob": float(v), "rel_uniform": float(v) * p.numel()} for v, i in zip(values, ids)]

    @property
    def argmax_entropy(self) -> float:
        """Entropy (nats) of ``c / Σc``, ``c`` = :attr:`argmax_total`."""
        c = self.argmax_total.double()
        q = c[c > 0] / c.sum()
        return float(-(q * q.log()).sum())

    @property
    def argmax_gini(self) -> float:
        """``Σ_i Σ_j |c_i − c_j| / (2 V Σc)``: 0 when equal, ``1 − 1/V`` when one token takes all."""
        c = torch.sort(self.argmax_total.double()).values
        n, total = c.numel(), float(c.sum())
        if total == 0:
            return 0.0
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        return float((2 * (ranks * c).sum()) / (n * total) - (n + 1) / n)

    def ranked(self) -> Float[Tensor, " vocab"]:
        """``probs`` sorted in decreasing order (the rank–probability curve)."""
        return torch.sort(self.probs, descending=True).values

    def summary(self) -> dict[str, Any]:
        ties = 0 if self.argmax_ties is None else int(self.argmax_ties[self.first_counted :].sum())
        return {
            "n_sequences": self.n_sequences, "seq_len": int(self.mean_probs.shape[0]), "prepend_bos": self.prepend_bos,
            "d_vocab": int(self.mean_probs.shape[1]), "max_median_ratio": self.max_median_ratio,
            "argmax_entropy": self.argmax_entropy, "argmax_entropy_uniform": math.log(self.mean_probs.shape[1]),
            "argmax_gini": self.argmax_gini, "argmax_ties": ties, "top": self.top(10),
        }

    def to_dict(self) -> dict[str, Any]:
        """:meth:`summary`, ``first_counted``, pooled ``probs`` and ``argmax_total`` (``[vocab]``), strict-JSON-ready."""
        return to_json({**self.summary(), "first_counted": self.first_counted, "probs": self.probs,
                        "argmax_total": self.argmax_total}, digits=None)


class TokenPreferenceReducer(Reducer[TokenPreference]):
    """Streams :class:`TokenPreference` from the final hidden state of every position."""

    statistics = ("prob_sum", "counts", "ties", "n")

    def __init__(self, model: Any, seq_len: int, *, prepend_bos: bool = False) -> None:
        refuse_encoder(model, "token_preference")
        self.model, self.device = model, model_device(model)
        self.site, self.finish = final_state_site(model)
        self.seq_len, self.d_vocab, self.prepend_bos = seq_len, model_dims(model).d_vocab_out, prepend_bos  # the logits
        self.reset()

    def reset(self) -> None:
        self.prob_sum = torch.zeros(self.seq_len, self.d_vocab, dtype=torch.float64, device=self.device)
        self.counts = torch.zeros(self.seq_len, self.d_vocab, dtype=torch.long, device=self.device)
        self.ties = torch.zeros(self.seq_len, dtype=torch.long, device=self.device)
        self.n = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        def fold(act: Tensor, hook: Any) -> None:  # act: [batch, pos, d_model]
            logits = logits_from_final(self.model, self.finish(act))  # (B, T, V)
            self.prob_sum += torch.softmax(logits, dim=-1).sum(dim=0).double()
            top = logits.max(dim=-1, keepdim=True).values
            tied = (logits == top).sum(dim=-1) > 1  # (B, T): no argmax
            self.ties += tied.sum(dim=0)
            self.counts.scatter_add_(1, logits.argmax(dim=-1).T, (~tied).long().T)

        return BatchFold([(self.site, fold)])

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n += batch.tokens.shape[0]

    def result(self) -> TokenPreference:
        return TokenPreference((self.prob_sum / max(self.n, 1)).float().cpu(), self.counts.cpu(), self.n, self.prepend_bos,
                               self.ties.cpu())


def refuse_encoder(model: Any, what: str) -> None:
    """Raise :class:`~sinklens.errors.UnsupportedArchitectureError` naming ``what`` for a bidirectional model."""
    if attention_direction(model) == "bidirectional":
        raise UnsupportedArchitectureError(
            f"{what} needs a causal (next-token) model, but {type(model).__name__} "
            f"({getattr(model.cfg, 'model_name', None) or 'this model'}) attends both ways (an encoder such as BERT): its "
            "logits at position t predict the token at t, which it sees, so their mean is no next-token preference.")


@dataclass(frozen=True)
class RandomInputs:
    """Random inputs of every origins measure: ``n_sequences`` × ``seq_len`` ids uniform in ``[0, d_vocab)``
    (``seed``), BOS at position 0 if ``prepend_bos``; at least 2 random tokens."""

    n_sequences: int = 128
    seq_len: int = SEQ_LEN
    prepend_bos: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_sequences", positive_int(self.n_sequences, what="n_sequences", minimum=2))
        object.__setattr__(self, "seq_len", positive_int(self.seq_len, what="seq_len", minimum=2))
        object.__setattr__(self, "seed", as_seed(self.seed, what="seed"))
        random_tokens_after_bos(self.seq_len, self.prepend_bos, what="seq_len")


def random_tokens_after_bos(seq_len: int, prepend_bos: bool, *, what: str = "seq_len", bos: str = "prepend_bos=True") -> None:
    """Refuse a ``seq_len`` that leaves fewer than 2 random tokens after a prepended BOS."""
    if prepend_bos and seq_len < 3:
        raise InvalidArgumentError(
            f"{what}={seq_len} with {bos} leaves {seq_len - 1} random token after the BOS; the origins measures "
            f"need at least 2 (contraction's intra-sequence cosine pairs positions): use {what} >= 3.")


def random_batches(model: Any, random: RandomInputs, options: RunOptions) -> list[TokenBatch]:
    """Uniform random token batches on the model's device (the inputs of every origins measure)."""
    options = checked_options(options)
    batches = random_token_batches(model, n_sequences=random.n_sequences, seq_len=random.seq_len,
                                   batch_size=options.batch_size, prepend_bos=random.prepend_bos, seed=random.seed)
    return [b.to(model_device(model)) for b in batches]


def stream_random(model: Any, random: RandomInputs, reducer: Reducer[R], options: RunOptions) -> R:
    """Stream ``reducer`` over :func:`random_batches` and return its result."""
    (result,) = stream(model, random_batches(model, random, options), [reducer], options=options)
    return result


def token_preference(
    model: Any, random: RandomInputs | None = None, *,
    options: RunOptions = RunOptions(progress=False, desc="token preference"), **random_kwargs: Any,
) -> TokenPreference:
    """Mean next-token distribution and argmax counts on :class:`RandomInputs` (``random``, or its fields as
    keywords; default 256 sequences).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> pref = token_preference(tiny_model(), n_sequences=8, seq_len=4)
        >>> pref.mean_probs.shape, round(float(pref.probs.sum()), 4)
        (torch.Size([4, 64]), 1.0)
    """
    random = settings_from(RandomInputs, random, random_kwargs, "token_preference", defaults={"n_sequences": 256},
                           argument="random")
    return stream_random(model, random, TokenPreferenceReducer(model, random.seq_len, prepend_bos=random.prepend_bos), options)
