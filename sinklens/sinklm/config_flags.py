"""Command-line values of the training configuration: one parser over the fields of :mod:`sinklens.sinklm.config`.

A field's key is its config path (``optim.lr``, ``data.seq_len``: config files and ``--set``); its flag is the
key with hyphens (``--optim.lr``, ``--data.seq-len``), as every other sinklens flag is spelled.
:func:`parse_args` applies flags such as ``--optim.lr 3e-4``, :func:`apply_overrides` ``--set optim.lr=3e-4``
items; the dataclasses validate the result once.

Examples:
    >>> cfg = TrainConfig.from_dict({"steps": 10, "optim": {"lr": 1e-3}})
    >>> cfg = apply_overrides(cfg, ["optim.lr=3e-4", "model.n_layers=1", "data.source=markov"])
    >>> cfg.optim.lr, cfg.model.n_layers, cfg.data.source
    (0.0003, 1, 'markov')
    >>> apply_overrides(cfg, ["optim.lr=nan"])
    Traceback (most recent call last):
    ...
    sinklens.errors.InvalidArgumentError: optim.lr must be a finite number, got nan.
"""

from __future__ import annotations

import ast
import re
import types
import typing
from typing import Any, Literal

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import _PARTS, TrainConfig
from sinklens.specs import parse_value, split_args
from sinklens.validate import closest, did_you_mean


def flag_name(key: str) -> str:
    """The command-line flag of a config key.

    Examples:
        >>> flag_name("data.seq_len"), flag_name("on_nonfinite")
        ('--data.seq-len', '--on-nonfinite')
    """
    return "--" + key.replace("_", "-")


def config_fields() -> dict[str, tuple[type, Any]]:
    """Every settable field by key, ``{"optim.lr": (OptimConfig, float), ...}``, with its type."""
    keys: dict[str, tuple[type, Any]] = {}
    for name, tp in typing.get_type_hints(TrainConfig).items():
        if name in _PARTS:
            keys |= {f"{name}.{leaf}": (_PARTS[name], t) for leaf, t in typing.get_type_hints(_PARTS[name]).items()
                     if leaf != "DERIVED"}
        else:
            keys[name] = (TrainConfig, tp)
    return keys


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)


def type_text(tp: Any) -> str:
    """A field type as ``--fields`` shows it: ``INT``, ``FLOAT|none``, ``{llama,gpt2}``, ``INT|auto``.

    Examples:
        >>> type_text(int | None), type_text(Literal["a", "b"]), type_text(bool | Literal["auto"])
        ('INT|none', '{a,b}', 'true|false|auto')
    """
    names = {int: "INT", float: "FLOAT", str: "TEXT", bool: "true|false", type(None): "none"}
    parts = []
    for member in _members(tp):
        if typing.get_origin(member) is Literal:
            choices = ",".join(map(str, typing.get_args(member)))
            parts.append(f"{{{choices}}}" if len(_members(tp)) == 1 else choices.replace(",", "|"))
        else:
            parts.append(names.get(member, "LIST" if typing.get_origin(member) is list else "MAPPING"))
    return "|".join(parts)


def parse_field(key: str, raw: str, tp: Any, *, what: str | None = None) -> Any:
    """``raw`` as a value of the field ``key`` of type ``tp``: a ``Literal`` choice as written, ``none``/``null``
    where None is allowed, ``true``/``false`` for a boolean, then an integer, a number or text, in the order the
    type lists them. The range of a value is the dataclass's to check (``__post_init__``).

    Raises:
        InvalidArgumentError: naming ``what`` (default ``key``), the value and what it could be.

    Examples:
        >>> parse_field("optim.min_lr", "none", float | None), parse_field("model.d_vocab", "auto", int | Literal["auto"])
        (None, 'auto')
        >>> parse_field("steps", "ten", int)
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: steps must be an integer, got 'ten'.
    """
    what = what or key
    text = raw.strip()
    members = _members(tp)
    choices = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    for value in choices:
        if text == str(value):
            return value
    if type(None) in members and text.lower() in ("none", "null"):
        return None
    for member in members:
        try:
            if member is bool and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if member in (int, float):
                return member(text)
        except ValueError:
            continue
        if member is str:
            return raw
        if typing.get_origin(member) is list:
            return _list_value(key, raw)
    kinds = {int: "an integer", float: "a number", bool: "true or false", type(None): "none"}
    expected = [kinds[m] for m in members if m in kinds] + [repr(v) for v in choices]
    if choices and len(expected) == len(choices):
        raise InvalidArgumentError(f"{what} must be one of {choices}, got {text!r}{did_you_mean(text, map(str, choices))}.")
    raise InvalidArgumentError(f"{what} must be {' or '.join(expected)}, got {text!r}.")


