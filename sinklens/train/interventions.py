"""Training-time interventions: build them from registry specs and try them before a run starts."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import TrainConfig
from sinklens.streaming import HookFn

Hooks = list[tuple[str, HookFn]]
#: A training-time intervention: a registry spec string ``"name:key=value,..."`` or ``model -> hooks``.
Intervention = Union[str, Callable[[Any], Hooks]]


def resolve_interventions(model: Any, interventions: Sequence[Intervention]) -> Hooks:
    """The ``(hook_name, fn)`` pairs of training-time interventions: registry specs (``"restart:positions=16"``)
    or callables of the model."""
    from sinklens.interventions import registry
    return [hook for item in interventions for hook in registry.build(model, item)]


def check_interventions(interventions: Sequence[Intervention]) -> None:
    """Validate intervention specs without a model (registered name, ``key=value`` arguments)."""
    from sinklens.interventions import registry
    for item in interventions:
        registry.check_spec(item)


def try_interventions(model: Any, hooks: Hooks, cfg: TrainConfig) -> bool:
    """Run the spec interventions once on the training sequences, so one that cannot run there raises
    :class:`InvalidArgumentError` up front; return whether they also run on the persistence probe's sequences."""
    if not hooks:
        return True
    seq_len, probe = cfg.data.seq_len, min(cfg.eval.persistence_seq_len, cfg.data.seq_len)
    probed = cfg.eval.interval and cfg.eval.persistence_sequences and probe < seq_len
    for length in [seq_len, probe] if probed else [seq_len]:
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=hooks):
                model(torch.zeros(1, length, dtype=torch.long, device=next(model.parameters()).device))
        except InvalidArgumentError as error:
            if length == seq_len:
                raise InvalidArgumentError(f"A training-time intervention cannot run on the run's {seq_len}-token "
                                           f"training sequences (data.seq_len={seq_len}): {error}") from None
            warnings.warn(f"The training-time interventions cannot run on the persistence probe's {probe}-token "
                          f"sequences (eval.persistence_seq_len={cfg.eval.persistence_seq_len}): {error} Persistence "
                          "is measured without them; raise eval.persistence_seq_len to measure it with them.",
                          stacklevel=3)
            return False
    return True
