"""From scored trajectories to the step's training tensors.

Pure functions over plain data (no Ray). Which rows each DP rank and mini-batch trains is decided
by :mod:`loongsage.core.planning`.
"""

from __future__ import annotations

import torch

from loongsage.core.segments import check_segments
from loongsage.core.types import AdvantageInput, Status, TrainBatch, Trajectory


def trainable(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Drop infrastructure failures: they are neither scored 0 nor part of group statistics."""
    return [t for t in trajectories if t.status is not Status.FAILED and t.reward is not None]


def to_batch(trajectories: list[Trajectory], pad_id: int) -> TrainBatch:
    """Right-padded ``[B, T]`` tensors over prompt + response, one row per trajectory in order;
    advantages left at zero.

    Everything a trajectory carries that the step may read travels with its row: the policy
    version of every token (-1 on the prompt and on tokens no engine sampled), its token rewards
    (when any trajectory has them; 0 elsewhere), its group id and sample index, source, segments
    and routed experts (those two only when some trajectory has them).

    A trajectory with several segments stays one row: the trainer's forward scores each segment
    alone (:mod:`loongsage.core.segments`), so its reward, advantage and loss weight stay one
    trajectory's. Its segments must tile its tokens, each starting with an untrained prompt token.
    """
    if not trajectories:
        raise ValueError("to_batch: no trajectories")
    for t in trajectories:
        check_segments(
            t.segments,
            len(t.prompt_ids) + len(t.response_ids),
            t.loss_mask,
            len(t.prompt_ids),
            f"trajectory {t.group_id}/{t.sample_index}",
        )
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    B, T = len(trajectories), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    rollout_lp = torch.zeros(B, T)
    versions = torch.full((B, T), -1, dtype=torch.int32)
    has_token_rewards = any(t.token_rewards is not None for t in trajectories)
    token_rewards = torch.zeros(B, T) if has_token_rewards else None
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention[i, : p + r] = 1
        mask[i, p : p + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout_lp[i, p : p + r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        versions[i, p : p + r] = torch.tensor(t.versions, dtype=torch.int32)
        if token_rewards is not None and t.token_rewards is not None:
            token_rewards[i, p : p + r] = torch.tensor(t.token_rewards, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=mask,
        rollout_logprobs=rollout_lp,
        advantages=torch.zeros(B, T),
        rewards=torch.tensor([float(t.reward) for t in trajectories]),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        versions=versions,
        token_rewards=token_rewards,
        sample_indices=torch.tensor([t.sample_index for t in trajectories], dtype=torch.long),
        sources=[t.source for t in trajectories],
        segments=[list(t.segments) for t in trajectories] if any(t.segments for t in trajectories) else [],
        routed_experts=(
            [t.routed_experts for t in trajectories] if any(t.routed_experts is not None for t in trajectories) else []
        ),
    )


def engine_sampled(batch: TrainBatch) -> torch.Tensor:
    """``[B, T]`` 1.0 on the trained response tokens that an engine sampled.

    Only those carry rollout log-probs: a token the engine generated has its weight version
    (``>= 0``); teacher-forced tokens (the ``sft`` agent) and tool or user tokens have version -1
    and a placeholder log-prob of 0, which the train-inference consistency metrics must not read.
    A batch without versions counts every trained token as sampled.
    """
    trained = batch.response_mask != 0
    if batch.versions is not None:
        trained = trained & (batch.versions >= 0)
    return trained.to(batch.response_mask.dtype)


def loss_excluded(trajectories: list[Trajectory], filters: list) -> torch.Tensor:
    """``[B]`` bool: the trajectories a sample filter keeps out of the loss.

    A data filter may, besides its group predicate, judge single samples with
    ``excludes_from_loss(trajectory) -> bool`` (DAPO's overlong filtering: truncated samples). Such
    samples stay in the step's batch, so the advantages are computed with them present (a group's
    baseline sees their rewards), and are then removed from the loss by :func:`exclude_rows`.
    """
    judges = [f.excludes_from_loss for f in filters if f.excludes_from_loss is not None]
    return torch.tensor([any(judge(t) for judge in judges) for t in trajectories], dtype=torch.bool)


def exclude_rows(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
    """Take the rows where ``rows`` ([B] bool) is True out of the loss: mask, advantages and
    critic targets zeroed, so they count in no numerator and no denominator (nor as a sequence of
    the seq-mean modes)."""
    keep = (~rows).to(batch.response_mask.dtype)[:, None]
    batch.response_mask = batch.response_mask * keep
    batch.advantages = batch.advantages * keep
    if batch.returns is not None:
        batch.returns = batch.returns * keep
    return batch


def compute_advantages(
    batch: TrainBatch, estimator, values: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None
) -> TrainBatch:
    """Advantages over the whole step batch; with critic values also the critic's targets."""
    inp = AdvantageInput(
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        response_mask=batch.response_mask,
        token_rewards=token_rewards,
        values=values,
    )
    batch.advantages = estimator(inp).float() * batch.response_mask
    if values is not None and estimator.returns is not None:
        batch.returns = estimator.returns(inp).float() * batch.response_mask
    return batch
