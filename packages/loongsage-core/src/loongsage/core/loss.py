"""Turn the chosen algorithm entries into the step's loss plan and the trainer's loss closure.

The algorithms themselves are pure per-token functions (``loongsage-algos``); this module wires
them: corrections decide weights and masks once per optimizer mini-batch, the aggregation gives
every token its share of a *global* denominator, and the closure returns ``sum(w * loss)`` for a
micro-batch, so gradient accumulation and DP reduction are plain sums.

MOPD (multi-teacher on-policy distillation) adds two terms, both against the teacher of each row's
data source (its log-probs arrive in the batch): the PG branch shapes the advantages before the
loss, ``A_t <- A_t - pg_coef * sg(log pi_s - log pi_t)``; the GKD branch mixes a per-token
divergence into the loss, ``L = (1 - gkd_coef) L_RL + gkd_coef L_GKD``, aggregated with the same
global weights. The reference-KL term keeps its own coefficient outside that mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.aggregation import loss_weights
from loongsage.core.batching import engine_sampled
from loongsage.core.contracts import Correction, KLEstimator, LossFunction, PolicyLoss
from loongsage.core.metrics import Metrics
from loongsage.core.types import CorrectionInput, PolicyLossInput, TrainBatch

if TYPE_CHECKING:
    from loongsage.core.config import Config

# Metrics are ratios summed over micro-batches and ranks (tokens whose mask is 0 carry no mass), so
# what is reported is the token mean over the step.


def consistency_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, aggregation: str = "token-mean"
) -> Metrics:
    """Train-inference mismatch: ``train/is_approx_k3_kl`` and ``train/is_logprob_abs_diff`` ratios.

    delta = log pi_old - log pi_rollout (clamped to +-20); k3 = e^delta - delta - 1 >= 0; the
    second metric is |delta|. Averaged like the loss: with a ``seq-mean-*`` aggregation the mean
    over sequences of each sequence's token mean (sums: one token mean per row with a token in
    ``mask``, over the number of such rows), else the token mean over ``mask``. Either way the sums
    add up over micro-batches and ranks (a row is never split). ``mask`` selects the tokens that
    carry rollout log-probs (sampled by the engine); nothing is returned when it is empty.
    """
    out = Metrics()
    mask = mask.to(torch.float32) if not mask.is_floating_point() else mask
    if not bool((mask != 0).any()):
        return out
    delta = torch.where(mask != 0, (old_logprobs - rollout_logprobs).clamp(-20, 20), torch.zeros_like(mask))
    values = {"train/is_approx_k3_kl": torch.expm1(delta) - delta, "train/is_logprob_abs_diff": delta.abs()}
    if aggregation.startswith("seq-mean"):
        lengths = mask.sum(dim=-1)
        rows = lengths > 0
        for key, v in values.items():
            out.add(key, float(((v * mask).sum(dim=-1)[rows] / lengths[rows]).sum()), float(rows.sum()))
        return out
    count = float(mask.sum())
    for key, v in values.items():
        out.add(key, float((v * mask).sum()), count)
    return out


@dataclass
class LossPlan:
    """The run's loss as chosen under ``algorithm.*``: policy loss, optional KL penalty, corrections,
    the aggregation and MOPD's coefficients, with what the step reads of them.

    The driver's side: which log-probs the step fetches, what the teachers return, and the
    corrections and global loss weights of each optimizer mini-batch (:meth:`prepare`). Each trainer
    rank builds the same plan from the config and trains with its :meth:`closure`. The entries come
    from the registry (checked against their contracts, their flags filled in), so their capability
    flags are read directly.
    """

    policy_loss: PolicyLoss
    aggregation: str = "token-mean"
    aggregation_constant: float | None = None
    kl: KLEstimator | None = None
    kl_coef: float = 0.0
    kl_in_reward: bool = False  # penalise KL through token rewards (before advantages) instead of the loss
    corrections: list[Correction] = field(default_factory=list)
    pg_coef: float = 0.0  # MOPD PG branch: lambda_pg of the advantage shaping
    gkd_coef: float = 0.0  # MOPD GKD branch: lambda of (1 - lambda) L_RL + lambda L_GKD
    divergence: KLEstimator | None = None  # the GKD term's per-token divergence (a KL-estimator entry)

    @property
    def distills(self) -> bool:
        """Whether the step needs the teachers (MOPD is on)."""
        return self.pg_coef != 0.0 or self.gkd_coef != 0.0

    @property
    def divergence_consumes(self) -> str | None:
        """What the GKD divergence reads: ``logprobs``, ``topk``, ``full_vocab`` (None: no GKD term)."""
        if self.gkd_coef == 0.0 or self.divergence is None:
            return None
        return self.divergence.consumes

    def teacher_request(self) -> tuple[int, bool]:
        """``(k, full_vocab)``: what teachers return besides the sampled tokens' log-probs."""
        consumes = self.divergence_consumes
        return (int(self.divergence.k) if consumes == "topk" else 0), consumes == "full_vocab"

    def recompute_old_logprobs(self, mini_batches: int) -> bool:
        """Whether old log-probs need a forward pass of their own before the first update.

        With one optimizer step per rollout and no correction, the policy that produced the data's
        "old" log-probs is exactly the one being updated, so the training forward's detached
        log-probs serve (ratio 1) and the extra pass is skipped. Several mini-batches, or a
        correction that decides from old log-probs up front, need them recomputed.
        """
        up_front = bool(self.up_front_corrections)
        if not self.policy_loss.needs_old_logprobs and not up_front:
            return False
        return mini_batches > 1 or up_front

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.kl is not None and self.kl_coef != 0.0

    @property
    def kl_in_loss(self) -> bool:
        return self.needs_ref_logprobs and not self.kl_in_reward

    @property
    def up_front_corrections(self) -> list[Correction]:
        """Corrections decided once per mini-batch (they may change the mask, so the denominator)."""
        return [c for c in self.corrections if not c.needs_logprobs]

    @property
    def per_step_corrections(self) -> list[Correction]:
        """Corrections that need the current policy: weights only, applied in every micro-batch."""
        return [c for c in self.corrections if c.needs_logprobs]

    def aggregation_weights(self, response_mask: Tensor) -> Tensor:
        """Global loss weights of a whole mini-batch under ``algorithm.aggregation`` (the critic's too)."""
        return loss_weights(response_mask, self.aggregation, constant=self.aggregation_constant)

    def prepare(self, mini_batch: TrainBatch) -> tuple[TrainBatch, Metrics]:
        """Decide corrections and loss weights once for a whole optimizer mini-batch."""
        mask = mini_batch.response_mask.float()
        token_weights = torch.ones_like(mask)
        sums = Metrics()
        old = mini_batch.old_logprobs
        for correction in self.up_front_corrections:
            out = correction(
                CorrectionInput(
                    old_logprobs=old,
                    rollout_logprobs=mini_batch.rollout_logprobs,
                    advantages=mini_batch.advantages,
                    response_mask=mask,
                )
            )
            token_weights = token_weights * out.token_weights
            for key, value in out.metrics.items():
                sums.add(f"train/{key}", float((value * mask).sum()), float(mask.sum()))
            mask = out.response_mask.float()
        weights = self.aggregation_weights(mask) * token_weights
        return replace(mini_batch, response_mask=mask, loss_weights=weights), sums

    def closure(self) -> LossClosure:
        """The loss a trainer rank's ``train_step`` is handed."""
        return LossClosure(self)


