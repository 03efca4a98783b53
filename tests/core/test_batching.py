"""Batch assembly, and one training step with in-process trainer fakes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from loongsage.core.aggregation import loss_weights
from loongsage.core.batching import engine_sampled, exclude_rows, loss_excluded, to_batch, trainable
from loongsage.core.metrics import Metrics
from loongsage.core.types import Segment, Status, TrainBatch, Trajectory


def _traj(source: str, group: int, k: int, prompt_len: int, resp_len: int, reward: float = 1.0) -> Trajectory:
    return Trajectory(
        source=source,
        group_id=group,
        sample_index=k,
        prompt_ids=list(range(1, prompt_len + 1)),
        response_ids=[7] * resp_len,
        loss_mask=[1] * resp_len,
        rollout_logprobs=[-0.5] * resp_len,
        versions=[0] * resp_len,
        reward=reward,
    )


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


def test_to_batch_carries_what_the_trajectories_have():
    """Versions, sample indices, token rewards, segments and routed experts travel with their rows."""
    a, b = _traj("s", 3, 0, 3, 2), _traj("t", 5, 1, 2, 4)
    a.versions, b.versions = [4, 5], [5, -1, 5, 6]  # b's second token is a tool token
    b.token_rewards = [0.0, 0.0, 0.5, 1.0]
    a.loss_mask = [0, 1]  # a segment starts with its prompt
    a.segments = [Segment(0, 3), Segment(3, 5, "compaction")]
    b.routed_experts = {"layer0": [1, 2]}
    batch = to_batch([a, b], pad_id=0)
    assert batch.versions.dtype == torch.int32
    assert batch.versions.tolist() == [[-1, -1, -1, 4, 5, -1], [-1, -1, 5, -1, 5, 6]]
    assert batch.token_rewards.tolist() == [[0.0] * 6, [0.0, 0.0, 0.0, 0.0, 0.5, 1.0]]
    assert batch.trajectory_ids == [(3, 0), (5, 1)] and batch.sources == ["s", "t"]
    assert batch.segments == [a.segments, []] and batch.routed_experts == [None, {"layer0": [1, 2]}]
    picked = batch.select([1])
    assert picked.trajectory_ids == [(5, 1)] and picked.sources == ["t"] and picked.segments == [[]]
    assert picked.routed_experts == [{"layer0": [1, 2]}]
    assert picked.versions.tolist() == [[-1, -1, 5, -1, 5, 6]] and picked.token_rewards.tolist()[0][-1] == 1.0
    for name in TrainBatch.tensor_fields():  # every tensor sliced alike
        value = getattr(picked, name)
        assert value is None or value.shape[0] == 1, name


def test_to_batch_leaves_out_what_no_trajectory_has():
    batch = to_batch([_traj("s", 0, 0, 2, 2), _traj("s", 0, 1, 2, 3)], pad_id=0)
    assert batch.token_rewards is None and batch.segments == [] and batch.routed_experts == []
    assert batch.select([1, 0]).segments == []


# ------------------------------------------------ one training step (loongsage.core.step), in-process
#
# The trainer ranks and the critic are replaced by in-process fakes that run the real loss closure
# on a fixed policy (log-prob -1 for every token), and ray.get by the identity: what is checked is
# what the step hands them and how it reduces what they return.

POLICY_LP = -1.0  # the fake trainer's log-prob of every token


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeTrainer:
    """One trainer rank: the real loss closure on log-probs POLICY_LP; records what it was given."""

    def __init__(self, loss):
        self.loss, self.steps, self.logprob_calls = loss, [], 0
        self.logprobs = _Remote(self._logprobs)
        self.train_step = _Remote(self._train_step)

    def _logprobs(self, batch):
        self.logprob_calls += 1
        return {
            "old_logprobs": torch.full(batch.input_ids.shape, POLICY_LP),
            "entropy": torch.zeros(batch.input_ids.shape),
        }

    def _train_step(self, mb):
        self.steps.append(mb)
        lp = torch.full(mb.input_ids.shape, POLICY_LP, requires_grad=True)
        loss, metrics = self.loss(lp, mb)
        return metrics.total("train/loss", float(loss.detach()))


class FakeCritic:
    def __init__(self):
        self.steps = []
        self.values = _Remote(lambda batch: torch.zeros(batch.input_ids.shape))
        self.train_step = _Remote(lambda mb: self.steps.append(mb) or Metrics().total("critic/loss", 0.0))


def _controller(monkeypatch, recipe: str, overrides: list[str], critic: bool = False):
    """The recipe's train step over in-process fakes; ``train(groups)`` runs it as step 1."""
    import ray

    from loongsage.core.config import load_config
    from loongsage.core.loss import build_loss_plan
    from loongsage.core.roles import CriticGroup, TeacherGroup, TrainerGroup
    from loongsage.core.step.train_step import TrainStep, step_features
    from loongsage.core.worker_group import WorkerGroup

    monkeypatch.setattr(ray, "get", lambda x: x)
    cfg, registry = load_config(recipe, ["tracking.progress=false", *overrides])
    plan = build_loss_plan(cfg, registry)
    estimator = registry.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
    filters = [
        registry.create("data_filter", f, f"algorithm.filters[{i}]") for i, f in enumerate(cfg.algorithm.filters)
    ]
    trainer = TrainerGroup(WorkerGroup("trainer", [FakeTrainer(plan.closure())]))
    critic_group = CriticGroup(WorkerGroup("critic", [FakeCritic()] if critic else []))
    features = step_features(
        plan, filters, trainer, critic_group, TeacherGroup(WorkerGroup("teacher", [])), distilling=False, audit_dir=None
    )
    step = TrainStep(
        plan,
        estimator,
        filters,
        trainer,
        features,
        pad_id=0,
        mini_batches=cfg.trainer.mini_batches_per_step,
        quotas={s.name: s.prompts_per_step for s in cfg.data_sources},
    )
    return SimpleNamespace(
        train=lambda groups: step(groups, step=1, version=0), trainer=trainer, critic=critic_group, filters=filters
    )


