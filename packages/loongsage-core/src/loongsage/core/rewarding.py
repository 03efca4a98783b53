"""Calling a reward: with a :class:`~loongsage.core.contracts.RewardContext` when it takes one.

A reward opts into the context by naming a third parameter ``ctx``; rule-based rewards keep the
two-argument form. Wrapper rewards (``overlong_shaping``, ``format``) call their inner reward through
:func:`call_reward` too, so a sandbox-backed reward still gets its context when it is wrapped.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable
from typing import Any

from loongsage.core.contracts import RewardContext
from loongsage.core.types import DataRecord, Trajectory


@functools.lru_cache(maxsize=256)
def _takes_ctx(call: Any) -> bool:
    try:
        return "ctx" in inspect.signature(call).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False


def takes_context(reward: Any) -> bool:
    """Whether ``reward`` (a function or an object with ``__call__``) has a ``ctx`` parameter."""
    call = reward if inspect.isfunction(reward) or inspect.ismethod(reward) else type(reward).__call__
    return _takes_ctx(call)


def call_reward(reward: Any, trajectory: Trajectory, record: DataRecord,
                ctx: RewardContext | None) -> float | Awaitable[float]:
    """``reward(trajectory, record[, ctx])``: the context only to a reward that takes it (an empty
    one when the caller has none)."""
    if takes_context(reward):
        return reward(trajectory, record, ctx=ctx if ctx is not None else RewardContext(services={}))
    return reward(trajectory, record)
