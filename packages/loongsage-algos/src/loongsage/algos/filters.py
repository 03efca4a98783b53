"""Data filters: ``group: list[Trajectory] -> bool`` (True keeps the group), and sample masks.

Each filter is a pure predicate over plain values and a small entry class
(:func:`loongsage.core.entries.entry`) whose annotated attributes are the recipe's ``params`` and
whose call applies the predicate to a group. Filters run after rewards, on whole groups; a dropped
group may be refilled by the scheduler from oversampling.

A filter may also judge single samples: ``excludes_from_loss(trajectory) -> bool``. The trainer
keeps such samples in the step's batch while the advantages are computed (their rewards count in
their group's statistics) and then gives them loss mask 0, so they leave the numerator and the
denominator of the loss (:func:`loongsage.core.batching.loss_excluded`). DAPO's overlong filtering
(``overlong``) is one: it keeps every group and masks its truncated samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, ClassVar

from loongsage.core.contracts import DataFilter
from loongsage.core.entries import Range, entry
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


def is_truncated(trajectory: Trajectory, max_length: int | None = None) -> bool:
    """Status ``truncated``, or (with ``max_length``) at least ``max_length`` response tokens, for
    agents that do not set the status. A failed trajectory is never judged truncated."""
    if trajectory.status is Status.FAILED:
        return False
    return trajectory.status is Status.TRUNCATED or (
        max_length is not None and len(trajectory.response_ids) >= max_length
    )


def truncated_fraction(group: Sequence[Trajectory], max_length: int | None = None) -> float | None:
    """The fraction of the group's non-failed trajectories that hit the length limit.

    Truncated means status ``truncated``, or (with ``max_length``) ``len(response_ids) >=
    max_length``, for agents that do not set the status. None when no trajectory is left to judge.
    """
    judged = [t for t in group if t.status is not Status.FAILED]
    if not judged:
        return None
    return sum(is_truncated(t, max_length) for t in judged) / len(judged)


# The group predicates are small classes over those functions: the contract calls them with a group
# (a list of trajectories) while the functions above take plain values.


@entry("dynamic_sampling")
class DynamicSampling(DataFilter):
    """``dynamic_sampling``: drop groups whose scored rewards are all equal (within ``tolerance``).

    Groups with fewer than two scored trajectories are dropped too: no baseline can be formed.
    """

    tolerance: Annotated[float, Range(ge=0)] = 0.0

    def __call__(self, group: list[Trajectory]) -> bool:
        return has_reward_spread(scored_rewards(group), self.tolerance)


@entry("status")
class StatusFilter(DataFilter):
    """``status``: drop groups where more than ``max_fraction`` of the trajectories have one of
    ``statuses`` (default: any failed trajectory drops its group)."""

    statuses: tuple[str, ...] = (Status.FAILED.value,)
    max_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "statuses", tuple(self.statuses))  # the config gives a list
        if not self.statuses:
            raise ValueError(f"status.statuses=[]: must name at least one of {', '.join(_STATUSES)}")
        unknown = [s for s in self.statuses if s not in _STATUSES]
        if unknown:
            raise ValueError(
                f"status.statuses={list(self.statuses)}: unknown {unknown[0]!r}; allowed: {', '.join(_STATUSES)}"
            )

    def __call__(self, group: list[Trajectory]) -> bool:
        return status_fraction(group, self.statuses) <= self.max_fraction


@entry("overlong", excludes_from_loss=is_truncated)
class OverlongFilter(DataFilter):
    """``overlong``: DAPO's overlong filtering. Truncated samples get loss mask 0; groups are kept.

    A truncated response was cut by the length limit, not judged on its answer, so its reward is
    noise: DAPO keeps it out of the loss. The sample still counts in its group's advantage
    statistics (the advantages are computed before the mask is applied), as in DAPO. Truncated
    means status ``truncated``, or with ``max_length`` at least that many response tokens
    (:func:`is_truncated`). The group predicate keeps every group, so nothing is refilled because
    of this filter.
    """

    max_length: Annotated[int | None, Range(ge=1, note="null: the truncated status only")] = None

    def __call__(self, group: list[Trajectory]) -> bool:
        return True


@entry("length")
class RenamedLengthFilter(DataFilter):
    """``length``: renamed ``overlong``, which masks truncated samples instead of dropping groups.

    Kept under the old name only to answer a recipe that still uses it with one line; it accepts
    the old params so that the message, not an unknown-key error, is what the user sees.
    """

    renamed_to: ClassVar[str] = "overlong"

    max_truncated_frac: float | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        keep = f", params: {{max_length: {self.max_length}}}" if self.max_length is not None else ""
        raise ValueError(
            "the 'length' filter is now 'overlong' (DAPO overlong filtering): it masks truncated samples out of "
            f"the loss and keeps their group; use {{name: overlong{keep}}} (max_truncated_frac is gone)"
        )

    def __call__(self, group: list[Trajectory]) -> bool:  # the contract's member; never built (see above)
        raise AssertionError("unreachable: the 'length' filter refuses to be built")
