"""The contracts of the algorithm hooks: what turns scored trajectories into a loss.

Advantage estimators and data filters (driver, per step and per group), policy losses, KL
estimators and corrections (trainer ranks, per micro-batch; some in the driver), and the loss
closure a trainer's ``train_step`` is handed (:class:`LossFunction`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal, Protocol, runtime_checkable

from torch import Tensor

from loongsage.core.metrics import Metrics
from loongsage.core.types import (
    AdvantageInput,
    CorrectionInput,
    CorrectionOutput,
    LossOutput,
    PolicyLossInput,
    TrainBatch,
    Trajectory,
)


class AdvantageEstimator(Protocol):
    """``loongsage_advantage_estimators``: per-token advantages of the whole step batch.

    Runs in the driver, once per step, over every trained row (group and batch statistics need no
    collective). Returns ``[B, T]``, zero outside ``inp.response_mask``.
    """

    needs_values: ClassVar[bool] = False
    """Reads critic values (``inp.values``): the run trains a critic, and ``returns`` is required."""
    uses_token_rewards: ClassVar[bool] = False
    """Reads ``inp.token_rewards`` (what ``algorithm.kl_in_reward`` fills)."""
    returns: ClassVar[Callable[[AdvantageInput], Tensor] | None] = None
    """``returns(inp) -> Tensor [B, T]``: the critic's targets for the same input (required with
    ``needs_values``), called once per step right after the advantages."""
    min_group_size: int = 1
    """The fewest samples per prompt that can give a nonzero advantage (may follow the params): 2 for
    an estimator whose baseline is the prompt's own group (a group of one is its own baseline).
    Validation refuses a ``samples_per_prompt`` below it when the policy loss reads advantages."""

    def __call__(self, inp: AdvantageInput) -> Tensor: ...


class PolicyLoss(Protocol):
    """``loongsage_policy_losses``: the unreduced per-token policy loss and its metrics.

    Runs in every trainer rank, once per micro-batch of every optimizer step. The framework
    aggregates with global denominators, so the loss returns ``[B, T]`` and reduces nothing.
    """

    needs_old_logprobs: ClassVar[bool] = True
    """Compares with the pre-update policy: old log-probs are recomputed when a step takes several
    mini-batches (an NLL loss sets False)."""
    supported_aggregations: ClassVar[tuple[str, ...] | None] = None
    """The ``algorithm.aggregation`` modes it is defined for; None: every mode."""
    uses_advantages: ClassVar[bool] = True
    """Reads ``inp.advantages`` (a supervised loss sets False)."""

    def __call__(self, inp: PolicyLossInput) -> LossOutput: ...


class KLEstimator(Protocol):
    """``loongsage_kl_estimators``: a per-token divergence, for the reference KL or MOPD's GKD term.

    With ``consumes = "logprobs"`` it reads sampled-token log-probs ``[B, T]`` (an estimate of
    KL(pi || ref)); with ``"topk"`` or ``"full_vocab"`` it reads the student's and the teacher's
    log-probs over a support ``[B, T, K]`` (the teacher's top-``k`` tokens, or the vocabulary).
    Runs in every trainer rank once per micro-batch (KL in the loss, GKD), and in the driver once
    per step (``algorithm.kl_in_reward``).
    """

    consumes: ClassVar[Literal["logprobs", "topk", "full_vocab"]] = "logprobs"
    """What the trainer and the teachers fetch for it; the reference KL takes ``logprobs`` only."""
    needs_old_logprobs: bool = False
    """Pass ``old_logprobs=`` (the unbiased, ratio-weighted forms; may follow the params)."""
    k: int
    """Teacher tokens per position (only with ``consumes = "topk"``)."""
    partial: ClassVar[Callable[..., Tensor] | None] = None
    """Optional (``consumes = "full_vocab"``): ``partial(student, teacher) -> [B, T]``, the
    divergence's terms summed over a part of the vocabulary only (not clamped): the parts' sums
    add up to the divergence. A trainer whose ranks each hold a shard of the vocabulary (tensor
    parallelism) then sums its shard's terms and the shards' sums, never gathering the vocabulary."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, *, old_logprobs: Tensor | None = None) -> Tensor:
        """``[B, T]``; ``old_logprobs`` is passed only when ``needs_old_logprobs``."""
        ...


class Correction(Protocol):
    """``loongsage_corrections``: train-inference consistency weights and masks (no gradient).

    With ``needs_logprobs`` False it runs in the driver once per optimizer mini-batch, over the
    mini-batch of every DP rank, and may change the mask (so the loss denominator); with True it
    runs in every trainer rank once per micro-batch and sets weights only.
    """

    needs_logprobs: ClassVar[bool] = False
    """Reads the current policy's log-probs (``inp.logprobs``), so it is applied per micro-batch."""

    def __call__(self, inp: CorrectionInput) -> CorrectionOutput: ...


class DataFilter(Protocol):
    """``loongsage_data_filters``: keeps or drops a scored group (dynamic sampling, status, overlong).

    Runs in the driver, once per group after rewards (refilled groups included); a dropped group
    may be replaced by a refill. ``excludes_from_loss``, when offered, is called once per trained
    trajectory of the step.
    """

    excludes_from_loss: ClassVar[Callable[[Trajectory], bool] | None] = None
    """Optional ``excludes_from_loss(trajectory) -> bool``: such a sample stays in its group's
    advantage statistics but leaves the loss (DAPO's overlong filtering)."""

    def __call__(self, group: list[Trajectory]) -> bool: ...


@runtime_checkable
class LossFunction(Protocol):
    """What a trainer's ``train_step`` is handed: the framework's loss closure
    (:class:`~loongsage.core.loss.LossClosure` for the policy, ``ValueLoss`` for a critic).

    Called in the trainer rank once per micro-batch with the forward's per-token output (log-probs
    or values) ``[B, T]``; returns the weighted loss *sum* and its :class:`~loongsage.core.metrics.Metrics`
    (ratios that add up over micro-batches and ranks). A bare callable (a test's closure) is no
    ``LossFunction`` (``isinstance`` tells) and is called without ``student_dist``.
    """

    needs_student_distribution: bool = False
    """Pass ``student_dist=``: the policy's log-probs on the teacher's support (MOPD's GKD term),
    the support being what :attr:`teacher_support` names."""
    reads_vocab_shards: bool = False
    """Takes ``student_dist`` and the teacher's distribution as this rank's shard of the vocabulary,
    with ``vocab_sum=`` (a function summing per-position values over the shards) to add them up
    (its divergence has ``partial``): a trainer splitting the vocabulary passes its shard."""
    teacher_support: tuple[int, bool] = (0, False)
    """``(k, full_vocab)``: the support it reads besides the sampled tokens' log-probs (a teacher's
    top ``k`` tokens, or the full vocabulary), which teachers held by the trainer give."""

    def __call__(self, logprobs: Tensor, mb: TrainBatch) -> tuple[Tensor, Metrics]: ...
