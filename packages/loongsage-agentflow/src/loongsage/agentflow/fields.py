"""Typed reads of a request body's fields, each failure a one-line 400 naming the field."""

from __future__ import annotations

from typing import Any

from loongsage.agentflow.errors import bad_request

_MISSING = object()


def number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad_request(f"{name}={value!r}: must be a number in [{lo:g}, {hi:g}]", name)
    return float(value)


def integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_request(f"{name}={value!r}: must be an integer in [{lo}, {hi}]", name)
    return value


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}={value!r}: must be true or false", name)
    return value


def strings(body: dict, name: str, limit: int = 16) -> list[str]:
    """A string or a list of strings (stop sequences)."""
    value = body.get(name)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > limit:
        raise bad_request(f"{name}: must be a non-empty string or a list of at most {limit} of them", name)
    return list(items)


def text(body: dict, name: str, default: Any = _MISSING) -> Any:
    value = body.get(name, default)
    if value is _MISSING:
        raise bad_request(f"{name} is required", name)
    if value is not default and not isinstance(value, str):
        raise bad_request(f"{name} must be a string", name)
    return value


SEED_MAX = 2**63 - 1
TOKENS_MAX = 1 << 24
