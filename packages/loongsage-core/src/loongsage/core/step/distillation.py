"""MOPD in the step: each row's teacher scores the student's tokens, the PG branch shapes the
advantages, ``A_t <- A_t - pg_coef * sg(log pi_s - log pi_t)``, and the step reports how far the
student is from its teachers (``mopd_kl``, ``mopd_teacher_logprob``, over the step and per source).

Teachers either run in teacher workers, scoring concurrently and returning the distribution the GKD
divergence reads, or are held by the trainer ranks, which score their own rows (the log-probs only:
the distribution is computed beside the student's in the train step). The GKD term itself is in the
trainer's loss closure (:class:`~loongsage.core.loss.LossClosure`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from loongsage.core.loss import per_source_sums
from loongsage.core.metrics import Metrics
from loongsage.core.step.state import StepFeature, StepState

if TYPE_CHECKING:
    from loongsage.core.loss import LossPlan
    from loongsage.core.roles import TeacherGroup, TrainerGroup
    from loongsage.core.types import TrainBatch


def fill_teacher_tensors(batch: TrainBatch, outputs: list[tuple[list[int], dict[str, Any]]]) -> None:
    """Write each teacher's answer for its rows into ``batch`` (every row has exactly one teacher)."""
    B, T = batch.input_ids.shape
    batch.teacher_logprobs = torch.zeros(B, T)
    batch.teacher_dist_ids = batch.teacher_dist_logprobs = None
    for rows, out in outputs:
        idx = torch.tensor(rows, dtype=torch.long)
        batch.teacher_logprobs[idx, : out["logprobs"].shape[1]] = out["logprobs"]
        for name, key in (("teacher_dist_ids", "dist_ids"), ("teacher_dist_logprobs", "dist_logprobs")):
            value = out.get(key)
            if value is None:
                continue
            if getattr(batch, name) is None:
                setattr(batch, name, torch.zeros(B, T, value.shape[-1], dtype=value.dtype))
            getattr(batch, name)[idx] = value


def teacher_logprobs(batch: TrainBatch) -> Tensor:
    """The teachers' log-probs of the student's tokens (what :func:`fill_teacher_tensors` wrote)."""
    assert batch.teacher_logprobs is not None, "the step's distillation fetch fills them first"
    return batch.teacher_logprobs


def student_logprobs(batch: TrainBatch) -> Tensor:
    """``log pi_s`` of the student's sampled tokens: the recomputed old log-probs when the step has
    them, else the engine's (the same policy in a synchronous step)."""
    return batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs


def shape_advantages(pg_coef: float, batch: TrainBatch) -> Tensor:
    """MOPD's PG branch: ``A_t - pg_coef * sg(log pi_s - log pi_t)`` on response tokens."""
    kl = (student_logprobs(batch) - teacher_logprobs(batch)).detach()
    return batch.advantages - pg_coef * torch.where(batch.response_mask != 0, kl, torch.zeros_like(kl))


def distill_metrics(batch: TrainBatch) -> Metrics:
    """Token means of the sampled-token KL estimate ``log pi_s - log pi_t`` (``mopd_kl``) and of
    the teacher's log-prob of the student's tokens, over the step and per source."""
    mask, teacher = batch.response_mask, teacher_logprobs(batch)
    out = per_source_sums("mopd_kl", student_logprobs(batch) - teacher, mask, batch.sources)
    return out.merge(per_source_sums("mopd_teacher_logprob", teacher, mask, batch.sources))


class Distillation(StepFeature):
    """``teachers``: the teacher workers (empty: the trainer ranks hold the teachers)."""

    def __init__(self, plan: LossPlan, trainer: TrainerGroup, teachers: TeacherGroup):
        self.plan, self.trainer, self.teachers = plan, trainer, teachers

    def fetch(self, state: StepState) -> None:
        batch = state.batch
        if self.teachers:
            topk, full_vocab = self.plan.teacher_request()
            fill_teacher_tensors(batch, self.teachers.score(batch, topk, full_vocab))
        else:
            fill_teacher_tensors(
                batch, [(rows, {"logprobs": lp}) for rows, lp in self.trainer.teacher_logprobs(batch, state.plan)]
            )

    def shape(self, state: StepState) -> None:
        state.metrics.merge(distill_metrics(state.batch))
        if self.plan.pg_coef:
            state.batch.advantages = shape_advantages(self.plan.pg_coef, state.batch)
