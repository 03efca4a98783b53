"""The reward worker: what a reward raises on one trajectory fails that trajectory, not its batch;
the same error on every trajectory of a batch stops the run saying which reward and why."""

from __future__ import annotations

import asyncio

import pytest

from loongsage.core.config import load_config
from loongsage.core.types import DataRecord, Status, Trajectory
from loongsage.core.workers import RewardWorker


def _batch(labels):
    trajectories = [
        Trajectory(
            source="arith",
            group_id=0,
            sample_index=k,
            prompt_ids=[1],
            response_ids=[2],
            loss_mask=[1],
            rollout_logprobs=[0.0],
            versions=[0],
            response_text="7",
        )
        for k in range(len(labels))
    ]
    records = [DataRecord(source="arith", index=k, prompt="3+4=", label=label) for k, label in enumerate(labels)]
    return trajectories, records


@pytest.fixture(scope="module")
def worker():
    cfg, _ = load_config("tiny/grpo_arith_cpu", [])
    return RewardWorker(cfg)


def test_a_reward_raising_on_one_trajectory_fails_that_one_alone(worker):
    trajectories, records = _batch(["7", None, "8"])  # exact_match refuses a record without a label
    scores = asyncio.run(worker.score(trajectories, records))
    assert [s for s, _ in scores] == [1.0, None, 0.0]
    assert scores[1][1].startswith(
        f"{Status.FAILED.value}: reward raised ValueError: exact_match: record arith[1] has no label"
    ), scores[1]


def test_the_same_error_on_every_trajectory_stops_the_run_naming_the_reward(worker):
    trajectories, records = _batch([None, None, None])
    with pytest.raises(
        RuntimeError,
        match=r"^reward 'exact_match' of source 'arith' raised the same kind of error on "
        r"all 3 trajectories of a batch: ValueError: exact_match: record arith\[0\]",
    ):
        asyncio.run(worker.score(trajectories, records))
    trajectories, records = _batch([None])  # one trajectory alone is that trajectory's failure
    assert asyncio.run(worker.score(trajectories, records))[0][0] is None
