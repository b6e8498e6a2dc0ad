"""``name:key=value,...`` specs, as the CLI takes interventions (``--intervention``) and attention
variants (``--variant``): one parser for both."""

from __future__ import annotations

import ast
from typing import Any

from sinklens.errors import InvalidArgumentError

__all__ = ["parse_value", "split_spec"]


def split_args(text: str) -> list[str]:
    """Split ``a=1,b=[1,2]`` at top-level commas."""
    parts, depth = [""], 0
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append("")
        else:
            parts[-1] += char
    return [p for p in parts if p.strip()]


def parse_value(text: str) -> Any:
    """A spec value: a Python literal (``16``, ``[0, 1]``, ``2.5``, ``None``) or else a bare string.

    Examples:
        >>> parse_value("[0, 1]"), parse_value("zero"), parse_value("2.5")
        ([0, 1], 'zero', 2.5)
    """
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def split_spec(spec: str, *, what: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` → ``(name, {key: value})``, values by :func:`parse_value`; ``what``
    names the kind of spec in errors.

    Examples:
        >>> split_spec("headwise_rms:gain=shared,eps=1e-5", what="attention variant")
        ('headwise_rms', {'gain': 'shared', 'eps': 1e-05})
        >>> split_spec("baseline", what="attention variant")
        ('baseline', {})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgumentError(f"An {what} spec must be a non-empty string 'name:key=value,...', got {spec!r}.")
    name, _, args = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in split_args(args):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InvalidArgumentError(f"{what.capitalize()} argument {item!r} in {spec!r} is not of the form key=value.")
        kwargs[key.strip()] = parse_value(value)
    return name.strip(), kwargs
