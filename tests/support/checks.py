"""Prompts and hook checks shared by the tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Short prompts in the word vocabulary of :func:`sinklens.testing.tiny_model` (ids ``t2..t63``).
TINY_PROMPTS: list[str] = ["t5 t6 t7 t8 t9 t10 t11", "t3 t4 t5 t6", "t9 t9 t9 t2 t3 t4 t5 t6 t7 t8"]

#: Prompts of very different lengths (2 to 11 words, one repeated token), so batches need padding.
VARIED_PROMPTS: list[str] = [
    "t3 t4 t5 t6 t7 t8 t9 t10 t11",
    "t9 t10",
    "t11 t12 t13 t14 t15 t16",
    "t2 t2 t2 t2 t2 t2 t2 t2 t2 t2",
    "t20 t21 t22 t23 t24 t25 t26 t27 t28 t29 t30",
]

#: Five short prompts (2 to 9 words) for the planted-mechanism models of :mod:`sinklens.testing.planted`.
PLANTED_PROMPTS: list[str] = ["t3 t4 t5 t6 t7 t8", "t9 t10", "t11 t12 t13 t14", "t2 t2 t2 t2 t2 t2 t2 t2 t2", "t40 t41 t42"]


def attached_hook_count(model: Any) -> int:
    """Number of forward and backward hooks attached to the model's hook points.

    A sinklens call leaves this count as it found it. It is not always 0 on a fresh model: the
    TransformerLens 4.x BERT bridge attaches 4 hooks per layer of its own when it is built (on its
    MLP input and output hook points), so compare the count before and after a call rather than with 0.
    """
    return sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())


def no_hooks_left(model: Any) -> bool:
    """True if no hook point of the model carries a forward or backward hook (see :func:`attached_hook_count`
    for models that carry hooks of their own from the start)."""
    return attached_hook_count(model) == 0


def public_dataclasses(keep: Callable[[type], bool]) -> list[type]:
    """Every public dataclass defined in sinklens (command-line modules aside) for which ``keep(cls)`` is true,
    each once, sorted by module and name: what tests of a contract that every result class must meet walk."""
    import dataclasses
    import importlib
    import pkgutil

    import sinklens

    found = {}
    for info in pkgutil.walk_packages(sinklens.__path__, "sinklens."):
        if info.name.startswith("sinklens.cli") or ".commands" in info.name:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and not name.startswith("_")
                    and obj.__module__ == info.name and keep(obj)):
                found[f"{info.name}.{obj.__qualname__}"] = obj  # an alias of a class is found once
    return [found[key] for key in sorted(found)]
