"""One training step over the trainer ranks: the step's batch, its log-probs, advantages and
mini-batches, with the run's optional features (:mod:`loongsage.core.step`) in their phases.

As data: the step's groups -> the batch (rows in group order) and the plan dealing its groups to
data-parallel ranks and mini-batches (:mod:`loongsage.core.planning`) -> features fetch (teacher
scores, critic values, the audit) -> old and reference log-probs, each trainer rank its own rows,
when the loss or a feature reads them before the update -> token rewards of the features ->
advantages over the whole batch -> features shape the batch (loss exclusion, distillation) -> per
mini-batch: corrections and global loss weights over every rank's rows, then each rank's optimizer
step on its slice, beside the features' calls (the critic's step) -> metrics.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loongsage.core.batching import compute_advantages, engine_sampled, loss_excluded, to_batch, trainable
from loongsage.core.loss import LossPlan, consistency_metrics
from loongsage.core.planning import plan_step
from loongsage.core.step.audit import BatchAudit
from loongsage.core.step.critic import Critic
from loongsage.core.step.distillation import Distillation
from loongsage.core.step.exclusion import LossExclusion
from loongsage.core.step.kl_in_reward import KLInReward
from loongsage.core.step.state import StepFeature, StepState
from loongsage.core.types import Trajectory

if TYPE_CHECKING:
    from loongsage.core.roles import CriticGroup, TeacherGroup, TrainerGroup


def step_features(
    plan: LossPlan,
    filters: Sequence[Any],
    trainer: TrainerGroup,
    critic: CriticGroup,
    teachers: TeacherGroup,
    *,
    distilling: bool,
    audit_dir: Path | None,
) -> list[StepFeature]:
    """The features a run's step takes part in, in phase order (loss exclusion shapes the batch
    before distillation reads its mask). ``distilling``: teachers are in workers or held by the
    trainer ranks; ``audit_dir``: where the batch audit writes (None: no audit)."""
    features: list[StepFeature] = []
    if any(f.excludes_from_loss is not None for f in filters):
        features.append(LossExclusion())
    if distilling:
        features.append(Distillation(plan, trainer, teachers))
    if audit_dir is not None:
        features.append(BatchAudit(audit_dir))
    if plan.kl_in_reward and plan.needs_ref_logprobs:
        features.append(KLInReward(plan))
    if critic:
        features.append(Critic(critic, plan))
    return features


class TrainStep:
    """``step(groups, step=, version=) -> metrics``: trains the trainer ranks on one batch of groups.

    ``quotas``: each source's groups per step (what the plan deals in proportion); ``mini_batches``:
    optimizer steps per training step.
    """

    def __init__(
        self,
        plan: LossPlan,
        estimator: Any,
        filters: Sequence[Any],
        trainer: TrainerGroup,
        features: Sequence[StepFeature],
        *,
        pad_id: int,
        mini_batches: int,
        quotas: Mapping[str, int],
    ):
        self.plan, self.estimator, self.filters, self.trainer = plan, estimator, list(filters), trainer
        self.features = list(features)
        self.pad_id, self.mini_batches, self.quotas = pad_id, mini_batches, dict(quotas)

    def __call__(self, groups: list[list[Trajectory]], *, step: int, version: int) -> dict[str, float]:
        groups = [g for g in (trainable(g) for g in groups) if g]
        trajs = [t for g in groups for t in g]
        if not trajs:
            return {"train/skipped": 1.0}
        batch = to_batch(trajs, self.pad_id)
        plan = plan_step(groups, self.trainer.dp_size, self.mini_batches, quotas=self.quotas)
        state = StepState(batch, plan, trajs, loss_excluded(trajs, self.filters), step=step, version=version)
        for feature in self.features:
            feature.fetch(state)
        self._fill_logprobs(state)
        rewards = [r for r in (f.token_rewards(state) for f in self.features) if r is not None]
        compute_advantages(
            batch,
            self.estimator,
            values=batch.values,
            token_rewards=functools.reduce(operator.add, rewards) if rewards else None,
        )
        for feature in self.features:
            feature.shape(state)
        for m in range(plan.mini_batches):
            self._train_mini_batch(state, m)
        state.metrics.gauge(
            "train/advantage_abs_mean",
            float((batch.advantages.abs() * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)),
        )
        return state.metrics.means()

    def _fill_logprobs(self, state: StepState) -> None:
        """Old (and reference) log-probs, each trainer rank computing its own rows, when the loss or a
        feature reads them before the update, and the train-inference consistency metrics with them.

        Those metrics read the trained tokens an engine sampled: teacher-forced ones (sft) have no
        rollout log-probs. The loss computes them when the training forward gives the old log-probs;
        a batch that mixes both kinds has them recomputed and measured here.
        """
        batch = state.batch
        trained = batch.response_mask * (~state.excluded).to(batch.response_mask.dtype)[:, None]
        sampled = trained * engine_sampled(batch)
        partly_sampled = bool(sampled.any()) and not torch.equal(sampled, trained)
        old = (
            self.plan.recompute_old_logprobs(self.mini_batches)
            or partly_sampled
            or any(f.needs_old_logprobs for f in self.features)
        )
        if not old and not self.plan.needs_ref_logprobs:
            batch.old_logprobs = None  # taken from the training forward itself
            return
        B, T = batch.input_ids.shape
        batch.old_logprobs = torch.zeros(B, T) if old else None
        batch.ref_logprobs = torch.zeros(B, T) if self.plan.needs_ref_logprobs else None
        for rows, out in self.trainer.logprobs(batch, state.plan):
            idx = torch.tensor(rows)
            t = out["old_logprobs"].shape[1]
            if batch.old_logprobs is not None:
                batch.old_logprobs[idx, :t] = out["old_logprobs"]
            if batch.ref_logprobs is not None:
                batch.ref_logprobs[idx, :t] = out["ref_logprobs"]
        if batch.old_logprobs is not None:
            state.metrics.merge(
                consistency_metrics(batch.old_logprobs, batch.rollout_logprobs, sampled, self.plan.aggregation)
            )

    def _train_mini_batch(self, state: StepState, m: int) -> None:
        """Corrections and loss weights over the whole mini-batch (global denominators), then every
        rank's optimizer step on its slice, beside the features' calls."""
        union = state.plan.mini_batch_rows(m)
        if not union:
            return
        mini_batch = state.batch.select(union)
        prepared, corrections = self.plan.prepare(mini_batch)
        state.metrics.merge(corrections)
        pending = [self.trainer.train_step([prepared.select(rows) for rows in state.plan.positions(m)])]
        pending += [p for p in (f.train(state, mini_batch) for f in self.features) if p is not None]
        for calls in pending:
            for out in calls.wait():
                state.metrics.merge(out)
