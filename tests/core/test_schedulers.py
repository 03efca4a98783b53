"""Rollout schedulers as pure decisions over counters (no Ray)."""

from __future__ import annotations

import pytest

from loongsage.core.rollout.schedulers import (
    NoWindowScheduler,
    OneStepOffScheduler,
    SyncScheduler,
    WindowedFifoScheduler,
    WindowGatedScheduler,
)
from loongsage.core.types import SchedulerState

B = 4


def state(version=0, in_flight=0, buffered=0, consumed=0, dispatched=0, oldest=0) -> SchedulerState:
    return SchedulerState(
        version=version,
        groups_per_step=B,
        in_flight=in_flight,
        buffered=buffered,
        consumed=consumed,
        dispatched=dispatched,
        oldest_unconsumed=oldest,
    )


def test_sync_dispatches_one_step_once_the_last_is_consumed():
    s = SyncScheduler()
    assert s.max_staleness == 0 and not s.asynchronous
    assert s.groups_to_dispatch(state()) == B
    assert s.groups_to_dispatch(state(in_flight=1)) == 0 and s.groups_to_dispatch(state(buffered=1)) == 0


def test_one_step_off_keeps_at_most_the_next_step_ahead():
    s = OneStepOffScheduler()
    assert s.max_staleness == 1 and s.asynchronous
    assert s.groups_to_dispatch(state()) == B
    # one step ahead, never two: a second step's worth would lag two versions when trained
    assert s.groups_to_dispatch(state(in_flight=B)) == 0
    assert s.groups_to_dispatch(state(in_flight=1, buffered=B - 1)) == 0
    assert s.groups_to_dispatch(state(in_flight=1, buffered=1, consumed=B)) == B - 2  # a filtered group's place


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_window_holds_the_areal_staleness_bound(eta):
    s = NoWindowScheduler(max_staleness=eta)
    assert s.groups_to_dispatch(state()) == (eta + 1) * B
    # after v batches were consumed, at most (eta + 1) * B may be kept or running
    for v in range(4):
        live = dict(consumed=v * B, in_flight=2, buffered=1)
        assert s.groups_to_dispatch(state(version=v, **live)) == (eta + 1) * B - 3
    assert s.groups_to_dispatch(state(version=0, in_flight=(eta + 1) * B + 5)) == 0  # never negative


def test_window_gated_waits_for_a_straggler():
    s = WindowGatedScheduler(max_staleness=1)
    # 8 dispatched, only one still running but it is the oldest (seq 0): the window is full
    assert s.groups_to_dispatch(state(version=2, consumed=2 * B, in_flight=1, dispatched=16, oldest=8)) == 0
    # no_window would dispatch here
    assert (
        NoWindowScheduler(max_staleness=1).groups_to_dispatch(
            state(version=2, consumed=2 * B, in_flight=1, dispatched=16, oldest=8)
        )
        == 2 * B - 1
    )
    assert s.groups_to_dispatch(state(version=2, consumed=2 * B, in_flight=1, dispatched=16, oldest=12)) == 4


def test_windowed_fifo_collects_only_near_the_oldest():
    s = WindowedFifoScheduler(max_staleness=2)
    st = state(dispatched=20, oldest=5)
    assert [seq for seq in range(20) if s.collectable(seq, st)] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert NoWindowScheduler().collectable is None  # any finished group


def test_mask_old_versions_keeps_only_the_newest_version_and_untouched_tokens():
    from loongsage.core.rollout.service import mask_old_versions
    from loongsage.core.types import Trajectory

    t = Trajectory(
        source="s",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[5, 6, 7, 8, 9, 10],
        loss_mask=[1, 1, 0, 1, 1, 0],
        rollout_logprobs=[0.0] * 6,
        versions=[3, 3, -1, 4, 4, 4],
    )
    assert mask_old_versions(t) == 2
    assert t.loss_mask == [0, 0, 0, 1, 1, 0]  # the prompt-side token (-1) and a masked one stay as they were
    whole = Trajectory(
        source="s",
        group_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[5, 6],
        loss_mask=[1, 1],
        rollout_logprobs=[0.0] * 2,
        versions=[2, 2],
    )
    assert mask_old_versions(whole) == 0 and whole.loss_mask == [1, 1]
