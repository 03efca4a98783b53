"""Which rows of a training step each data-parallel rank trains, in which optimizer mini-batch.

A pure decision over plain data (no Ray, no tensors), tested directly. Its input is the step's
groups, each a list of trajectories; row ``i`` is the ``i``-th trajectory of the groups laid end
to end, which is the row order :func:`~loongsage.core.batching.to_batch` gives the step batch.

The dealing keeps a group on one rank and in one mini-batch (its rows share a baseline) and gives
every rank and every mini-batch each source's groups in the step's proportion: exactly, when each
source's group count divides by ``world_size x mini_batches`` (what config validation asks of
``prompts_per_step``, :func:`check_divisible`); a step that is short of its quota (filters dropped
groups that refill rounds could not replace, or every sample of a group failed) is dealt as evenly
as its counts allow, and a rank may then have no rows. Within a source, groups are dealt longest
first in snake order over the ranks (0, 1, .., R-1, R-1, .., 0), so the ranks' token loads stay
balanced.

The loss weights of a mini-batch are decided over the rows of *every* rank
(:meth:`StepPlan.mini_batch_rows`: global denominators), and each rank then takes its slice of that
prepared mini-batch (:meth:`StepPlan.positions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loongsage.core.types import Trajectory


@dataclass(frozen=True)
class StepPlan:
    """``rows[rank][mini_batch]``: row indices into the step batch."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.rows)

    @property
    def mini_batches(self) -> int:
        return len(self.rows[0])

    def rank_rows(self, rank: int) -> list[int]:
        """Every row of ``rank``, mini-batch after mini-batch (what it computes log-probs of)."""
        return [i for mb in self.rows[rank] for i in mb]

    def mini_batch_rows(self, mini_batch: int) -> list[int]:
        """The rows of one optimizer mini-batch over all ranks, rank after rank: what its global
        loss denominators are computed over."""
        return [i for rank in self.rows for i in rank[mini_batch]]

    def positions(self, mini_batch: int) -> list[list[int]]:
        """Per rank, where its rows sit in :meth:`mini_batch_rows` (its slice of the prepared mini-batch)."""
        out, start = [], 0
        for rank in self.rows:
            n = len(rank[mini_batch])
            out.append(list(range(start, start + n)))
            start += n
        return out


def check_divisible(group_counts: Mapping[str, int], world_size: int, mini_batches: int) -> None:
    """Refuse per-source group counts that cannot be shared exactly by ``world_size x mini_batches``
    parts, in one line naming the numbers (config validation asks the same of ``prompts_per_step``)."""
    parts = world_size * mini_batches
    for source, count in group_counts.items():
        if count % parts:
            raise ValueError(
                f"source {source!r}: {count} groups per step cannot be shared exactly by "
                f"trainer.world_size x trainer.mini_batches_per_step = {world_size} x {mini_batches} "
                f"= {parts} parts; make it a multiple of {parts}"
            )


def plan_step(
    groups: Sequence[Sequence[Trajectory]], world_size: int, mini_batches: int, quotas: Mapping[str, int] | None = None
) -> StepPlan:
    """Deal the step's groups to ``world_size`` ranks x ``mini_batches`` mini-batches.

    ``quotas`` (groups per step of each source, its ``prompts_per_step``), when given, are checked
    with :func:`check_divisible` and bound the counts: a step may fall short of its quota, never
    exceed it. Every row lands in exactly one (rank, mini-batch).
    """
    if world_size < 1 or mini_batches < 1:
        raise ValueError(f"plan_step: world_size={world_size} and mini_batches={mini_batches} must be >= 1")
    if any(not g for g in groups):
        raise ValueError("plan_step: a group without trajectories (drop empty groups first)")
    first_row, row = [], 0
    by_source: dict[str, list[int]] = {}
    for k, g in enumerate(groups):
        first_row.append(row)
        row += len(g)
        by_source.setdefault(g[0].source, []).append(k)
    if quotas is not None:
        check_divisible(quotas, world_size, mini_batches)
        for source, ks in sorted(by_source.items()):
            if len(ks) > quotas.get(source, 0):
                raise ValueError(
                    f"plan_step: source {source!r} has {len(ks)} groups, more than its quota of "
                    f"{quotas.get(source, 0)} per step"
                )
    rows: list[list[list[int]]] = [[[] for _ in range(mini_batches)] for _ in range(world_size)]
    for source in sorted(by_source):
        # longest first (a stable sort: equal loads keep their order), dealt in snake order
        ks = sorted(by_source[source], key=lambda k: -sum(len(t.prompt_ids) + len(t.response_ids) for t in groups[k]))
        per_rank: list[list[int]] = [[] for _ in range(world_size)]
        for n, k in enumerate(ks):
            cycle, pos = divmod(n, world_size)
            per_rank[pos if cycle % 2 == 0 else world_size - 1 - pos].append(k)
        for rank, rank_groups in enumerate(per_rank):
            for n, k in enumerate(rank_groups):
                rows[rank][n % mini_batches].extend(range(first_row[k], first_row[k] + len(groups[k])))
    return StepPlan(tuple(tuple(tuple(mb) for mb in rank) for rank in rows))
