"""Multi-segment trajectories without a model: their checks, the forward's layout, and that a
trajectory stays one trajectory for advantages, loss aggregation and metrics whatever its segments."""

from __future__ import annotations

import pytest
import torch

from loongsage.algos.advantages import GRPO, RLOO
from loongsage.algos.policy_losses import PPOClip
from loongsage.core.aggregation import AGGREGATION_MODES
from loongsage.core.batching import compute_advantages, to_batch
from loongsage.core.loss import LossPlan, consistency_metrics
from loongsage.core.segments import segment_layout
from loongsage.core.trainer.micro_batching import plan_micro_batches
from loongsage.core.types import Segment, Trajectory


def _traj(group: int, k: int, reward: float, segments: bool) -> Trajectory:
    """Prompt of 3, answer of 4, new prompt of 3, answer of 2: two segments [0, 7) and [7, 12)."""
    mask = [1, 1, 1, 1, 0, 0, 0, 1, 1]
    return Trajectory(
        source="s",
        group_id=group,
        sample_index=k,
        prompt_ids=[5, 6, 7],
        response_ids=list(range(10, 19)),
        loss_mask=mask,
        rollout_logprobs=[-0.5 * m for m in mask],
        versions=[0 if m else -1 for m in mask],
        reward=reward,
        segments=[Segment(0, 7), Segment(7, 12, "compaction")] if segments else [],
    )


def _single(group: int, k: int, reward: float, answer: int) -> Trajectory:
    return Trajectory(
        source="s",
        group_id=group,
        sample_index=k,
        prompt_ids=[5, 6],
        response_ids=[9] * answer,
        loss_mask=[1] * answer,
        rollout_logprobs=[-1.0] * answer,
        versions=[0] * answer,
        reward=reward,
    )


@pytest.mark.parametrize(
    "segments, message",
    [
        ([Segment(0, 5), Segment(6, 12)], "must tile tokens [0, 12)"),
        ([Segment(0, 7), Segment(7, 7), Segment(7, 12)], "none empty"),
        ([Segment(7, 12), Segment(0, 7)], "in order"),
        ([Segment(0, 7), Segment(7, 11)], "end at 11, not at the trajectory's 12 tokens"),
        ([Segment(0, 5), Segment(5, 12)], "segment 1 starts at token 5, which is trained"),
    ],
)
def test_bad_segments_are_one_line_errors(segments, message):
    trajectory = _traj(3, 1, 1.0, segments=False)
    trajectory.segments = segments
    with pytest.raises(ValueError, match="trajectory 3/1") as err:
        to_batch([trajectory], pad_id=0)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_layout_splits_rows_into_segments_and_merges_back():
    batch = to_batch([_single(0, 0, 1.0, 3), _traj(0, 1, 1.0, segments=True)], pad_id=0)
    layout = segment_layout(batch)
    assert layout.rows.tolist() == [0, 1, 1] and layout.starts.tolist() == [0, 0, 7]
    assert layout.lengths.tolist() == [5, 7, 5] and layout.width == 7
    split = layout.split(batch.input_ids)
    assert split.tolist() == [[5, 6, 9, 9, 9, 0, 0], [5, 6, 7, 10, 11, 12, 13], [14, 15, 16, 17, 18, 0, 0]]
    assert layout.split_batch(batch).attention_mask.sum(-1).tolist() == [5, 7, 5]

    values = torch.randn(3, 7, requires_grad=True)
    merged = layout.merge(values, batch.input_ids.shape[1])
    assert merged.shape == batch.input_ids.shape
    assert torch.equal(merged[1, 7:12], values[2, :5].detach()) and torch.equal(merged[0, :5], values[0, :5].detach())
    assert (merged[0, 5:] == 0).all()
    merged.sum().backward()  # every real position gets its gradient back, padding none
    assert values.grad.tolist() == [[1.0] * 5 + [0.0] * 2, [1.0] * 7, [1.0] * 5 + [0.0] * 2]
    # a support's log-probs from sequence position 2 on, put back from flat position 3 on
    tail = layout.merge(values[:, 2:], 12, first=2, out_first=3)
    assert tail.shape == (2, 9) and torch.equal(tail[1, 7 + 2 - 3], values[2, 2].detach())
    assert torch.equal(tail[1, 0], values[1, 3].detach()) and torch.equal(tail[0, 0], values[0, 3].detach())


