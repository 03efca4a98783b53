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


def compute_advantages(batch: TrainBatch, estimator, values: torch.Tensor | None = None,
                       token_rewards: torch.Tensor | None = None) -> TrainBatch:
    """Advantages over the whole step batch; with critic values also the critic's targets."""
    inp = AdvantageInput(rewards=batch.rewards, group_ids=batch.group_ids, response_mask=batch.response_mask,
                         token_rewards=token_rewards, values=values)
    batch.advantages = estimator(inp).float() * batch.response_mask
    if values is not None and hasattr(estimator, "returns"):
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
