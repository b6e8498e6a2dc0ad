"""Positional discrepancy (*Transformers Are Born Biased*, arXiv 2602.05927; measures defined here): a head's output at
``t`` averages ``t + 1`` values, so its variance across inputs shrinks with ``t`` and the first token's outputs vary
most. Sites: ``attn_out`` (the attention write), ``resid`` (the residual right after it), ``head`` (``attn.hook_z``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.display import CompactRepr, StructuralEq
from sinklens.export import to_json
from sinklens.hooks import Z, hook_name, model_device, model_dims
from sinklens.inputs import TokenBatch
from sinklens.options import SEQ_LEN, RunOptions, checked_options, settings_from
from sinklens.origins.preference import RandomInputs, stream_random
from sinklens.residual_sites import after_attention_hooks, attention_write_hooks
from sinklens.sinklm.checkpoint import checkpoint_steps, load_step_model, load_train_config
from sinklens.streaming import BatchFold, Reducer
from sinklens.visibility import attention_direction


#: The ``[layer, pos]`` fields whose first-token ratios are summarised.
RATIO_FIELDS = ("attn_out_var", "attn_out_norm", "resid_var", "resid_norm")


@dataclass(repr=False, eq=False)
class PositionalDiscrepancy(CompactRepr):
    """``variance[t] = (1/d) Σ_d Var_n(a[n, t, d])`` (population variance across ``N`` sequences) and
    ``norm[t] = (1/N) Σ_n ‖a[n, t]‖``: ``[layer, pos]`` for ``attn_out`` and ``resid``, ``[layer, head, pos]``
    for ``hook_z``. After a BOS ratios read position 1; ``causal`` is False on an encoder."""

    attn_out_var: Float[Tensor, "layer pos"]
    attn_out_norm: Float[Tensor, "layer pos"]
    resid_var: Float[Tensor, "layer pos"]
    resid_norm: Float[Tensor, "layer pos"]
    head_var: Float[Tensor, "layer head pos"]
    n_sequences: int
    prepend_bos: bool = False
    causal: bool = True

    @property
    def first_counted(self) -> int:
        """The first position of a random token: 0, or 1 after a prepended BOS."""
        return 1 if self.prepend_bos else 0

    def relative(self, name: str) -> Float[Tensor, "... pos"]:
        """A field (e.g. ``"attn_out_var"``) over its later half: ``x[..., t] / mean(x[..., ⌊T/2⌋:])``."""
        x = getattr(self, name)
        return x / x[..., x.shape[-1] // 2 :].mean(dim=-1, keepdim=True)

    def first_token_ratio(self, name: str = "attn_out_var") -> Float[Tensor, " layer"]:
        """``relative(name)`` at the first random token (position 0, or 1 after a prepended BOS)."""
        return self.relative(name)[..., self.first_counted]

    def ratios(self) -> dict[str, Tensor]:
        """``[layer]`` :meth:`first_token_ratio` of each ``[layer, pos]`` field."""
        return {name: self.first_token_ratio(name) for name in RATIO_FIELDS}

    def summary(self) -> dict[str, Any]:
        """Strict JSON (NaN as None) for ``origins.json``: :meth:`ratios`, ``n_sequences``, ``position``, ``causal``."""
        return to_json({**self.ratios(), "n_sequences": self.n_sequences, "position": self.first_counted,
                        "causal": self.causal}, digits=None)

    def to_dict(self) -> dict[str, Any]:
        """Every field plus ``position`` and ``first_token_ratio`` (:meth:`ratios`), strict-JSON-ready."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return to_json({**data, "position": self.first_counted, "first_token_ratio": self.ratios()}, digits=None)


class _Moments:
    """Σ_n a, Σ_n ‖a‖², Σ_n ‖a‖ per (group, position) over the last axis."""

    def __init__(self, shape: tuple[int, ...], d: int, device: torch.device) -> None:
        zeros = partial(torch.zeros, dtype=torch.float64, device=device)
        self.sum, self.sq, self.norm = zeros(*shape, d), zeros(*shape), zeros(*shape)

    def add(self, index: Any, a: Tensor) -> None:  # a: [batch, *group, pos, d]
        a = a.double()
        self.sum[index] += a.sum(dim=0)
        self.sq[index] += a.pow(2).sum(dim=-1).sum(dim=0)
        self.norm[index] += a.norm(dim=-1).sum(dim=0)

    def merge(self, other: _Moments) -> None:
        """Add ``other``'s sums (the same sites, other sequences)."""
        for mine, theirs in ((self.sum, other.sum), (self.sq, other.sq), (self.norm, other.norm)):
            mine += theirs.to(mine.device)

    def variance(self, n: int) -> Tensor:
        return ((self.sq / n - (self.sum / n).pow(2).sum(dim=-1)) / self.sum.shape[-1]).clamp_min(0).float().cpu()