def set_values(base: TrainConfig, pairs: typing.Iterable[tuple[str, str, str]]) -> TrainConfig:
    """``base`` with ``(key, raw value, what)`` triples applied in order, then validated once by the dataclasses.

    ``what`` names the value in errors (the flag or ``--set`` item the user typed). ``model.variant_options``
    takes a mapping (``{'gain': 'shared'}``) and ``model.variant_options.NAME`` one option; either adds to the
    options already set. A ``model.variant`` other than ``base``'s starts from no variant options: ``base``'s
    were for its own variant.
    """
    fields_by_key = config_fields()
    data = base.to_dict()
    variant_options: dict[str, Any] = {}
    for key, raw, what in pairs:
        *parents, leaf = key.split(".")
        if parents[:2] == ["model", "variant_options"] and len(parents) == 2:
            variant_options[leaf] = parse_value(raw)
            continue
        if key == "model.variant_options":
            mapping = parse_value(raw)
            if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
                raise InvalidArgumentError(
                    f"model.variant_options takes a mapping such as {{'gain': 'shared'}}, got {raw.strip()!r}; "
                    "or set one option with model.variant_options.NAME=VALUE.")
            variant_options.update(mapping)
            continue
        if key not in fields_by_key:
            if parents and (len(parents) > 1 or parents[0] not in _PARTS):
                raise InvalidArgumentError(f"Unknown config section {'.'.join(parents)!r} of {what}"
                                           f"{did_you_mean(parents[0], _PARTS)}.")
            known = [k.rpartition(".")[2] for k in fields_by_key if k.rpartition(".")[0] == ".".join(parents)]
            raise InvalidArgumentError(f"Unknown config key {key!r}{did_you_mean(key, fields_by_key)}; known keys "
                                       f"here are {sorted(known)}.")
        section = data[parents[0]] if parents else data
        section[leaf] = parse_field(key, raw, fields_by_key[key][1], what=what)
    if data["model"]["variant"] != base.model.variant:
        data["model"]["variant_options"] = {}
    data["model"]["variant_options"] = {**data["model"]["variant_options"], **variant_options}
    return TrainConfig.from_dict(data)


def overrides_to_pairs(overrides: typing.Iterable[str]) -> list[tuple[str, str, str]]:
    """``--set`` items ``"section.key=value"`` as ``(key, value, item)`` triples for :func:`set_values`."""
    pairs = []
    for item in overrides:
        key, sep, raw = str(item).partition("=")
        if not sep or not key.strip():
            raise InvalidArgumentError(f"Override {item!r} is not of the form 'section.key=value' (e.g. 'optim.lr=3e-4').")
        pairs.append((key.strip(), raw, key.strip()))
    return pairs


