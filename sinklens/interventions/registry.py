"""The one registry of interventions (experiments, sweeps, the trainer, the CLI): factories
``factory(model, *, positions, layers=None, **options) -> [(hook_name, fn)]`` by name (``self_only`` or
``self-only``) and role; spec strings ``"name:key=value,..."`` go through :func:`parse_spec` and :func:`build`.

Examples:
    >>> from sinklens.testing import tiny_model
    >>> hooks = build(tiny_model(), "self-only:positions=3,layers=[0]")
    >>> [name for name, _ in hooks]
    ['blocks.0.attn.hook_attn_scores']
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from sinklens.errors import InvalidArgumentError
from sinklens.specs import split_spec

if TYPE_CHECKING:
    from sinklens.options import HookFn

Hooks = list[tuple[str, "HookFn"]]
Role = Literal["create", "remove", "edit"]
Factory = Callable[..., Hooks]


@dataclass(frozen=True)
class Intervention:
    """``requires``: options it cannot run without (beyond ``positions``), with a hint; ``sink_defaults``: defaults
    of ``create_sink`` / ``remove_sink`` only (a spec keeps the factory's); ``sink_option``: its sink keyword."""

    name: str
    role: Role
    factory: Factory
    requires: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    sink_option: str | None = None
    sink_defaults: Mapping[str, Any] = field(default_factory=dict)

    def _params(self) -> list[inspect.Parameter]:
        params = list(inspect.signature(self.factory).parameters.values())[1:]  # after model
        return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def options(self) -> list[str]:
        return [p.name for p in self._params()]

    def effective_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The options the factory runs with: its defaults, the registry's, then ``given`` (no ``positions``)."""
        out = {**{p.name: p.default for p in self._params() if p.default is not p.empty}, **self.defaults, **given}
        out.pop("positions", None)
        return out

    def __call__(self, model: Any, **options: Any) -> Hooks:
        """``factory(model, **defaults | options)``; a missing or unknown option raises InvalidArgumentError."""
        kwargs = {**self.defaults, **options}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(self.factory).parameters.values())
        unknown = sorted(k for k in kwargs if k not in self.options())
        if unknown and not takes_any:
            raise InvalidArgumentError(
                f"Intervention {self.name!r} has no option {unknown[0]!r}; its options are {self.options()}.")
        for p in self._params():
            if p.default is p.empty and kwargs.get(p.name) is None:
                what = self.requires.get(p.name, f"{p.name}=...")
                raise InvalidArgumentError(f"Intervention {self.name!r} needs {what}.")
        return list(self.factory(model, **kwargs))


_REGISTRY: dict[str, Intervention] = {}


def canonical(name: str) -> str:
    """``"self-only"`` -> ``"self_only"`` (names are case-sensitive identifiers)."""
    return str(name).strip().replace("-", "_")


def register(
    name: str, factory: Factory, *, role: Role,
    requires: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None,
    sink_option: str | None = None, sink_defaults: Mapping[str, Any] | None = None,
) -> Intervention:
    """Register ``factory`` under ``name`` (``ValueError`` if taken); see :class:`Intervention`."""
    key = canonical(name)
    if not key.isidentifier():
        raise InvalidArgumentError(f"An intervention name must be an identifier (hyphens allowed), got {name!r}.")
    if key in _REGISTRY:
        raise ValueError(f"An intervention named {key!r} is already registered.")
    if role not in ("create", "remove", "edit"):
        raise InvalidArgumentError(f"role must be 'create', 'remove' or 'edit', got {role!r}.")
    _REGISTRY[key] = Intervention(key, role, factory, dict(requires or {}), dict(defaults or {}),
                                  sink_option, dict(sink_defaults or {}))
    return _REGISTRY[key]


def names(role: Role | None = None) -> list[str]:
    """Registered names (canonical, sorted), optionally of one role."""
    return sorted(n for n, e in _REGISTRY.items() if role is None or e.role == role)


def get(name: str, *, role: Role | None = None) -> Intervention:
    """The entry registered as ``name`` (hyphens or underscores); a did-you-mean error otherwise."""
    key = canonical(name)
    if (entry := _REGISTRY.get(key)) is None:
        choices = names(role)
        close = difflib.get_close_matches(key, choices, n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        what = f"{role} intervention" if role else "intervention"
        raise InvalidArgumentError(f"Unknown {what} {name!r}; registered: {choices}.{hint}")
    if role is not None and entry.role != role:
        raise InvalidArgumentError(
            f"{name!r} is a {entry.role} intervention, not a {role} one; {role} interventions: {names(role)}.")
    return entry


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the canonical name and its keyword arguments."""
    name, kwargs = split_spec(spec, what="intervention")
    return get(name).name, kwargs


def build(model: Any, spec: str | Callable[[Any], Hooks], **overrides: Any) -> Hooks:
    """The hooks of a spec string (``"name:key=value"``, ``overrides`` winning) or of a callable ``model -> hooks``."""
    if callable(spec):
        return list(spec(model))
    name, kwargs = parse_spec(spec)
    return get(name)(model, **{**kwargs, **overrides})


def check_spec(spec: str | Callable[[Any], Hooks]) -> None:
    """Validate a spec string without a model: the name exists and the arguments parse."""
    if not callable(spec):
        parse_spec(spec)


