"""Typed reads of a request body's fields, each failure a one-line 400 naming the field, and the
body itself read from its bytes (:func:`json_body`)."""

from __future__ import annotations

import json
import re
from typing import Any

from loongsage.agentflow.chat.errors import bad_request

_MISSING = object()
# a UTF-16 surrogate escape (\ud800 to \udfff) in the JSON text: in a UTF-8 body, the only way a
# lone surrogate reaches a decoded string
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_body(raw: bytes) -> Any:
    """A request body's JSON value, with every lone UTF-16 surrogate replaced by U+FFFD.

    ``"\\ud800"`` alone is valid JSON (a JavaScript client that cuts a string mid-emoji sends it),
    but such a string cannot be encoded as UTF-8: hashing, tokenizing or answering it would fail
    deep inside a turn. Replacing it here, once, gives every later step valid text, the same way
    for every protocol and field. The body must be UTF-8 (RFC 8259), so the only surrogates left
    after decoding are escaped ones and the walk is skipped for bodies without such an escape.
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}"[:300]) from None
    return without_surrogates(value) if _SURROGATE_ESCAPE.search(text) else value


def without_surrogates(value: Any) -> Any:
    """``value`` (decoded JSON) with lone surrogates in its strings and keys replaced by U+FFFD;
    containers are fixed in place, without recursion (a body may nest as deep as the parser allows)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(_SURROGATE.search(k) for k in node):
                fixed = {_SURROGATE.sub("\ufffd", k): v for k, v in node.items()}  # order kept
                node.clear()
                node.update(fixed)
            entries = list(node.items())
        elif isinstance(node, list):
            entries = list(enumerate(node))
        else:
            continue
        for k, v in entries:
            if isinstance(v, str):
                if _SURROGATE.search(v):
                    node[k] = _SURROGATE.sub("\ufffd", v)
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return value


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