def flags_to_pairs(args: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """Field flags ``--optim.lr 3e-4``, ``--data.seq-len=128``, ``--compile`` (a boolean alone: true) as
    ``(key, value, flag)`` triples for :func:`set_values`.

    Raises:
        InvalidArgumentError: an unknown flag (with the closest one), or a flag without its value.

    Examples:
        >>> flags_to_pairs(["--optim.lr", "3e-4", "--data.seq-len=128"])
        [('optim.lr', '3e-4', '--optim.lr'), ('data.seq_len', '128', '--data.seq-len')]
        >>> flags_to_pairs(["--data.seq_len", "128"])
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: Unknown flag --data.seq_len (did you mean --data.seq-len?); sinklens train --fields lists them.
    """
    fields_by_key = config_fields()
    flags = {flag_name(key): key for key in fields_by_key} | {"--model.variant-options": "model.variant_options"}
    pairs, i = [], 0
    while i < len(args):
        name, eq, value = str(args[i]).partition("=")
        if name not in flags:
            match = closest(name, flags)
            hint = f" (did you mean {match}?)" if match else ""
            raise InvalidArgumentError(f"Unknown flag {args[i]}{hint}; sinklens train --fields lists them.")
        key = flags[name]
        if not eq:
            if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                value, i = str(args[i + 1]), i + 1
            elif bool in _members(fields_by_key.get(key, (None, None))[1]):
                value = "true"
            else:
                raise InvalidArgumentError(f"{name} needs a value.")
        pairs.append((key, value, name))
        i += 1
    return pairs


def parse_args(base: TrainConfig, args: list[str] | tuple[str, ...]) -> TrainConfig:
    """``base`` with field flags (``--optim.lr 3e-4 --model.n-layers 2``) applied and validated (see
    :func:`flags_to_pairs`, :func:`set_values`); errors are one :class:`~sinklens.errors.InvalidArgumentError`."""
    return set_values(base, flags_to_pairs(args))


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply ``"a.b=value"`` overrides (``--set`` on the command line) and validate the result.

    Raises :class:`~sinklens.errors.InvalidArgumentError` (a ``ValueError``) for a malformed
    override, an unknown key or an invalid resulting config.
    """
    return set_values(cfg, overrides_to_pairs(overrides))


def fields_help() -> str:
    """The text of ``sinklens train --fields``: one line per field flag, its type, default and the first sentence
    of its description in the dataclass docstring."""
    defaults = TrainConfig().to_dict()
    lines = ["Every TrainConfig field is a flag (--KEY VALUE; --set KEY=VALUE and config files use the key):"]
    for key, (cls, tp) in config_fields().items():
        *parents, leaf = key.split(".")
        default = defaults[parents[0]][leaf] if parents else defaults[leaf]
        head = f"  {flag_name(key)} {type_text(tp)} = {default}"
        line = f"{head:<50} {_field_doc(cls, leaf)}".rstrip()
        lines.append(line if len(line) <= 100 else line[:97] + "...")
    return "\n".join(lines)


def _field_doc(cls: type, name: str) -> str:
    """The first sentence of ``name``'s entry in ``cls``'s ``Attributes:`` docstring section, plain text."""
    doc = cls.__doc__ or ""
    match = re.search(rf"^\s+(?:[\w, ]*\b)?{name}\b[\w, ]*:\s(.+?)(?:\.\s|\.$|\n\s*\n|\n\s+\w[\w, ]*:\s)",
                      doc.split("Attributes:", 1)[-1] if "Attributes:" in doc else "", re.MULTILINE | re.DOTALL)
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", match.group(1)) if match else ""
    return re.sub(r"\s+", " ", text.replace("``", "")).strip()


def _list_value(key: str, raw: str) -> list[str]:
    """The items of a list-typed ``--set`` value (``interventions``): one item as written
    (``restart:positions=4``), a Python list (``['restart:positions=4', 'zero']``), or the same list
    unquoted (``[restart:positions=4,scale=2,zero]``). Unquoted, the list is split at its top-level
    commas and a piece with ``=`` before any ``:`` is another ``key=value`` of the spec before it (a
    spec's name has neither), so the split is unambiguous.

    Raises:
        InvalidArgumentError: brackets that do not match, quotes in an unquoted list, or a list that
            starts with ``key=value``; the message names the key and the value.

    Examples:
        >>> _list_value("interventions", "[restart:positions=4,scale=2, zero]")
        ['restart:positions=4,scale=2', 'zero']
        >>> _list_value("interventions", "['restart:positions=[4, 8]']")
        ['restart:positions=[4, 8]']
    """
    text = raw.strip()
    if not text.startswith("["):
        return [raw]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = None
    if isinstance(value, list):
        return [str(v) for v in value]

    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{key}={text!r}: {why}; write a list of spec strings as {key}=[restart:positions=16] (several: "
            f"{key}=[NAME:K=V,K=V,NAME2]), or quoted, {key}=\"['restart:positions=16']\".")

    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if depth < 0:
            raise bad(f"the {char!r} at character {i + 1} closes nothing")
        if depth == 0 and i != len(text) - 1:
            raise bad("it goes on after the list's closing ']'")
    if depth:
        raise bad("a bracket is never closed")
    if any(q in text for q in "'\""):
        raise bad("it mixes quoted and unquoted items")
    specs: list[str] = []
    for piece in (p.strip() for p in split_args(text[1:-1])):
        if "=" in piece.partition(":")[0]:  # key=value: one more option of the spec before it
            if not specs:
                raise bad(f"{piece!r} is an option with no spec name before it")
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs
