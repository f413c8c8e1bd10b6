"""Typed options: dataclasses built from plain mappings, every key and value checked.

One mechanism for every option set of the project: the experiment config
(:mod:`fedreid.config`), each client objective's ``Options``, each server
hook's ``Options`` and each dataset parser's ``Options`` are dataclasses, and
:func:`from_dict` builds any of them from a mapping (YAML, overrides, a
checkpoint), naming the full key of an unknown key, a wrong type or a value a
``validate(prefix)`` method refuses. :func:`field_docs` reads the ``#:``
comment above each field, the text the configuration reference is generated
from (``docs/configuration.md``).

This module imports nothing of fedreid but its errors, so the modules that
declare options never import the config tree.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence, Union

import yaml

from fedreid.errors import ConfigError, FedReIDError  # noqa: F401  (ConfigError: imported from here too)


def did_you_mean(name: str, candidates: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean <prefix>x?)`` for the candidates close to ``name`` (a typo), else ''."""
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""


def _tagged(exc: ConfigError, key: str) -> ConfigError:
    if exc.key is None:
        exc.key = key
    return exc


@dataclass
class NoOptions:
    """The options of a component that takes none."""


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, checking every key and value."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{prefix or 'config'}: expected a mapping, got {type(data).__name__} {data!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise _tagged(ConfigError(
            f"unknown config key {where}{unknown[0]}{did_you_mean(str(unknown[0]), list(fields), where)}; allowed keys"
            f"{' under ' + prefix if prefix else ''}: {', '.join(sorted(fields))}"
        ), f"{where}{unknown[0]}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        try:
            kwargs[name] = _coerce(hints[name], value, key)
        except ConfigError as exc:
            raise _tagged(exc, key)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate(prefix or "config")
        except ConfigError as exc:
            raise _tagged(exc, _named_key(str(exc), prefix)) if prefix else exc
    return obj


def _named_key(message: str, prefix: str) -> str:
    """The key under ``prefix`` that a validation message begins with (``fl.rounds: ...``), else ``prefix``.

    A section's ``validate`` names its field at the head of the message; tagging
    the field rather than the section lets a loader tell an override's key from
    the file's.
    """
    head = re.match(r"([A-Za-z0-9_.\[\]]+): ", message)
    if head and head.group(1).startswith(prefix + "."):
        return head.group(1)
    return prefix


def build_options(cls: type, values: Mapping[str, Any], where: str, owner: str) -> Any:
    """Dataclass ``cls`` from ``values`` like :func:`from_dict`; an unknown key is named with its owner.

    ``owner`` is what the options belong to, e.g. ``'fedprox'``:
    ``train.objective_options.tau: not an option of 'fedprox'; allowed: mu``.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping of options, got {type(values).__name__} {values!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in allowed:
            raise _tagged(ConfigError(f"{where}.{key}: not an option of {owner}{did_you_mean(str(key), allowed)}; "
                                      f"allowed: {', '.join(allowed) or 'none'}"), f"{where}.{key}")
    return from_dict(cls, values, where)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dicts/lists, ready for YAML or JSON."""
    return dataclasses.asdict(cfg)


def dump_options(cfg: Any) -> str:
    """``cfg`` as YAML, keys in declaration order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {'; '.join(errors)}")
    if value is None:
        raise ConfigError(f"{key}: a value is required, got null")
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {allowed}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (list, tuple, Sequence):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _coerce(key_tp, k, key): _coerce(val_tp, v, f"{key}.{k}") for k, v in value.items()
        }
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads exponents without a dot (1e-5) as strings.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # no rate, weight or fraction of the config may be nan or infinite
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


def check_positive(key: str, value: float) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``value > 0`` (NaN fails)."""
    if not value > 0:  # nan too
        raise ConfigError(f"{key}: expected a positive value, got {value}")


def check_range(
    key: str, value: float, low: float, high: float, *, low_open: bool = False
) -> None:
    bad = not low <= value <= high or (low_open and value == low)  # nan too
    if bad:
        op = "<" if low_open else "<="
        raise ConfigError(f"{key}: expected {low} {op} value <= {high}, got {value}")


def field_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` of the ``#:`` comment lines directly above each field of dataclass ``cls``.

    Fields without such a comment are absent. Inherited fields are read from
    the class that declares them.
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        source = textwrap.dedent("".join(lines))
        body = ast.parse(source).body[0]
        text = source.splitlines()
        for node in getattr(body, "body", []):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                comment: list[str] = []
                row = node.lineno - 2
                while row >= 0 and text[row].strip().startswith("#:"):
                    comment.insert(0, text[row].strip()[2:].strip())
                    row -= 1
                if comment:
                    out[node.target.id] = " ".join(comment)
    return out


def type_name(tp: Any) -> str:
    """A short readable name of a field's type hint: ``int``, ``list[str]``, ``'a' | 'b'``, ``float | null``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def field_defaults(cls: type) -> dict[str, Any]:
    """``{field: default}`` of dataclass ``cls`` (factories called; fields without a default absent)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


__all__ = [
    "ConfigError",
    "NoOptions",
    "build_options",
    "check_positive",
    "check_range",
    "dump_options",
    "field_defaults",
    "field_docs",
    "from_dict",
    "to_dict",
    "type_name",
]
