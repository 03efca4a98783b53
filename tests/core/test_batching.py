"""Batch assembly and the per-rank / per-mini-batch split."""

from __future__ import annotations

from collections import Counter

import pytest

from loongsage.core.batching import split_groups, to_batch, trainable
from loongsage.core.types import Status, Trajectory


def _traj(source: str, group: int, k: int, prompt_len: int, resp_len: int, reward: float = 1.0) -> Trajectory:
    return Trajectory(source=source, group_id=group, sample_index=k, prompt_ids=list(range(1, prompt_len + 1)),
                      response_ids=[7] * resp_len, loss_mask=[1] * resp_len, rollout_logprobs=[-0.5] * resp_len,
                      versions=[0] * resp_len, reward=reward)


def test_to_batch_layout():
    a, b = _traj("s", 0, 0, 3, 2), _traj("s", 0, 1, 2, 4)
    b.loss_mask = [1, 0, 1, 1]
    batch = to_batch([a, b], pad_id=0)
    assert batch.input_ids.shape == (2, 6)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 1, 1]]
    assert batch.rollout_logprobs[0, 3].item() == -0.5 and batch.rollout_logprobs[0, 5].item() == 0.0
    assert batch.input_ids[0, 5].item() == 0


def test_failed_trajectories_are_not_trained():
    ok, failed = _traj("s", 0, 0, 2, 2), _traj("s", 0, 1, 2, 2)
    failed.status, failed.reward = Status.FAILED, None
    assert trainable([ok, failed]) == [ok]


@pytest.mark.parametrize("world,mbs", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_split_keeps_exact_source_proportions(world, mbs):
    groups = []
    gid = 0
    for source, count in (("math", 16), ("code", 8)):
        for _ in range(count):
            groups.append([_traj(source, gid, k, 3, 1 + (gid * 7) % 13) for k in range(4)])
            gid += 1
    parts = split_groups(groups, world, mbs)
    assert len(parts) == world and all(len(p) == mbs for p in parts)
    seen = Counter()
    for rank in parts:
        for mb in rank:
            per_source = Counter(t.source for t in mb)
            # every (rank, mini-batch) has the global 2:1 ratio of groups (x4 samples)
            assert per_source["math"] == 4 * 16 // (world * mbs)
            assert per_source["code"] == 4 * 8 // (world * mbs)
            seen.update(t.group_id for t in mb)
    assert seen == Counter({g: 4 for g in range(24)})  # every trajectory exactly once


def test_split_balances_tokens_across_ranks():
    groups = [[_traj("s", g, 0, 1, length)] for g, length in enumerate([100, 90, 80, 70, 10, 10, 5, 5])]
    parts = split_groups(groups, 2, 1)
    loads = [sum(len(t.response_ids) for t in rank[0]) for rank in parts]
    assert max(loads) - min(loads) <= 20
    assert loads[0] + loads[1] == sum([100, 90, 80, 70, 10, 10, 5, 5])
