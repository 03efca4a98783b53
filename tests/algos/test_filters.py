"""Data filters: dynamic sampling, status, and DAPO's overlong filtering (a per-sample loss mask)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage.algos.filters import (
    DynamicSampling,
    OverlongFilter,
    RenamedLengthFilter,
    StatusFilter,
    has_reward_spread,
    is_truncated,
    status_fraction,
    truncated_fraction,
)
from loongsage.core.types import Status, Trajectory


def traj(reward: float | None = 1.0, status: Status = Status.OK, length: int = 3, index: int = 0) -> Trajectory:
    return Trajectory(
        source="s",
        group_id=0,
        sample_index=index,
        prompt_ids=[1],
        response_ids=[2] * length,
        loss_mask=[1] * length,
        rollout_logprobs=[0.0] * length,
        versions=[0] * length,
        status=status,
        reward=reward,
    )


# ------------------------------------------------------------------------------ dynamic sampling


def test_dynamic_sampling_keeps_mixed_and_drops_uniform_groups() -> None:
    keep = DynamicSampling()
    assert keep([traj(1.0), traj(0.0), traj(1.0)]) is True
    assert keep([traj(1.0), traj(1.0)]) is False
    assert keep([traj(0.0)] * 4) is False
    assert keep([traj(1.0)]) is False  # one row: no baseline
    assert keep([]) is False


def test_dynamic_sampling_tolerance_and_unscored_rows() -> None:
    assert DynamicSampling(tolerance=0.1)([traj(0.5), traj(0.55)]) is False
    assert DynamicSampling(tolerance=0.1)([traj(0.5), traj(0.65)]) is True
    # A failed (unscored) row or a NaN reward does not count as a different reward.
    failed = traj(None, Status.FAILED)
    assert DynamicSampling()([traj(1.0), traj(1.0), failed, traj(float("nan"))]) is False
    assert DynamicSampling()([traj(1.0), traj(0.0), failed]) is True
    with pytest.raises(ValueError, match=r"^dynamic_sampling\.tolerance=-1\.0: "):
        DynamicSampling(tolerance=-1.0)


@settings(deadline=None, max_examples=100)
@given(
    rewards=st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12),
    tolerance=st.sampled_from([0.0, 1e-3, 0.5]),
)
def test_dynamic_sampling_keeps_exactly_the_groups_with_spread(rewards, tolerance) -> None:
    kept = DynamicSampling(tolerance=tolerance)([traj(r) for r in rewards])
    assert kept == (max(rewards) - min(rewards) > tolerance)
    assert DynamicSampling(tolerance=tolerance)([traj(rewards[0])] * len(rewards)) is False
    assert has_reward_spread(rewards, tolerance) == kept


# ------------------------------------------------------------------------------ status


def test_status_filter_default_drops_any_failure() -> None:
    f = StatusFilter()
    assert f([traj(), traj()]) is True
    assert f([traj(), traj(None, Status.FAILED)]) is False
    assert f([traj(), traj(status=Status.ABORTED)]) is True  # not listed


def test_status_filter_fraction_and_several_statuses() -> None:
    f = StatusFilter(statuses=["failed", "aborted"], max_fraction=0.5)  # the config hands lists
    assert f.statuses == ("failed", "aborted")
    group = [traj(), traj(status=Status.ABORTED), traj(None, Status.FAILED), traj()]
    assert status_fraction(group, f.statuses) == 0.5
    assert f(group) is True  # 2/4 is not more than 1/2
    assert f([*group[:3], traj(status=Status.ABORTED)]) is False  # 3/4
    with pytest.raises(ValueError, match=r"^status\.statuses=\['broken'\]: unknown 'broken'; allowed: ok, "):
        StatusFilter(statuses=["broken"])
    with pytest.raises(ValueError, match=r"^status\.statuses=\[\]: "):
        StatusFilter(statuses=[])
    with pytest.raises(ValueError, match=r"^status\.max_fraction=1\.0: "):
        StatusFilter(max_fraction=1.0)


# ------------------------------------------------------------------------------ overlong


def test_overlong_filter_keeps_every_group_and_masks_truncated_samples() -> None:
    """DAPO overlong filtering: the truncated samples leave the loss, their group stays."""
    f = OverlongFilter()
    cut = traj(status=Status.TRUNCATED)
    for group in ([cut, cut, cut], [cut, traj(), cut], [traj(None, Status.FAILED)], []):
        assert f(group) is True  # never drops (or refills) a group
    assert [f.excludes_from_loss(t) for t in (cut, traj(), traj(length=100), traj(None, Status.FAILED))] == [
        True,
        False,
        False,
        False,
    ]  # without max_length only the status counts


def test_overlong_filter_max_length() -> None:
    f = OverlongFilter(max_length=8)
    assert [f.excludes_from_loss(traj(length=n)) for n in (7, 8, 9)] == [False, True, True]
    assert f.excludes_from_loss(traj(status=Status.TRUNCATED, length=2))
    assert not f.excludes_from_loss(traj(None, Status.FAILED, length=9))  # failures are not judged
    assert truncated_fraction([traj(length=7), traj(length=8), traj(length=7), traj(length=7)], 8) == 0.25
    assert is_truncated(traj(length=8), 8) and not is_truncated(traj(length=8))
    with pytest.raises(ValueError, match=r"^overlong\.max_length=0: "):
        OverlongFilter(max_length=0)


def test_the_old_length_name_points_to_overlong_in_one_line() -> None:
    for params in ({}, {"max_truncated_frac": 0.25}, {"max_length": 8}):
        with pytest.raises(ValueError, match=r"^the 'length' filter is now 'overlong'") as info:
            RenamedLengthFilter(**params)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"use \{name: overlong, params: \{max_length: 8\}\}"):
        RenamedLengthFilter(max_length=8)


def test_a_recipe_naming_length_gets_the_one_line_error_at_validation() -> None:
    from loongsage.core.plugins import load_registry
    from loongsage.core.types import ConfigError

    registry = load_registry()
    with pytest.raises(ConfigError, match=r"^algorithm\.filters\[0\]\.params: the 'length' filter is now 'overlong'"):
        registry.create(
            "data_filter", {"name": "length", "params": {"max_truncated_frac": 0.5}}, "algorithm.filters[0]"
        )
    built = registry.create("data_filter", {"name": "overlong", "params": {"max_length": 8}}, "algorithm.filters[0]")
    assert built == OverlongFilter(max_length=8)