def test_rows_without_several_segments_are_not_split():
    batch = to_batch([_single(0, 0, 1.0, 3), _single(0, 1, 1.0, 4)], pad_id=0)
    assert segment_layout(batch) is None
    batch.segments = [[Segment(0, 5)], [Segment(0, 6)]]
    assert segment_layout(batch) is None


@pytest.mark.parametrize("estimator", [GRPO(), GRPO(std_normalize=False), RLOO()])
def test_advantages_are_per_trajectory(estimator):
    rewards = [1.0, 0.0, 0.0, 1.0]
    plain = to_batch([_traj(0, k, r, segments=False) for k, r in enumerate(rewards)], pad_id=0)
    split = to_batch([_traj(0, k, r, segments=(k < 2)) for k, r in enumerate(rewards)], pad_id=0)
    assert split.rewards.tolist() == rewards  # one reward per trajectory
    a_plain = compute_advantages(plain, estimator).advantages
    a_split = compute_advantages(split, estimator).advantages
    assert torch.equal(a_plain, a_split)
    # one value on every trained token of a trajectory, both segments' alike
    trained = split.response_mask[0] != 0
    assert a_split[0, trained].unique().numel() == 1 and a_split[0, trained][0] != 0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_a_split_trajectory_weighs_as_one_trajectory(mode):
    trajectories = [_traj(0, 0, 1.0, segments=True), _traj(0, 1, 0.0, segments=False), _single(0, 2, 1.0, 4)]
    batch = to_batch(trajectories, pad_id=0)
    pipeline = LossPlan(policy_loss=PPOClip(), aggregation=mode)
    weights = pipeline.prepare(batch)[0].loss_weights
    unsplit = to_batch([_traj(0, 0, 1.0, segments=False)] + trajectories[1:], pad_id=0)
    assert torch.equal(weights, pipeline.prepare(unsplit)[0].loss_weights)
    per_trajectory = weights.sum(-1)
    if mode == "seq-mean-token-mean":  # each trajectory 1/3, its segments together
        torch.testing.assert_close(per_trajectory, torch.full((3,), 1 / 3))
    elif mode == "seq-mean-token-sum":  # tokens / 3 trajectories: 6 trained tokens either way
        torch.testing.assert_close(per_trajectory[:2], torch.full((2,), 6 / 3))
    elif mode == "token-mean":  # each token once
        torch.testing.assert_close(per_trajectory, torch.tensor([6, 6, 4]) / 16)


def test_consistency_metrics_count_a_split_trajectory_once():
    batch = to_batch([_traj(0, 0, 1.0, segments=True), _single(0, 1, 1.0, 4)], pad_id=0)
    old = batch.rollout_logprobs + 0.1 * batch.response_mask
    metrics = consistency_metrics(old, batch.rollout_logprobs, batch.response_mask, "seq-mean-token-mean")
    assert metrics.ratios["train/is_approx_k3_kl"][1] == 2.0  # two trajectories, three segments


def test_planning_with_one_sequence_per_row_is_the_plain_plan():
    lengths = [5, 40, 7, 33, 12, 12, 60, 3]
    for budget in (40, 100, 1000):
        for grouped in (True, False):
            assert plan_micro_batches(lengths, budget, group_by_length=grouped, widths=[1] * 8) == plan_micro_batches(
                lengths, budget, group_by_length=grouped
            )
    # a row of three sequences costs three rows
    assert plan_micro_batches([10, 10], 30, group_by_length=False, widths=[3, 1]) == [[0], [1]]
    assert plan_micro_batches([10, 10], 40, group_by_length=False, widths=[3, 1]) == [[0, 1]]
    with pytest.raises(ValueError, match="widths: expected 2 counts >= 1"):
        plan_micro_batches([10, 10], 40, widths=[0, 1])
