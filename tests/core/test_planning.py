"""The step planner: rows of the step batch dealt to DP ranks and mini-batches, without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from loongsage.core.batching import to_batch
from loongsage.core.config import load_config
from loongsage.core.planning import StepPlan, check_divisible, plan_step
from loongsage.core.types import ConfigError, Trajectory


def _traj(source: str, group: int, k: int, prompt_len: int, resp_len: int) -> Trajectory:
    return Trajectory(
        source=source,
        group_id=group,
        sample_index=k,
        prompt_ids=list(range(1, prompt_len + 1)),
        response_ids=[7] * resp_len,
        loss_mask=[1] * resp_len,
        rollout_logprobs=[-0.5] * resp_len,
        versions=[0] * resp_len,
        reward=1.0,
    )


def _mixed(counts: dict[str, int], samples: int = 4) -> list[list[Trajectory]]:
    """Groups of several sources with varied lengths, interleaved as a rollout would return them."""
    groups, gid = [], 0
    for source, count in counts.items():
        for _ in range(count):
            groups.append([_traj(source, gid, k, 3, 1 + (gid * 7 + k) % 13) for k in range(samples)])
            gid += 1
    return groups[::2] + groups[1::2]


def _rows_of(groups: list[list[Trajectory]]) -> list[Trajectory]:
    return [t for g in groups for t in g]


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("world,mbs", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 1)])
def test_every_rank_and_mini_batch_gets_the_exact_source_proportions(world, mbs):
    groups = _mixed({"math": 16, "code": 8})
    plan = plan_step(groups, world, mbs, quotas={"math": 16, "code": 8})
    trajs = _rows_of(groups)
    assert (plan.world_size, plan.mini_batches) == (world, mbs)
    for rank in plan.rows:
        for rows in rank:
            per_source = Counter(trajs[i].source for i in rows)
            assert per_source == {"math": 4 * 16 // (world * mbs), "code": 4 * 8 // (world * mbs)}


@pytest.mark.parametrize("world,mbs", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_every_row_exactly_once_and_groups_stay_whole(world, mbs):
    groups = _mixed({"a": 5, "b": 7}, samples=3)
    groups[2] = groups[2][:1]  # a group left with one sample (the others failed)
    plan = plan_step(groups, world, mbs)
    trajs = _rows_of(groups)
    placed = [i for rank in plan.rows for rows in rank for i in rows]
    assert sorted(placed) == list(range(len(trajs)))
    where = {}
    for r, rank in enumerate(plan.rows):
        for m, rows in enumerate(rank):
            for i in rows:
                where.setdefault(trajs[i].group_id, set()).add((r, m))
    assert all(len(places) == 1 for places in where.values())  # a group's rows share one baseline


def test_rows_index_the_batch_that_to_batch_builds():
    groups = _mixed({"a": 4, "b": 4})
    trajs = _rows_of(groups)
    batch = to_batch(trajs, pad_id=0)
    plan = plan_step(groups, 2, 2)
    for rank in plan.rows:
        for rows in rank:
            picked = batch.select(list(rows))
            assert picked.trajectory_ids == [(trajs[i].group_id, trajs[i].sample_index) for i in rows]
            assert picked.sources == [trajs[i].source for i in rows]
            assert set(Counter(g for g, _ in picked.trajectory_ids).values()) == {4}  # whole groups
    assert plan.rank_rows(1) == [*plan.rows[1][0], *plan.rows[1][1]]


def test_a_mini_batch_is_prepared_whole_and_each_rank_takes_its_slice():
    """Global denominators: the loss weights of a mini-batch are decided over every rank's rows."""
    plan = plan_step(_mixed({"a": 8}), 4, 2)
    for m in range(2):
        union = plan.mini_batch_rows(m)
        assert union == [i for r in range(4) for i in plan.rows[r][m]]
        positions = plan.positions(m)
        assert [[union[p] for p in pos] for pos in positions] == [list(plan.rows[r][m]) for r in range(4)]


