"""Typed validation of plain config values against dataclasses and factory signatures.

One validator serves both the config tree (:mod:`loongsage.core.config`) and every plugin's
``params`` (checked against the plugin factory's own signature), so every bad key gets the same
kind of one-line error: the key path, what was found, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Literal, Union

from loongsage.core.types import ConfigError

MISSING = object()  # a parameter without a default (fields_of), told apart from a default of None
RANGE = "loongsage.range"  # dataclass field metadata key: the field's allowed range (see ``ranged``)


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a number (or of each number in a list): bounds, and a note on special values."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""  # e.g. "0 = never"

    def allows(self, value: float) -> bool:
        # written as "not (ok)" so that NaN, which fails every comparison, is refused
        return not (
            (self.ge is not None and not value >= self.ge)
            or (self.gt is not None and not value > self.gt)
            or (self.le is not None and not value <= self.le)
            or (self.lt is not None and not value < self.lt)
        )

    def describe(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else ""
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else ""
        if low and high:
            text = f"must be in {low}, {high}"
        elif low:
            text = f"must be >= {self.ge:g}" if self.ge is not None else f"must be > {self.gt:g}"
        elif high:
            text = f"must be <= {self.le:g}" if self.le is not None else f"must be < {self.lt:g}"
        else:
            text = "any number"
        return f"{text} ({self.note})" if self.note else text


def ranged(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    note: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with an allowed range, checked by :func:`check_params` (so by ``build_dataclass``
    and every plugin's params) with the usual one-line error::

        every_steps: int = ranged(0, ge=0, note="0 = only at the end")
        -> config.checkpoint.every_steps=-1: must be >= 0 (0 = only at the end)

    ``None`` (an optional field left unset) is always allowed; a list is checked item by item.
    """
    meta = {RANGE: Range(ge, gt, le, lt, note)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_range(value: Any, rng: Range, path: str) -> None:
    """Raise ConfigError ``<path>=<value>: must be ...`` if ``value`` (or an item of it) is out of range."""
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_range(item, rng, f"{path}[{i}]")
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not rng.allows(value):
        raise ConfigError(f"{path}={_describe(value)}: {rng.describe()}")


def ranges_of(factory: Any) -> dict[str, Range]:
    """The ``ranged`` fields of a dataclass (name -> Range); empty for anything else."""
    if not dataclasses.is_dataclass(factory):
        return {}
    return {f.name: f.metadata[RANGE] for f in dataclasses.fields(factory) if RANGE in f.metadata}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` checked (and mildly coerced: int -> float) against type ``tp``."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: got {_describe(value)}; allowed: {', '.join(repr(a) for a in args)}")
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1:  # Optional[X]: X's own error says more than "expected X | null"
            return coerce(value, candidates[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{path}: got {_describe(value)}; expected {_type_name(tp)}")
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: got {_describe(value)}; expected a list")
        item_tp = args[0] if args else Any
        return [coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, typing.Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: got {_describe(value)}; expected a mapping")
        val_tp = args[1] if len(args) == 2 else Any
        return {k: coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: got {_describe(value)}; expected a mapping of {tp.__name__} keys")
        return build_dataclass(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: got {_describe(value)}; expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: got {_describe(value)}; expected an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: got {_describe(value)}; expected true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: got {_describe(value)}; expected a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: got {_describe(value)}; expected {_type_name(tp)}")
    return value


def fields_of(factory: Any) -> dict[str, tuple[Any, Any]]:
    """Map parameter name -> (type, default or MISSING) for a dataclass or any callable."""
    if dataclasses.is_dataclass(factory):
        hints = typing.get_type_hints(factory)
        out = {}
        for f in dataclasses.fields(factory):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = MISSING
            out[f.name] = (hints.get(f.name, Any), default)
        return out
    sig = inspect.signature(factory)
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # unresolvable annotations: fall back to no type checks
        hints = {}
    out = {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = MISSING if p.default is p.empty else p.default
        out[name] = (hints.get(name, Any), default)
    return out


def check_params(factory: Any, params: dict[str, Any], path: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate ``params`` against ``factory``'s parameters; return them coerced.

    ``skip`` names parameters the framework supplies itself (e.g. ``model_path``) and that a user
    may not set.
    """
    fields = {k: v for k, v in fields_of(factory).items() if k not in skip}
    params = coerce({} if params is None else params, dict[str, Any], path)  # a copy; one line if not a mapping
    unknown = sorted(set(params) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(f"{path}.{unknown[0]}: unknown key; allowed: {allowed}")
    ranges = ranges_of(factory)
    out = {}
    for name, (tp, default) in fields.items():
        if name in params:
            out[name] = coerce(params[name], tp, f"{path}.{name}")
            if name in ranges:
                check_range(out[name], ranges[name], f"{path}.{name}")
        elif default is MISSING:
            raise ConfigError(f"{path}.{name}: missing required key (type {_type_name(tp)})")
    return out


def build_dataclass(cls: type, values: dict[str, Any], path: str) -> Any:
    """Build ``cls`` from a plain mapping with one-line errors for unknown, missing and mistyped keys."""
    params = check_params(cls, values, path)
    try:
        return cls(**params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(join_error(path, exc, params)) from None


def join_error(path: str, exc: Exception, keys: Any = ()) -> str:
    """One line: a factory's own message prefixed with the key path.

    Messages that start with ``field=value`` (the project's convention) land under that field:
    ``config.algorithm`` + ``aggregation='x': ...`` -> ``config.algorithm.aggregation='x': ...``.
    """
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    head = message.split("=", 1)[0]
    if head in keys or (head.isidentifier() and "=" in message and " " not in head):
        return f"{path}.{message}"
    return f"{path}: {message}"


def describe_params(factory: Any) -> str:
    """``name: type = default`` for each parameter, for ``loongsage plugins --verbose``."""
    parts = []
    ranges = ranges_of(factory)
    for name, (tp, default) in fields_of(factory).items():
        text = f"{name}: {_type_name(tp)}"
        if default is not MISSING:
            text += f" = {default!r}"
        if name in ranges:
            text += f" [{ranges[name].describe()}]"
        parts.append(text)
    return ", ".join(parts)
