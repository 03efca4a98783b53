"""Samples a data filter keeps out of the loss (DAPO's overlong filtering): present for the
advantages (their group's baseline sees their rewards), masked out of the loss after them."""

from __future__ import annotations

from loongsage.core.batching import exclude_rows
from loongsage.core.step.state import StepFeature, StepState


class LossExclusion(StepFeature):
    def shape(self, state: StepState) -> None:
        exclude_rows(state.batch, state.excluded)
        state.metrics.add("train/loss_excluded_frac", float(state.excluded.sum()), float(len(state.trajectories)))
