"""From scored trajectories to training tensors, split per DP rank and per mini-batch.

Pure functions over plain data (no Ray), so the split is tested directly. Every rank and every
mini-batch gets each source's groups in the global proportion, and groups are dealt to ranks in a
length-balanced order.
"""

from __future__ import annotations

import torch

from loongsage.core.types import AdvantageInput, Status, TrainBatch, Trajectory


def trainable(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Drop infrastructure failures: they are neither scored 0 nor part of group statistics."""
    return [t for t in trajectories if t.status is not Status.FAILED and t.reward is not None]


def to_batch(trajectories: list[Trajectory], pad_id: int) -> TrainBatch:
    """Right-padded ``[B, T]`` tensors over prompt + response; advantages left at zero."""
    if not trajectories:
        raise ValueError("to_batch: no trajectories")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    B, T = len(trajectories), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    rollout_lp = torch.zeros(B, T)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention[i, :p + r] = 1
        mask[i, p:p + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout_lp[i, p:p + r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention, response_mask=mask, rollout_logprobs=rollout_lp,
        advantages=torch.zeros(B, T), rewards=torch.tensor([float(t.reward) for t in trajectories]),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        sources=[t.source for t in trajectories],
    )


def engine_sampled(trajectories: list[Trajectory], length: int) -> torch.Tensor:
    """``[B, length]`` 1.0 on the trained response tokens that an engine sampled, in :func:`to_batch`'s layout.

    Only those carry rollout log-probs: a token the engine generated has its weight version
    (``>= 0``); teacher-forced tokens (the ``sft`` agent) and tool or user tokens have version -1
    and a placeholder log-prob of 0, which the train-inference consistency metrics must not read.
    """
    out = torch.zeros(len(trajectories), length)
    for i, t in enumerate(trajectories):
        p = len(t.prompt_ids)
        sampled = [float(m != 0 and v >= 0) for m, v in zip(t.loss_mask, t.versions)]
        out[i, p:p + len(sampled)] = torch.tensor(sampled)
    return out


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


def compute_advantages(batch: TrainBatch, estimator, values: torch.Tensor | None = None,
                       token_rewards: torch.Tensor | None = None) -> TrainBatch:
    """Advantages over the whole step batch; with critic values also the critic's targets."""
    inp = AdvantageInput(rewards=batch.rewards, group_ids=batch.group_ids, response_mask=batch.response_mask,
                         token_rewards=token_rewards, values=values)
    batch.advantages = estimator(inp).float() * batch.response_mask
    if values is not None and estimator.returns is not None:
        batch.returns = estimator.returns(inp).float() * batch.response_mask
    return batch


def split_groups(groups: list[list[Trajectory]], world_size: int, mini_batches: int) -> list[list[list[Trajectory]]]:
    """Deal groups to ``world_size`` ranks x ``mini_batches`` parts with exact per-source shares.

    Per source, groups are sorted by token count (longest first) and dealt to ranks in snake order
    (0,1,..,R-1,R-1,..,0) so the ranks' loads stay balanced; each rank's share of a source is then cut
    dealt round-robin into ``mini_batches`` parts. The shares are exact when each source's group count is
    divisible by ``world_size x mini_batches`` (checked at config validation); after a filter dropped
    groups they are as even as the count allows.
    Returns ``parts[rank][mini_batch] -> trajectories``.
    """
    by_source: dict[str, list[list[Trajectory]]] = {}
    for g in groups:
        by_source.setdefault(g[0].source, []).append(g)
    parts: list[list[list[Trajectory]]] = [[[] for _ in range(mini_batches)] for _ in range(world_size)]
    for source in sorted(by_source):
        src_groups = sorted(by_source[source], key=lambda g: -sum(len(t.prompt_ids) + len(t.response_ids) for t in g))
        per_rank: list[list[list[Trajectory]]] = [[] for _ in range(world_size)]
        for k, g in enumerate(src_groups):
            cycle, pos = divmod(k, world_size)
            per_rank[pos if cycle % 2 == 0 else world_size - 1 - pos].append(g)
        for rank, rank_groups in enumerate(per_rank):
            for k, g in enumerate(rank_groups):
                parts[rank][k % mini_batches].extend(g)
    return parts
