"""Checks shared by sinklens' tests and by anyone testing their own hooks with sinklens."""

from __future__ import annotations

from typing import Any

#: Short prompts in the word vocabulary of :func:`sinklens.testing.tiny_model` (ids ``t2..t63``).
TINY_PROMPTS: list[str] = ["t5 t6 t7 t8 t9 t10 t11", "t3 t4 t5 t6", "t9 t9 t9 t2 t3 t4 t5 t6 t7 t8"]


def attached_hook_count(model: Any) -> int:
    """Number of forward and backward hooks attached to the model's hook points (0 after any sinklens call)."""
    return sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())


def no_hooks_left(model: Any) -> bool:
    """True if no hook point of the model carries a forward or backward hook."""
    return attached_hook_count(model) == 0