def test_ranks_get_balanced_token_loads():
    groups = [[_traj("s", g, 0, 1, length)] for g, length in enumerate([100, 90, 80, 70, 10, 10, 5, 5])]
    plan = plan_step(groups, 2, 1)
    trajs = _rows_of(groups)
    loads = [sum(len(trajs[i].response_ids) for i in plan.rank_rows(r)) for r in range(2)]
    assert max(loads) - min(loads) <= 20 and sum(loads) == 370


def test_the_dealing_is_pinned():
    """Longest group first, snake order over ranks, round robin over mini-batches, sources in name order."""
    lengths = {"b": [3, 9, 5, 7], "a": [2, 8, 4, 6]}
    groups, gid = [], 0
    for source, lens in lengths.items():
        for length in lens:
            groups.append([_traj(source, gid, 0, 1, length)])
            gid += 1
    plan = plan_step(groups, 2, 2)
    # a (rows 4-7; lengths 2 8 4 6): 8->r0, 6->r1, 4->r1, 2->r0; then b (rows 0-3; 3 9 5 7): 9->r0, 7->r1, 5->r1, 3->r0
    assert plan == StepPlan(rows=(((5, 1), (4, 0)), ((7, 3), (6, 2))))


def test_fewer_groups_than_ranks_leaves_ranks_empty():
    """A step short of its quota: every row is placed, the ranks without any are still in the plan
    (every rank takes part in each collective, with an empty batch)."""
    groups = _mixed({"a": 1, "b": 2})
    plan = plan_step(groups, 4, 1, quotas={"a": 4, "b": 4})
    assert [len(plan.rank_rows(r)) for r in range(4)] == [8, 4, 0, 0]
    assert plan.positions(0)[2:] == [[], []]


def test_a_short_step_is_dealt_as_evenly_as_it_allows():
    plan = plan_step(_mixed({"a": 7}, samples=1), 2, 2, quotas={"a": 8})
    assert sorted(len(rows) for rank in plan.rows for rows in rank) == [1, 2, 2, 2]


@pytest.mark.parametrize(
    "quotas,world,mbs,numbers",
    [
        (
            {"a": 6},
            2,
            2,
            "6 groups per step cannot be shared exactly by trainer.world_size x "
            "trainer.mini_batches_per_step = 2 x 2 = 4 parts",
        ),
        ({"a": 8, "b": 3}, 1, 2, "'b': 3 groups per step"),
        ({"a": 8}, 3, 1, "= 3 x 1 = 3 parts"),
    ],
)
def test_indivisible_counts_are_refused_naming_the_numbers(quotas, world, mbs, numbers):
    groups = _mixed(quotas, samples=1)
    with pytest.raises(ValueError) as exc:
        plan_step(groups, world, mbs, quotas=quotas)
    assert numbers in _one_line(exc)


def test_more_groups_than_the_quota_are_refused():
    with pytest.raises(ValueError) as exc:
        plan_step(_mixed({"a": 6}), 1, 1, quotas={"a": 4})
    assert _one_line(exc) == "plan_step: source 'a' has 6 groups, more than its quota of 4 per step"


def test_bad_sizes_and_empty_groups_are_refused():
    with pytest.raises(ValueError, match="world_size=0"):
        plan_step(_mixed({"a": 2}), 0, 1)
    with pytest.raises(ValueError, match="without trajectories"):
        plan_step([[]], 1, 1)


@pytest.mark.parametrize("prompts,world,mbs", [(8, 1, 1), (8, 2, 2), (8, 3, 1), (6, 2, 2), (12, 2, 3), (9, 1, 2)])
def test_config_validation_refuses_exactly_what_the_planner_refuses(prompts, world, mbs):
    """The startup check (config validation) and the planner agree on every split."""
    overrides = [
        "tracking.progress=false",
        f"data_sources.0.prompts_per_step={prompts}",
        f"trainer.world_size={world}",
        f"trainer.mini_batches_per_step={mbs}",
    ]
    try:
        load_config("tiny/grpo_arith_cpu", overrides)
        config_ok = True
    except ConfigError as exc:
        assert "prompts_per_step" in str(exc)
        config_ok = False
    try:
        check_divisible({"arith": prompts}, world, mbs)
        planner_ok = True
    except ValueError:
        planner_ok = False
    assert config_ok == planner_ok
