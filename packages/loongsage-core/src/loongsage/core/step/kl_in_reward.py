"""The KL penalty in the reward (``algorithm.kl_in_reward``): ``-coef x KL(old || ref)`` per response
token, added to the rewards before the advantages instead of to the loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from loongsage.core.step.state import StepFeature, StepState

if TYPE_CHECKING:
    from loongsage.core.loss import LossPlan
    from loongsage.core.types import TrainBatch


def kl_token_rewards(plan: LossPlan, batch: TrainBatch) -> Tensor:
    """``-coef x KL(old || ref)`` per response token (no gradient)."""
    old, ref, estimator = batch.old_logprobs, batch.ref_logprobs, plan.kl
    assert old is not None and ref is not None and estimator is not None, "the step fills both log-probs first"
    extra = {"old_logprobs": old} if estimator.needs_old_logprobs else {}
    kl = estimator(old, ref, **extra).detach()
    return -plan.kl_coef * kl * batch.response_mask


class KLInReward(StepFeature):
    """Reads the old and reference log-probs; reports ``rollout/kl_reward`` and ``train/kl``."""

    needs_old_logprobs = True

    def __init__(self, plan: LossPlan):
        self.plan = plan

    def token_rewards(self, state: StepState) -> Tensor:
        rewards = kl_token_rewards(self.plan, state.batch)
        count = float(state.batch.response_mask.sum())
        state.metrics.add("rollout/kl_reward", float(rewards.sum()), count)
        state.metrics.add("train/kl", float(rewards.sum()) / -self.plan.kl_coef, count)  # KL(pi_old || ref)
        return rewards
