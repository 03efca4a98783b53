"""Calling a reward: with a :class:`~loongsage.core.contracts.RewardContext` when it takes one.

A reward opts into the context by declaring the flag ``takes_context`` (:class:`~loongsage.core.contracts.Reward`);
rule-based rewards keep the two-argument form. Wrapper rewards (``overlong_shaping``, ``format``)
call their inner reward through :func:`call_reward` too, so a sandbox-backed reward still gets its
context when it is wrapped.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from loongsage.core.contracts import RewardContext
from loongsage.core.types import DataRecord, Trajectory


def call_reward(
    reward: Any, trajectory: Trajectory, record: DataRecord, ctx: RewardContext | None
) -> float | Awaitable[float]:
    """``reward(trajectory, record[, ctx=ctx])``: the context only to a reward that declares
    ``takes_context`` (an empty one when the caller has none). ``reward`` is an entry the registry
    built, so its flags are set (the defaults of those it left out)."""
    if reward.takes_context:
        return reward(trajectory, record, ctx=ctx if ctx is not None else RewardContext(services={}))
    return reward(trajectory, record)
