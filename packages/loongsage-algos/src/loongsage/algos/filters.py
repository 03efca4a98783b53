"""Group filters: ``group: list[Trajectory] -> bool`` (True keeps the group).

Each filter is a pure predicate over plain values plus a frozen dataclass that binds its parameters
(the fields are the recipe's ``params`` schema) and implements the hook's call. Filters run after
rewards, on whole groups; a dropped group may be refilled by the scheduler from oversampling.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loongsage.core.types import Status, Trajectory

_STATUSES = tuple(s.value for s in Status)


def scored_rewards(group: Iterable[Trajectory]) -> list[float]:
    """The finite rewards of a group; unscored (failed) and non-finite ones are left out."""
    return [float(t.reward) for t in group if t.reward is not None and math.isfinite(t.reward)]


def has_reward_spread(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """``max(rewards) - min(rewards) > tolerance``; False for fewer than two rewards.

    A group whose rewards are all equal (within ``tolerance``) has zero advantage under every
    group baseline, so it only dilutes the batch (DAPO's dynamic sampling drops it).
    """
    return len(rewards) >= 2 and max(rewards) - min(rewards) > tolerance


def status_fraction(group: Sequence[Trajectory], statuses: Iterable[str]) -> float:
    """The fraction of the group whose status is one of ``statuses`` (0 for an empty group)."""
    wanted = set(statuses)
    return sum(t.status.value in wanted for t in group) / len(group) if group else 0.0


def truncated_fraction(group: Sequence[Trajectory], max_length: int | None = None) -> float | None:
    """The fraction of the group's non-failed trajectories that hit the length limit.

    Truncated means status ``truncated``, or (with ``max_length``) ``len(response_ids) >=
    max_length``, for agents that do not set the status. None when no trajectory is left to judge.
    """
    judged = [t for t in group if t.status is not Status.FAILED]
    if not judged:
        return None
    hit = sum(
        t.status is Status.TRUNCATED or (max_length is not None and len(t.response_ids) >= max_length)
        for t in judged
    )
    return hit / len(judged)


@dataclass(frozen=True)
class DynamicSampling:
    """``dynamic_sampling``: drop groups whose scored rewards are all equal (within ``tolerance``).

    Groups with fewer than two scored trajectories are dropped too: no baseline can be formed.
    """

    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not self.tolerance >= 0:
            raise ValueError(f"dynamic_sampling.tolerance={self.tolerance}: must be >= 0")

    def __call__(self, group: list[Trajectory]) -> bool:
        return has_reward_spread(scored_rewards(group), self.tolerance)


@dataclass(frozen=True)
class StatusFilter:
    """``status``: drop groups where more than ``max_fraction`` of the trajectories have one of
    ``statuses`` (default: any failed trajectory drops its group)."""

    statuses: tuple[str, ...] = (Status.FAILED.value,)
    max_fraction: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "statuses", tuple(self.statuses))  # the config gives a list
        if not self.statuses:
            raise ValueError(f"status.statuses=[]: must name at least one of {', '.join(_STATUSES)}")
        unknown = [s for s in self.statuses if s not in _STATUSES]
        if unknown:
            raise ValueError(
                f"status.statuses={list(self.statuses)}: unknown {unknown[0]!r}; allowed: {', '.join(_STATUSES)}"
            )
        if not 0 <= self.max_fraction < 1:
            raise ValueError(f"status.max_fraction={self.max_fraction}: must be in [0, 1)")

    def __call__(self, group: list[Trajectory]) -> bool:
        return status_fraction(group, self.statuses) <= self.max_fraction


@dataclass(frozen=True)
class LengthFilter:
    """``length``: drop groups whose responses hit the length limit.

    ``max_truncated_frac`` None drops a group only when every judged trajectory is truncated; a
    number drops it when the truncated fraction exceeds it. ``max_length`` also counts responses of
    at least that many tokens as truncated. Failed trajectories are not judged; a group with none
    left is kept (the ``status`` filter decides about failures).
    """

    max_truncated_frac: float | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.max_truncated_frac is not None and not 0 <= self.max_truncated_frac < 1:
            raise ValueError(
                f"length.max_truncated_frac={self.max_truncated_frac}: must be in [0, 1) "
                "(or null: drop only all-truncated groups)"
            )
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(
                f"length.max_length={self.max_length}: must be >= 1 (or null: use the truncated status only)"
            )

    def __call__(self, group: list[Trajectory]) -> bool:
        frac = truncated_fraction(group, self.max_length)
        if frac is None:
            return True
        if self.max_truncated_frac is None:
            return frac < 1.0
        return frac <= self.max_truncated_frac
