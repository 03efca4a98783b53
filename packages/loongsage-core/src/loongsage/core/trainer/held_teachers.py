"""MOPD teachers held by the trainer's own ranks (a source's ``teacher: {name: trainer}``).

Each teacher is a frozen copy of the trainer backend built from another checkpoint
(:meth:`~loongsage.core.trainer.skeleton.TrainerSkeleton.add_teacher`): the policy's dtype, head and
split over the ranks, no optimizer. It is asked two things:

* before the advantages, the log-probs of the sampled tokens of its sources' rows
  (:meth:`HeldTeachers.logprobs`, read by the PG branch);
* in each micro-batch of a train step, its distribution over the student's positions (its top-k
  or the full vocabulary, as the divergence reads), computed just before the student's forward
  and dropped with the micro-batch (:meth:`HeldTeachers.support`). With a 150k-token vocabulary
  the full distribution is 0.6 MB a token: computed here, it never leaves the device.

A split model's forward is a collective (tensor, expert and pipeline parallelism, FSDP2), and the
ranks hold different rows: every teacher runs on every rank for every micro-batch, a two-token
filler where it has no rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from loongsage.core.model_math.logprobs import response_start
from loongsage.core.types import TrainBatch


class HeldTeachers:
    """The teachers one trainer rank holds, each with the data sources it teaches."""

    def __init__(self) -> None:
        self.held: list[tuple[frozenset[str], Any]] = []

    def __bool__(self) -> bool:
        return bool(self.held)

    def add(self, sources: list[str], teacher: Any) -> None:
        self.held.append((frozenset(sources), teacher))

    def models(self) -> list[Any]:
        return [teacher for _, teacher in self.held]

    @staticmethod
    def _rows(batch: TrainBatch, sources: frozenset[str]) -> list[int]:
        return [i for i, source in enumerate(batch.sources) if source in sources]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor:
        """Each row's teacher's log-probs of its tokens ``[B, T]`` (every teacher called, rows or not)."""
        out = torch.zeros(batch.input_ids.shape)
        for sources, teacher in self.held:
            rows = self._rows(batch, sources)
            lp = teacher.logprobs(batch.select(rows), token_budget)[0]
            if rows:
                out[torch.tensor(rows), : lp.shape[1]] = lp
        return out

    def planned(
        self, plans: list[tuple[list[int], TrainBatch] | None], sources: frozenset[str]
    ) -> list[tuple[list[int], TrainBatch] | None]:
        """A teacher's share of the step's micro-batches: its rows of each (None: none there)."""
        out: list[tuple[list[int], TrainBatch] | None] = []
        for planned in plans:
            rows = [] if planned is None else self._rows(planned[1], sources)
            out.append((rows, _alone(planned[1].select(rows))) if rows else None)
        return out

    @torch.no_grad()
    def support(
        self, mb: TrainBatch | None, topk: int, device: Any, collective: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """The teachers' distribution for micro-batch ``mb`` (on the host; None: a padding pass):
        ``(ids [n, t, k], log-probs [n, t - first, k])`` over each row's teacher's top ``topk``
        tokens, or ``(None, log-probs [n, t - first, V])`` over the full vocabulary with ``topk``
        0; positions from the micro-batch's first trained token on, as the student's
        distribution. ``collective``: teachers without rows here run a filler forward."""
        if mb is None:
            for _, teacher in self.held:
                if collective:
                    teacher.teacher_filler()
            return None, None
        n, t = mb.input_ids.shape
        width = t - max(response_start(mb.response_mask), 1)
        ids = torch.zeros(n, t, topk, dtype=torch.long, device=device) if topk else None
        logprobs = None
        for sources, teacher in self.held:
            rows = self._rows(mb, sources)
            if not rows:
                if collective:
                    teacher.teacher_filler()
                continue
            dist = teacher.teacher_distribution(_alone(mb.select(rows)).to(device))  # [rows, t - its first, V]
            dist = dist[:, max(dist.shape[1] - width, 0) :]  # rows that train nothing start at position 1
            if topk:
                dist, top = dist.topk(topk, dim=-1)
                ids[torch.tensor(rows, device=device), t - dist.shape[1] :] = top
            if logprobs is None:
                logprobs = torch.zeros(n, width, dist.shape[-1], device=device)
            logprobs[torch.tensor(rows, device=device), width - dist.shape[1] :] = dist
        return ids, logprobs


def _alone(mb: TrainBatch) -> TrainBatch:
    """A micro-batch as a teacher scores it: on its own full distribution, not on another's support."""
    return replace(mb, teacher_dist_ids=None, teacher_dist_logprobs=None)
