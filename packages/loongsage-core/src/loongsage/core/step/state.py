"""What one training step carries from phase to phase, and the phases a step feature implements.

The phases, in order (:class:`~loongsage.core.step.train_step.TrainStep` runs them):

1. ``fetch``: what other models say of the batch before the advantages (teacher scores, critic
   values) and records of it (the batch audit); the step then fills the old and reference log-probs.
2. ``token_rewards``: per-token rewards added before the advantages (the KL penalty in the reward).
3. ``shape``: changes to the batch after the advantages (loss exclusion, distillation's shaping).
4. ``train``: calls beside the trainer's optimizer step, per mini-batch (the critic's step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loongsage.core.metrics import Metrics

if TYPE_CHECKING:
    from loongsage.core.planning import StepPlan
    from loongsage.core.roles import Pending
    from loongsage.core.types import TrainBatch, Trajectory


@dataclass
class StepState:
    """One step's batch and what its phases decided. ``excluded``: ``[B]`` the rows a filter keeps
    out of the loss; ``step``: the step being trained (1-based), ``version``: the policy's weight
    version before its update."""

    batch: TrainBatch
    plan: StepPlan
    trajectories: list[Trajectory]
    excluded: torch.Tensor
    step: int
    version: int
    metrics: Metrics = field(default_factory=Metrics)


class StepFeature:
    """An optional part of the step: a no-op for every phase it does not take part in."""

    needs_old_logprobs = False
    """Reads the batch's old (and reference) log-probs before the update, so the step fills them."""

    def fetch(self, state: StepState) -> None:
        """Before the old log-probs: scores of other models, records of the batch."""

    def token_rewards(self, state: StepState) -> torch.Tensor | None:
        """``[B, T]`` rewards per token, summed into the advantages' input (None: none)."""
        return None

    def shape(self, state: StepState) -> None:
        """After the advantages: changes to the batch or its loss."""

    def train(self, state: StepState, mini_batch: TrainBatch) -> Pending | None:
        """Beside the trainer's optimizer step on ``mini_batch``: calls whose answers are metrics."""
        return None
