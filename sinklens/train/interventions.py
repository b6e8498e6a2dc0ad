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
    device = next(model.parameters()).device

    def runs_on(length: int) -> InvalidArgumentError | None:
        tokens = torch.zeros(1, length, dtype=torch.long, device=device)
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=hooks):
                model(tokens)
        except InvalidArgumentError as error:
            return error
        return None

    error = runs_on(cfg.data.seq_len)
    if error is not None:
        raise InvalidArgumentError(f"A training-time intervention cannot run on the run's {cfg.data.seq_len}-token "
                                   f"training sequences (data.seq_len={cfg.data.seq_len}): {error}") from None
    probe = min(cfg.eval.persistence_seq_len, cfg.data.seq_len)
    if not (cfg.eval.interval and cfg.eval.persistence_sequences) or probe >= cfg.data.seq_len:
        return True
    error = runs_on(probe)
    if error is None:
        return True
    warnings.warn(f"The training-time interventions cannot run on the persistence probe's {probe}-token sequences "
                  f"(eval.persistence_seq_len={cfg.eval.persistence_seq_len}): {error} Persistence is measured without "
                  f"them; raise eval.persistence_seq_len to measure it with them.", stacklevel=3)
    return False