class LossClosure(LossFunction):
    """The trainer's side of a :class:`LossPlan`: the weighted loss sum of one micro-batch (policy
    loss, per-micro-batch corrections, MOPD's GKD term, the KL penalty when it is in the loss)."""

    def __init__(self, plan: LossPlan):
        self.plan = plan
        consumes = plan.divergence_consumes
        self.needs_student_distribution = consumes in ("topk", "full_vocab")
        # the GKD divergence can be summed over shards of the vocabulary (its ``partial``): a trainer
        # splitting the vocabulary then passes its shard and ``vocab_sum``
        self.reads_vocab_shards = consumes == "full_vocab" and plan.divergence.partial is not None
        self.teacher_support = plan.teacher_request()

    def __call__(
        self,
        logprobs: Tensor,
        mb: TrainBatch,
        student_dist: Tensor | None = None,
        vocab_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Metrics]:
        """Weighted loss sum of one micro-batch and its metrics.

        ``student_dist`` (only when :attr:`needs_student_distribution`): the student's log-probs on
        the teacher's support, ``[B, t, K]`` for the last ``t`` positions of the micro-batch; with
        ``vocab_sum`` (only when :attr:`reads_vocab_shards`) it and the teacher's are this rank's
        shard of the vocabulary, and ``vocab_sum`` adds the shards' per-position sums.
        """
        plan = self.plan
        mask = mb.response_mask
        metrics = Metrics()
        old = mb.old_logprobs
        if old is None:  # on-policy single step: this forward's log-probs are the old ones
            old = logprobs.detach()
            # measured on the tokens an engine sampled: teacher-forced ones have no rollout log-probs
            metrics.merge(consistency_metrics(old, mb.rollout_logprobs, mask * engine_sampled(mb), plan.aggregation))
        out = plan.policy_loss(
            PolicyLossInput(
                logprobs=logprobs,
                old_logprobs=old,
                advantages=mb.advantages,
                response_mask=mask,
                rollout_logprobs=mb.rollout_logprobs,
            )
        )
        per_token = out.loss
        count = float(mask.sum())
        for correction in plan.per_step_corrections:
            corr = correction(
                CorrectionInput(
                    old_logprobs=old,
                    rollout_logprobs=mb.rollout_logprobs,
                    advantages=mb.advantages,
                    response_mask=mask,
                    logprobs=logprobs.detach(),
                )
            )
            per_token = per_token * corr.token_weights
            for key, value in corr.metrics.items():
                metrics.add(f"train/{key}", float((value * mask).sum()), count)
        if plan.divergence_consumes is not None:
            gkd = self._gkd(logprobs, old, mb, student_dist, vocab_sum)
            per_token = (1.0 - plan.gkd_coef) * per_token + plan.gkd_coef * gkd
            metrics.merge(per_source_sums("gkd", gkd.detach(), mask, mb.sources))
        if plan.kl_in_loss:
            extra = {"old_logprobs": old} if plan.kl.needs_old_logprobs else {}
            kl = plan.kl(logprobs, mb.ref_logprobs, **extra)  # unbiased forms weight by sg(pi / pi_old)
            per_token = per_token + plan.kl_coef * kl
            metrics.add("train/kl", float((kl.detach() * mask).sum()), count)
        loss = (per_token * mb.loss_weights).sum()
        metrics.add("train/pg_loss", float((out.loss.detach() * mask).sum()), count)
        for key, value in out.metrics.items():
            metrics.add(f"train/{key}", float((value.detach() * mask).sum()), count)
        return loss, metrics

    def _gkd(
        self,
        logprobs: Tensor,
        old: Tensor,
        mb: TrainBatch,
        student_dist: Tensor | None,
        vocab_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """The divergence to each row's teacher per token ``[B, T]``, zero outside the mask."""
        divergence, consumes = self.plan.divergence, self.plan.divergence_consumes
        if consumes == "logprobs":  # sampled-token forms (k2, k3): the teacher's log-prob of our token
            extra = {"old_logprobs": old} if divergence.needs_old_logprobs else {}
            div = divergence(logprobs, mb.teacher_logprobs, **extra)
        else:
            if student_dist is None or mb.teacher_dist_logprobs is None:
                raise ValueError(
                    f"distill divergence consumes {consumes!r}: the trainer must pass "
                    "student_dist and the batch must carry the teacher's distribution"
                )
            T, t = logprobs.shape[1], student_dist.shape[1]
            # the teacher's distribution ends where the micro-batch ends: its last t positions are the
            # student's (a batch's is T wide, a held teacher's covers the trained positions only)
            teacher = mb.teacher_dist_logprobs
            teacher = teacher[:, teacher.shape[1] - t :].to(student_dist.device)
            if vocab_sum is None:
                div = divergence(student_dist, teacher)
            else:  # this rank's shard of the vocabulary: its terms, then the sum over the shards
                div = vocab_sum(divergence.partial(student_dist, teacher)).clamp(min=0.0)
            div = F.pad(div, (T - t, 0))
        return torch.where(mb.response_mask != 0, div, torch.zeros_like(div))


def build_loss_plan(cfg: Config, registry: Any) -> LossPlan:
    """The run's :class:`LossPlan` from ``algorithm.*`` (the driver and every trainer rank build it)."""
    alg = cfg.algorithm
    distill = alg.distill
    return LossPlan(
        policy_loss=registry.create("policy_loss", alg.policy_loss, "algorithm.policy_loss"),
        aggregation=alg.aggregation,
        aggregation_constant=alg.aggregation_constant,
        kl=registry.create("kl", alg.kl, "algorithm.kl") if alg.kl else None,
        kl_coef=alg.kl_coef,
        kl_in_reward=alg.kl_in_reward,
        corrections=[
            registry.create("correction", c, f"algorithm.corrections[{i}]") for i, c in enumerate(alg.corrections)
        ],
        pg_coef=distill.pg_coef if distill else 0.0,
        gkd_coef=distill.gkd_coef if distill else 0.0,
        divergence=(
            registry.create("kl", distill.divergence, "algorithm.distill.divergence")
            if distill and distill.divergence
            else None
        ),
    )


def per_source_sums(name: str, values: Tensor, mask: Tensor, sources: list[str]) -> Metrics:
    """``train/<name>`` and ``train_per_ds/<source>/<name>``: token means of ``values`` [B, T]."""
    mask = mask.to(values.dtype)
    out = Metrics().add(f"train/{name}", float((values * mask).sum()), float(mask.sum()))
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources], device=mask.device)
        m = mask * rows.unsqueeze(1).to(mask.dtype)
        out.add(f"train_per_ds/{source}/{name}", float((values * m).sum()), float(m.sum()))
    return out


@dataclass
class ValueLoss(LossFunction):
    """PPO's clipped value loss: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)`` per
    token, weighted by the mini-batch's global loss weights like the policy loss (the controller
    computes them with ``algorithm.aggregation``: :meth:`LossPlan.aggregation_weights`)."""

    clip: float = 0.2

    def __call__(self, values: Tensor, mb: TrainBatch) -> tuple[Tensor, Metrics]:
        mask = mb.response_mask
        old, target = mb.values, mb.returns
        clipped = old + (values - old).clamp(-self.clip, self.clip)
        unclipped_err, clipped_err = (values - target) ** 2, (clipped - target) ** 2
        per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)
        loss = (per_token * mb.loss_weights).sum()
        count = float(mask.sum())
        metrics = (
            Metrics()
            .add("critic/value_loss", float((per_token.detach() * mask).sum()), count)
            .add("critic/clipfrac", float(((clipped_err > unclipped_err).float() * mask).sum()), count)
            .add("critic/values", float((values.detach() * mask).sum()), count)
            .add("critic/returns", float((target * mask).sum()), count)
        )
        return loss, metrics
