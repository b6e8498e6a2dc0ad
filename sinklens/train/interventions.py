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
    """The ``(hook_name, fn)`` pairs of training-time interventions, built by the intervention registry.

    A string is a registry spec ``"name:key=value,..."`` (e.g. ``"restart:positions=16"`` →
    :func:`sinklens.interventions.masks.restart`, which makes every query at or after 16 ignore
    keys before 16, so position 16 becomes a second "first token"); see
    :func:`sinklens.interventions.registry.build`. A callable is called with the model.
    """
    from sinklens.interventions import registry

    hooks: Hooks = []
    for item in interventions:
        hooks.extend(registry.build(model, item))
    return hooks


def check_interventions(interventions: Sequence[Intervention]) -> None:
    """Validate intervention specs without a model (registered name, ``key=value`` arguments)."""
    from sinklens.interventions import registry

    for item in interventions:
        registry.check_spec(item)


def try_interventions(model: Any, hooks: Hooks, cfg: TrainConfig) -> bool:
    """Run the hooks of the training-time interventions given as registry specs once on the run's training
    sequences (``data.seq_len`` tokens), before the run directory is touched, so that one that cannot run there (a
    position past those sequences) is an error up front rather than at the first step, with ``config.json``
    already written. (A callable intervention is the caller's own code and is not called before the run.)

    Returns whether they also run on the persistence probe's shorter sequences (``eval.persistence_seq_len``, when
    persistence is measured); where they do not (a position past the probe's sequences, which would not exist on
    them anyway), the probe measures the model without them, at step 0 and later alike, so that the metric still
    compares like with like.

    Raises:
        InvalidArgumentError: they cannot run on the training sequences; the message names ``data.seq_len``.
    """
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