def _sampled(
    group: int, k: int, length: int, reward: float, delta: float = 0.1, status: Status = Status.OK
) -> Trajectory:
    """An engine-sampled trajectory whose rollout log-probs sit ``delta`` below the fake policy's."""
    return Trajectory(
        source="arith",
        group_id=group,
        sample_index=k,
        prompt_ids=[1, 2, 3],
        response_ids=[7] * length,
        loss_mask=[1] * length,
        rollout_logprobs=[POLICY_LP - delta] * length,
        versions=[0] * length,
        status=status,
        reward=reward,
    )


def _teacher_forced(group: int, length: int) -> Trajectory:
    """What the sft agent makes: no engine call, placeholder log-probs 0, versions -1."""
    return Trajectory(
        source="arith",
        group_id=group,
        sample_index=0,
        prompt_ids=[1, 2, 3],
        response_ids=[7] * length,
        loss_mask=[1] * length,
        rollout_logprobs=[0.0] * length,
        versions=[-1] * length,
        reward=1.0,
        metadata={"teacher_forced": True},
    )


def _k3(delta: float) -> float:
    return math.exp(delta) - delta - 1.0


def test_engine_sampled_marks_only_generated_trained_tokens():
    sampled, forced = _sampled(0, 0, 3, 1.0), _teacher_forced(1, 2)
    sampled.loss_mask, sampled.versions = [1, 0, 1], [0, -1, 2]  # a tool token in the middle
    batch = to_batch([sampled, forced], pad_id=0)
    assert engine_sampled(batch).tolist() == [[0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0]]
    batch.versions = None  # a batch without versions: every trained token counts as sampled
    assert engine_sampled(batch).tolist() == [[0, 0, 0, 1, 0, 1], [0, 0, 0, 1, 1, 0]]


def test_overlong_filter_masks_truncated_samples_after_group_advantages(monkeypatch):
    """DAPO overlong filtering: truncated samples count in the group's baseline, then leave the loss."""
    ctrl = _controller(
        monkeypatch, "tiny/dapo_arith_cpu", ["algorithm.filters=[{name: dynamic_sampling}, {name: overlong}]"]
    )
    group = [
        _sampled(0, 0, 3, 1.0),
        _sampled(0, 1, 8, 0.0, status=Status.TRUNCATED),
        _sampled(0, 2, 2, 0.0),
        _sampled(0, 3, 8, 1.0, status=Status.TRUNCATED),
    ]
    assert all(f(group) for f in ctrl.filters)  # the group is kept
    metrics = ctrl.train([group])
    (mb,) = ctrl.trainer.actors[0].steps
    # GRPO over all four rewards [1, 0, 0, 1]: mean 0.5, unbiased std 0.577 -> A = +-0.866
    # (over the two untruncated ones alone it would be +-0.707)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert mb.response_mask.sum(-1).tolist() == [3, 0, 2, 0]
    assert mb.advantages.sum(-1).tolist() == pytest.approx([3 * a, 0.0, -2 * a, 0.0], rel=1e-5)
    # token-mean over the 5 tokens that train: the truncated samples are in no denominator
    torch.testing.assert_close(mb.loss_weights, loss_weights(mb.response_mask, "token-mean"))
    assert float(mb.loss_weights.sum()) == pytest.approx(1.0) and float(mb.loss_weights.max()) == pytest.approx(1 / 5)
    assert metrics["train/loss_excluded_frac"] == 0.5
    assert metrics["train/is_approx_k3_kl"] == pytest.approx(_k3(0.1), rel=1e-5)


