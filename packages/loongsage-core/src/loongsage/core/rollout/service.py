"""The rollout service: the rollout side of a run as one object.

It takes prompts from the mixer, runs each record's agent through the engine router, has the reward
worker score the trajectories, applies the filters, refills each source back to its quota, and
hands the controller the next training batch as groups with exact per-source counts. The
controller never touches agents, the router or the data stream itself.

Every group gets a run-unique id in data order; its requests sample with a seed derived from that id
(:func:`loongsage.core.rollout.seeds.request_seed`), and the id counter and the mixer's position
are the service's checkpoint state, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import replace
from typing import Any

from loongsage.core.data import Mixer
from loongsage.core.rollout.agents import AgentContext, gather_groups
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.rollout.router import EngineRouter
from loongsage.core.types import DataRecord, SamplingParams, SchedulerState, Status, Trajectory

Groups = list[list[Trajectory]]


class RolloutService:
    """Dispatches prompts as the scheduler decides and returns scored, filtered groups.

    ``reward`` is the reward worker (an actor handle with ``score.remote(trajectories, records)``);
    ``engines`` the engine actor handles behind ``router``; ``filters`` the group filters in order.
    """

    def __init__(self, *, router: EngineRouter, engines: list[Any], reward: Any, tokenizer: Any, mixer: Mixer,
                 agents: dict[str, Any], sampling: dict[str, SamplingParams], filters: list[Any], scheduler: Any,
                 seed: int, max_refill_rounds: int = 0, refill_oversample: float = 1.0):
        self.router, self.engines, self.reward, self.tokenizer = router, engines, reward, tokenizer
        self.mixer, self.agents, self.sampling, self.filters = mixer, agents, sampling, filters
        self.scheduler, self.seed = scheduler, int(seed)
        self.max_refill_rounds, self.refill_oversample = int(max_refill_rounds), float(refill_oversample)
        self.next_group_id = 0  # run-unique, in data order; part of the checkpoint
        self.consumed = 0  # training batches handed out

    # ------------------------------------------------------------------ generation
    async def generate(self, records: list[DataRecord], sampling: dict[str, SamplingParams] | None = None,
                       agents: dict[str, Any] | None = None, group_ids: list[int] | None = None) -> Groups:
        """Groups of scored trajectories for ``records`` (one group per record).

        Training groups take the next ids of the run; evaluation passes ids of its own so that it
        never shifts the training stream.
        """
        sampling = sampling or self.sampling
        if group_ids is None:
            first, self.next_group_id = self.next_group_id, self.next_group_id + len(records)
            group_ids = list(range(first, self.next_group_id))
        contexts = [AgentContext(self.router, self.tokenizer, self._seeded(sampling[r.source], gid), gid)
                    for r, gid in zip(records, group_ids)]
        groups = await gather_groups(agents or self.agents, records, contexts)
        flat = [t for g in groups for t in g]
        recs = [r for r, g in zip(records, groups) for _ in g]
        scores = await self.reward.score.remote(flat, recs)
        for t, (value, status) in zip(flat, scores):
            t.reward = value
            if value is None:
                t.status = Status.FAILED
                t.metadata["failure"] = status
        return groups

    def _seeded(self, sampling: SamplingParams, group_id: int) -> SamplingParams:
        if sampling.greedy:
            return sampling
        base = self.seed if sampling.seed is None else sampling.seed
        return replace(sampling, seed=request_seed(base, group_id))

    async def flush_caches(self) -> None:
        """Make every engine forget its retained prefixes (see the engine's ``flush_cache``)."""
        await asyncio.gather(*(e.flush_cache.remote() for e in self.engines))

    # ------------------------------------------------------------------ training batches
    async def next_batch(self, version: int) -> tuple[Groups, dict[str, float]]:
        """The next training batch: every source's quota of groups that passed the filters.

        ``version`` is the policy version the batch will train. Synchronous scheduling: the step's
        prompts are dispatched now and the batch is complete when they are scored.
        """
        state = SchedulerState(version=version, groups_per_step=sum(self.mixer.quotas.values()),
                               in_flight=0, buffered=0, consumed=self.consumed)
        if self.scheduler.groups_to_dispatch(state) <= 0:
            raise RuntimeError("sync step: the scheduler dispatched nothing")
        plan = self.mixer.plan()
        records = [r for name in plan for r in plan[name]]
        groups = await self.generate(records)
        metrics = rollout_metrics(groups)  # of the step's own prompts, before filtering and refill
        kept = [g for g in groups if self._passes(g)]
        dropped = len(groups) - len(kept)
        kept, rounds = await self._refill(kept)
        metrics.update({"rollout/groups_filtered": float(dropped), "rollout/refill_rounds": float(rounds),
                        "rollout/groups_trained": float(len(kept))})
        self.consumed += 1
        return kept, metrics

    def _passes(self, group: list[Trajectory]) -> bool:
        return all(f(group) for f in self.filters)

    async def _refill(self, kept: Groups) -> tuple[Groups, int]:
        """Top each source back up to its quota after filters dropped groups (DAPO dynamic sampling).

        Each round asks for ``ceil(missing x refill_oversample)`` fresh prompts of every short source,
        keeps what passes the filters up to the quota, and stops after ``max_refill_rounds``; a step
        still short then trains on fewer groups. Extra prompts consume the data stream like any other.
        """
        rounds = 0
        while rounds < self.max_refill_rounds:
            have: dict[str, int] = defaultdict(int)
            for g in kept:
                have[g[0].source] += 1
            missing = {name: quota - have[name] for name, quota in self.mixer.quotas.items() if have[name] < quota}
            if not missing:
                break
            rounds += 1
            records = [r for name, n in missing.items()
                       for r in self.mixer.take(name, math.ceil(n * self.refill_oversample))]
            for g in await self.generate(records):
                source = g[0].source
                if have[source] < self.mixer.quotas[source] and self._passes(g):
                    kept.append(g)
                    have[source] += 1
        return kept, rounds

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        return {"mixer": self.mixer.state(), "next_group_id": self.next_group_id, "consumed": self.consumed}

    def restore(self, state: dict[str, Any]) -> None:
        self.mixer.restore(state["mixer"])
        self.next_group_id = int(state["next_group_id"])
        self.consumed = int(state.get("consumed", 0))


def rollout_metrics(groups: Groups) -> dict[str, float]:
    flat = [t for g in groups for t in g]
    scored = [t for t in flat if t.reward is not None]
    out = {
        "rollout/trajectories": float(len(flat)),
        "rollout/reward_mean": sum(t.reward for t in scored) / max(1, len(scored)),
        "rollout/response_length_mean": sum(len(t.response_ids) for t in flat) / max(1, len(flat)),
        "rollout/truncated_frac": sum(t.status is Status.TRUNCATED for t in flat) / max(1, len(flat)),
        "rollout/failed": float(sum(t.status is Status.FAILED for t in flat)),
    }
    by_source: dict[str, list[float]] = defaultdict(list)
    for t in scored:
        by_source[t.source].append(t.reward)
    for source, values in by_source.items():
        out[f"rollout_per_ds/{source}/reward_mean"] = sum(values) / len(values)
    return out
