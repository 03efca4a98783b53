"""PPO's critic in the step: its values before the advantages (the estimator's baseline and the
critic's targets), and its clipped value-loss step beside the policy's, in its own actor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongsage.core.step.state import StepFeature, StepState

if TYPE_CHECKING:
    from loongsage.core.loss import LossPlan
    from loongsage.core.roles import CriticGroup, Pending
    from loongsage.core.types import TrainBatch


class Critic(StepFeature):
    def __init__(self, critic: CriticGroup, plan: LossPlan):
        self.critic, self.plan = critic, plan

    def fetch(self, state: StepState) -> None:
        state.batch.values = self.critic.values(state.batch) * state.batch.response_mask

    def train(self, state: StepState, mini_batch: TrainBatch) -> Pending:
        # the value loss is aggregated like the policy's, over the mini-batch's unchanged mask
        mini_batch.loss_weights = self.plan.aggregation_weights(mini_batch.response_mask)
        return self.critic.train_step(mini_batch)