def test_exclude_rows_and_loss_excluded():
    ok, cut = _sampled(0, 0, 2, 1.0), _sampled(0, 1, 2, 0.0, status=Status.TRUNCATED)
    from loongsage.algos.filters import DynamicSampling, OverlongFilter

    excluded = loss_excluded([ok, cut], [DynamicSampling(), OverlongFilter()])
    assert excluded.tolist() == [False, True]
    assert loss_excluded([ok, cut], [DynamicSampling()]).tolist() == [False, False]
    batch = to_batch([ok, cut], pad_id=0)
    batch.advantages = batch.response_mask * 2.0
    exclude_rows(batch, excluded)
    assert batch.response_mask.sum(-1).tolist() == [2, 0] and batch.advantages.sum(-1).tolist() == [4, 0]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_critic_loss_weights_follow_the_aggregation(monkeypatch, aggregation):
    ctrl = _controller(monkeypatch, "tiny/ppo_arith_cpu", [f"algorithm.aggregation={aggregation}"], critic=True)
    ctrl.train([[_sampled(0, 0, 2, 1.0), _sampled(0, 1, 5, 0.0)], [_sampled(1, 0, 3, 1.0), _sampled(1, 1, 1, 0.0)]])
    (policy_mb,), (critic_mb,) = ctrl.trainer.actors[0].steps, ctrl.critic.actors[0].steps
    want = loss_weights(critic_mb.response_mask, aggregation)
    torch.testing.assert_close(critic_mb.loss_weights, want)
    torch.testing.assert_close(policy_mb.loss_weights, want)  # the same weights as the policy loss
    if aggregation != "token-mean":
        assert not torch.allclose(want, loss_weights(critic_mb.response_mask, "token-mean"))


RECIPE_GRPO = "tiny/grpo_arith_cpu"


def _mismatched(group: int) -> list[Trajectory]:
    """Rows of 2 and 4 tokens with mismatches 0.1 and 0.3: the token mean and the mean of row means differ."""
    return [_sampled(group, 0, 2, 1.0, delta=0.1), _sampled(group, 1, 4, 0.0, delta=0.3)]


TOKEN_MEAN = {"k3": (2 * _k3(0.1) + 4 * _k3(0.3)) / 6, "abs": (2 * 0.1 + 4 * 0.3) / 6}
SEQ_MEAN = {"k3": (_k3(0.1) + _k3(0.3)) / 2, "abs": (0.1 + 0.3) / 2}


@pytest.mark.parametrize("mini_batches", [1, 2])  # 1: from the training forward (in the loss); 2: recomputed
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_consistency_metrics_follow_the_aggregation(monkeypatch, aggregation, mini_batches):
    ctrl = _controller(
        monkeypatch,
        RECIPE_GRPO,
        [f"algorithm.aggregation={aggregation}", f"trainer.mini_batches_per_step={mini_batches}"],
    )
    metrics = ctrl.train([_mismatched(g) for g in range(mini_batches)])
    assert (ctrl.trainer.actors[0].logprob_calls > 0) == (mini_batches > 1)
    want = SEQ_MEAN if aggregation.startswith("seq-mean") else TOKEN_MEAN
    assert metrics["train/is_approx_k3_kl"] == pytest.approx(want["k3"], rel=1e-5)
    assert metrics["train/is_logprob_abs_diff"] == pytest.approx(want["abs"], rel=1e-5)


def test_teacher_forced_trajectories_have_no_consistency_metrics(monkeypatch):
    """SFT: the placeholder log-probs 0 of teacher-forced tokens are not compared with anything."""
    ctrl = _controller(monkeypatch, "tiny/sft_chat_cpu", [])
    metrics = ctrl.train([[_teacher_forced(0, 3)], [_teacher_forced(1, 5)]])
    (trainer,) = ctrl.trainer.actors
    assert trainer.steps and trainer.logprob_calls == 0  # no extra forward for it
    assert "train/pg_loss" in metrics
    assert not any(k.startswith(("train/is_approx_k3_kl", "train/is_logprob_abs_diff")) for k in metrics)


def test_a_mixed_batch_measures_the_sampled_tokens_only(monkeypatch):
    """Teacher-forced rows beside sampled ones: old log-probs are recomputed and the metrics read
    the sampled rows alone (token mean of 2 x 0.1 and 4 x 0.3, not diluted by the forced rows)."""
    ctrl = _controller(monkeypatch, RECIPE_GRPO, ["data_sources.0.samples_per_prompt=2"])
    metrics = ctrl.train([_mismatched(0), [_teacher_forced(5, 3), _teacher_forced(5, 4)]])
    assert ctrl.trainer.actors[0].logprob_calls == 1
    assert metrics["train/is_approx_k3_kl"] == pytest.approx(TOKEN_MEAN["k3"], rel=1e-5)
    assert metrics["train/is_logprob_abs_diff"] == pytest.approx(TOKEN_MEAN["abs"], rel=1e-5)