class PositionalReducer(Reducer[PositionalDiscrepancy]):
    """Streams :class:`PositionalDiscrepancy` over every layer."""

    statistics = ("attn", "resid", "head", "n")

    def __init__(self, model: Any, seq_len: int, *, prepend_bos: bool = False) -> None:
        self.model, self.dims, self.device = model, model_dims(model), model_device(model)
        self.seq_len, self.prepend_bos, self.causal = seq_len, prepend_bos, attention_direction(model) == "causal"
        self.reset()

    def reset(self) -> None:
        L, T, d, H, dh = self.dims.n_layers, self.seq_len, self.dims.d_model, self.dims.n_heads, self.dims.d_head
        self.attn, self.resid = _Moments((L, T), d, self.device), _Moments((L, T), d, self.device)
        self.head = _Moments((L, H, T), dh, self.device)
        self.n = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        layers = range(self.dims.n_layers)
        hooks = after_attention_hooks(self.model, layers, self.resid.add) + attention_write_hooks(self.model, layers, self.attn.add)
        hooks += [(hook_name(layer, Z), lambda act, hook, l=layer: self.head.add(l, act.transpose(1, 2)))
                  for layer in layers]
        return BatchFold(hooks)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n += batch.tokens.shape[0]

    def result(self) -> PositionalDiscrepancy:
        n = self.n
        return PositionalDiscrepancy(self.attn.variance(n), (self.attn.norm / n).float().cpu(), self.resid.variance(n),
                                     (self.resid.norm / n).float().cpu(), self.head.variance(n), n, self.prepend_bos,
                                     self.causal)


def positional_discrepancy(
    model: Any, random: RandomInputs | None = None, *,
    options: RunOptions = RunOptions(progress=False, desc="positional"), **random_kwargs: Any,
) -> PositionalDiscrepancy:
    """Per layer and position: across-sequence variance and mean norm of attention outputs and residuals, on
    :class:`~sinklens.origins.preference.RandomInputs` (``random``, or its fields as keywords).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> pd = positional_discrepancy(tiny_model(), n_sequences=16, seq_len=8)
        >>> pd.head_var.shape, bool(pd.first_token_ratio("attn_out_var")[0] > 1)
        (torch.Size([2, 4, 8]), True)
    """
    random = settings_from(RandomInputs, random, random_kwargs, "positional_discrepancy", argument="random")
    return stream_random(model, random, PositionalReducer(model, random.seq_len, prepend_bos=random.prepend_bos), options)


@dataclass(eq=False)
class PositionalTrajectory(StructuralEq):
    """:class:`PositionalDiscrepancy` of one training run at each of ``steps`` (0 is ``RUN_DIR@init``)."""

    steps: list[int]
    results: list[PositionalDiscrepancy]

    def first_token_ratio(self, name: str = "attn_out_var") -> Float[Tensor, "step layer"]:
        """``[step, layer]`` :meth:`PositionalDiscrepancy.first_token_ratio` at every step."""
        return torch.stack([r.first_token_ratio(name) for r in self.results])

    def summary(self) -> dict[str, Any]:
        """``steps`` and the ``[step, layer]`` :meth:`first_token_ratio` by name, strict-JSON-ready (undefined: None)."""
        return to_json({"steps": self.steps, **{name: self.first_token_ratio(name) for name in RATIO_FIELDS}},
                       digits=None)


def positional_over_training(
    run_dir: Any, *, steps: Any = None, n_sequences: int = 128, seq_len: int = SEQ_LEN,
    prepend_bos: bool = False, seed: int = 0,
    options: RunOptions = RunOptions(progress=False, desc="positional"),
) -> PositionalTrajectory:
    """:func:`positional_discrepancy` of a ``sinklens train`` run at step 0 (``RUN_DIR@init``) and at each kept
    checkpoint (or ``steps``), all on the same random sequences of ``min(seq_len, data.seq_len)`` tokens."""
    random = RandomInputs(n_sequences, min(int(seq_len), load_train_config(run_dir).data.seq_len), prepend_bos, seed)
    wanted = sorted({0, *checkpoint_steps(run_dir)}) if steps is None else sorted({int(s) for s in steps})
    options = checked_options(options)
    bar = tqdm(wanted, desc=f"{options.desc} ({Path(run_dir).name})", unit="checkpoint", disable=not options.progress)
    quiet = options.replace(progress=False)
    return PositionalTrajectory(wanted, [positional_discrepancy(load_step_model(run_dir, step), random, options=quiet)
                                         for step in bar])
