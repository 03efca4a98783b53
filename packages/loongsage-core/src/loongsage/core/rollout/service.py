"""The rollout service: the rollout side of a run as one object.

It takes prompts from the mixer, runs each record's agent through the engine router, has the reward
worker score the trajectories, applies the filters, refills each source back to its quota, and
hands the controller the next training batch as groups with exact per-source counts. The
controller never touches agents, the router or the data stream itself.

Two modes, chosen by the scheduler:

* synchronous (``sync``): :meth:`RolloutService.next_batch` dispatches the step's prompts, waits
  for them, refills what the filters dropped in rounds, and returns;
* asynchronous (``one_step_off``, ``no_window``, ``window_gated``, ``windowed_fifo``): a
  dispatcher runs beside training, per source, as the scheduler allows (events: a group finished,
  a batch was consumed, an update ended). Finished groups that pass the filters wait in a per-source
  buffer; a filtered group frees its place, so the source is refilled by the next dispatch.
  ``next_batch`` takes each source's quota in dispatch order, once no group in it lags more than
  ``max_staleness`` versions (a staler one is dropped and its prompt dispatched again). Around a
  weight update (:meth:`begin_update` / :meth:`end_update`) generations in flight are cut and
  continued from their tokens on the new weights (see the router).

A lost engine (it died, or stopped answering) is replaced when the owner passes ``restart_engine``
and ``load_engine`` (see :mod:`loongsage.core.rollout.recovery`): the requests it held are sent
again with their seeds, so no prompt is lost or trained twice, in either mode. Every batch's metrics
count what happened since the previous batch: ``rollout/engine_restarts`` (replacements routed to)
and ``rollout/requests_redispatched`` (requests sent again).

Every group gets a run-unique id in data order; its requests sample with a seed derived from that id
(:func:`loongsage.core.rollout.seeds.request_seed`), and the id counter and the mixer's position
are part of the service's checkpoint state, so a resumed run draws exactly what an uninterrupted one
would.

Checkpoints (:meth:`RolloutService.snapshot`, taken while a weight update holds generation): the
mixer's position, the group counter and the batches consumed, as JSON, and, asynchronously, every
source's rollout as it stands: its dispatch counter, the finished groups in its buffer (whole
trajectories: tokens, log-probs, versions, rewards, statuses), the groups in flight (their ids,
records and every engine call they made with what came back, cut samples included; see
:mod:`loongsage.core.rollout.replay`), and the records waiting to go again. A resumed run trains the
buffered groups as they are and starts the groups in flight first, under their own ids and sequence
numbers: they replay their calls and continue their cut samples from their tokens, so the run goes on
as the uninterrupted one did, no prompt lost or trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Any

from loongsage.core.data import Mixer
from loongsage.core.rollout.agents import AgentContext, gather_groups
from loongsage.core.rollout.recovery import EngineRecovery
from loongsage.core.rollout.replay import GroupRecorder, RecordedCall
from loongsage.core.rollout.router import EngineRouter
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.services import RunServices
from loongsage.core.types import DataRecord, SamplingParams, SchedulerState, Status, Trajectory

Groups = list[list[Trajectory]]


class RolloutService:
    """Dispatches prompts as the scheduler decides and returns scored, filtered groups.

    ``reward`` is the reward worker (an actor handle with ``score.remote(trajectories, records)``);
    ``engines`` the engine actor handles behind ``router``; ``filters`` the group filters in order.
    ``restart_engine(index, lost) -> handle`` and ``load_engine(handle, version)`` (blocking; both or
    neither) replace a lost engine, at most ``max_engine_restarts`` times in a run.
    """

    def __init__(
        self,
        *,
        router: EngineRouter,
        engines: list[Any],
        reward: Any,
        tokenizer: Any,
        mixer: Mixer,
        agents: dict[str, Any],
        sampling: dict[str, SamplingParams],
        filters: list[Any],
        scheduler: Any,
        seed: int,
        max_refill_rounds: int = 0,
        refill_oversample: float = 1.0,
        mask_old_tokens: bool = False,
        restart_engine: Any = None,
        load_engine: Any = None,
        max_engine_restarts: int = 0,
        private_paths: tuple[str, ...] = (),
    ):
        self.router, self.engines, self.reward, self.tokenizer = router, engines, reward, tokenizer
        self.private_paths = tuple(private_paths)  # handed to the agents (AgentContext)
        self.mixer, self.agents, self.sampling, self.filters = mixer, agents, sampling, filters
        self.scheduler, self.seed = scheduler, int(seed)
        self.max_refill_rounds, self.refill_oversample = int(max_refill_rounds), float(refill_oversample)
        self.next_group_id = 0  # run-unique, in data order; part of the checkpoint
        self.consumed = 0  # training batches handed out
        self.asynchronous, self.max_staleness = bool(scheduler.asynchronous), int(scheduler.max_staleness)
        self.mask_old_tokens = bool(mask_old_tokens)
        self.sources = {name: _Source(quota) for name, quota in mixer.quotas.items()}
        self.version = 0  # the policy version the engines hold
        self._changed: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._counters: dict[str, float] = defaultdict(float)  # since the last batch
        self._resumed_reported = 0  # the router's continued samples at the last batch
        self.recovery = None
        if restart_engine is not None and max_engine_restarts > 0:
            self.recovery = EngineRecovery(
                router, restart=restart_engine, load=load_engine, max_restarts=max_engine_restarts, on_error=self._fail
            )
        self._failover_seen = (0, 0)  # the router's (restarts, redispatched) at the last batch
        self.services: RunServices | None = None  # the run's services (set once started)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        records: list[DataRecord],
        sampling: dict[str, SamplingParams] | None = None,
        agents: dict[str, Any] | None = None,
        group_ids: list[int] | None = None,
        engines: list[Any] | None = None,
    ) -> Groups:
        """Groups of scored trajectories for ``records`` (one group per record).

        Training groups take the next ids of the run; evaluation passes ids of its own so that it
        never shifts the training stream. ``engines``: what each group's agent generates through
        (default: the router).
        """
        sampling = sampling or self.sampling
        if group_ids is None:
            first, self.next_group_id = self.next_group_id, self.next_group_id + len(records)
            group_ids = list(range(first, self.next_group_id))
        engines = engines or [self.router] * len(records)
        handles = self.services.handles if self.services is not None else {}
        contexts = [
            AgentContext(
                engine, self.tokenizer, self._seeded(sampling[r.source], gid), gid, handles, self.private_paths
            )
            for r, gid, engine in zip(records, group_ids, engines)
        ]
        groups = await gather_groups(agents or self.agents, records, contexts)
        flat = [t for g in groups for t in g]
        recs = [r for r, g in zip(records, groups) for _ in g]
        try:
            scores = await self.reward.score.remote(flat, recs, self.services.shared if self.services else None)
        finally:  # what the trajectories held (their sandboxes) outlives their rewards, no longer
            if self.services is not None:
                await self.services.finish(flat)
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
        """Make every engine forget its retained prefixes (see the engine's ``flush_cache``); a lost
        engine has none to forget, and its replacement starts without."""
        from ray.exceptions import RayActorError

        live = [e for i, e in enumerate(self.router.engines) if i not in self.router.down]
        for answer in await asyncio.gather(*(e.flush_cache.remote() for e in live), return_exceptions=True):
            if isinstance(answer, BaseException) and not isinstance(answer, RayActorError):
                raise answer

    # ------------------------------------------------------------------ training batches
    async def next_batch(self, version: int) -> tuple[Groups, dict[str, float]]:
        """The next training batch: every source's quota of groups that passed the filters.

        ``version`` is the policy version the batch will train. Synchronous scheduling: the step's
        prompts are dispatched now and the batch is complete when they are scored.
        """
        self._raise_error()
        self.version = version
        if self.asynchronous:
            groups, metrics = await self._next_batch_async(version)
        else:
            groups, metrics = await self._next_batch_sync(version)
        metrics.update(self._failover_metrics())
        if self.recovery is not None:  # the trainer's weights change from here to the end of the update
            await self.recovery.before_batch()
        return groups, metrics

    async def _next_batch_sync(self, version: int) -> tuple[Groups, dict[str, float]]:
        state = SchedulerState(
            version=version,
            groups_per_step=sum(self.mixer.quotas.values()),
            in_flight=0,
            buffered=0,
            consumed=self.consumed,
        )
        if self.scheduler.groups_to_dispatch(state) <= 0:
            raise RuntimeError("sync step: the scheduler dispatched nothing")
        plan = self.mixer.plan()
        records = [r for name in plan for r in plan[name]]
        groups = await self.generate(records)
        metrics = rollout_metrics(groups)  # of the step's own prompts, before filtering and refill
        kept = [g for g in groups if self._passes(g)]
        dropped = len(groups) - len(kept)
        kept, rounds = await self._refill(kept)
        metrics.update(
            {
                "rollout/groups_filtered": float(dropped),
                "rollout/refill_rounds": float(rounds),
                "rollout/groups_trained": float(len(kept)),
            }
        )
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
            records = [
                r for name, n in missing.items() for r in self.mixer.take(name, math.ceil(n * self.refill_oversample))
            ]
            for g in await self.generate(records):
                source = g[0].source
                if have[source] < self.mixer.quotas[source] and self._passes(g):
                    kept.append(g)
                    have[source] += 1
        return kept, rounds

    # ------------------------------------------------------------------ asynchronous mode
    def _event(self) -> asyncio.Event:
        if self._changed is None:  # created on the running loop
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        self._event().set()

    def start(self, version: int) -> None:
        """Start dispatching beside training (asynchronous schedulers; a no-op otherwise); groups
        restored in flight from a checkpoint go first."""
        self.version = version
        if self.asynchronous and self._dispatcher is None:
            for name, src in self.sources.items():
                restored, src.restored = src.restored, []
                for seq, gid, calls in restored:
                    self._launch(name, src, seq, gid, src.outstanding[seq], calls)
            self._dispatcher = asyncio.ensure_future(self._dispatch_loop())

    async def close(self) -> None:
        """Stop dispatching and end what is in flight (at the end of the run)."""
        if self.recovery is not None:
            await self.recovery.close()
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._dispatcher] if self._dispatcher else []), return_exceptions=True)
        self._dispatcher, self._tasks = None, set()

    async def begin_update(self) -> None:
        """A weight update is about to start: generations in flight are cut (their samples wait), and
        a lost engine's replacement joins the engines the update is pushed to."""
        if self.asynchronous:
            await self.router.pause_for_update()
        elif self.recovery is not None:  # an engine idle since the rollout may have died since
            await self.router.check_engines()
        if self.recovery is not None:
            await self.recovery.before_update(self.version)

    def trainer_in_use(self) -> Any:
        """An async context for trainer work outside a step (a checkpoint): a lost engine's
        replacement is not loaded from the trainer meanwhile."""
        return self.recovery.trainer_in_use() if self.recovery is not None else contextlib.nullcontext()

    def end_update(self, version: int) -> None:
        """The engines hold ``version``: cut samples go on from their tokens, dispatch resumes."""
        self.version = version
        if self.recovery is not None:
            self.recovery.after_update(version)
        if self.asynchronous:
            self.router.resume_after_update()
            self._notify()

    def _scheduler_state(self, src: _Source) -> SchedulerState:
        return SchedulerState(
            version=self.version,
            groups_per_step=src.quota,
            in_flight=src.in_flight,
            buffered=len(src.buffer),
            consumed=src.consumed,
            dispatched=src.next_seq,
            oldest_unconsumed=min(src.outstanding, default=src.next_seq),
        )

    async def _dispatch_loop(self) -> None:
        try:
            while True:
                self._event().clear()
                for name, src in self.sources.items():
                    count = self.scheduler.groups_to_dispatch(self._scheduler_state(src))
                    if count > 0:
                        self._dispatch(name, src, count)
                await self._event().wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced by next_batch
            self._error = exc
            self._notify()

    def _dispatch(self, name: str, src: _Source, count: int) -> None:
        again = [src.returned.popleft() for _ in range(min(count, len(src.returned)))]
        records = again + (self.mixer.take(name, count - len(again)) if count > len(again) else [])
        for record in records:
            seq, gid = src.next_seq, self.next_group_id
            src.next_seq, self.next_group_id = seq + 1, gid + 1
            src.outstanding[seq] = record
            self._launch(name, src, seq, gid, record)

    def _launch(
        self, name: str, src: _Source, seq: int, gid: int, record: DataRecord, calls: list[RecordedCall] = ()
    ) -> None:
        recorder = GroupRecorder(self.router, calls)
        src.running[seq] = (gid, recorder)
        src.in_flight += 1
        task = asyncio.ensure_future(self._run_group(name, src, seq, gid, record, recorder))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(
        self, name: str, src: _Source, seq: int, gid: int, record: DataRecord, recorder: GroupRecorder
    ) -> None:
        try:
            (group,) = await self.generate([record], group_ids=[gid], engines=[recorder])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced by next_batch
            self._error = exc
            self._notify()
            return
        finally:
            # in the same event-loop step as the group enters the buffer: a snapshot sees it in one place
            src.in_flight -= 1
            del src.running[seq]
        if self._passes(group):
            src.buffer.append((seq, group))
        else:  # its place is refilled by the next dispatch
            del src.outstanding[seq]
            self._counters["rollout/groups_filtered"] += 1
        self._counters["rollout/groups_finished"] += 1
        self._notify()

    def _lag(self, oldest: int | None) -> int:
        """Versions between the policy and a group's oldest generated token (0: it has none)."""
        return 0 if oldest is None else self.version - oldest

    def _fail(self, exc: BaseException) -> None:
        """Surfaced by the next ``next_batch`` (and at once by the requests that wait on an engine)."""
        if self._error is None:
            self._error = exc
        self._notify()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout: {type(self._error).__name__}: {self._error}") from self._error

    def _failover_metrics(self) -> dict[str, float]:
        """Engines replaced and requests sent again since the previous batch."""
        now = (self.router.engine_restarts, self.router.requests_redispatched)
        seen, self._failover_seen = self._failover_seen, now
        return {
            "rollout/engine_restarts": float(now[0] - seen[0]),
            "rollout/requests_redispatched": float(now[1] - seen[1]),
        }

    async def _next_batch_async(self, version: int) -> tuple[Groups, dict[str, float]]:
        self.start(version)
        while True:
            self._raise_error()
            self._drop_stale()
            picks = {name: self._collectable(src) for name, src in self.sources.items()}
            if all(len(p) >= src.quota for p, src in zip(picks.values(), self.sources.values())):
                break
            self._event().clear()
            await self._event().wait()
        groups: Groups = []
        lags = []
        for (_name, src), pick in zip(self.sources.items(), picks.values()):
            taken = sorted(pick)[: src.quota]
            for seq in taken:
                oldest, group = src.take(seq)
                lags.append(self._lag(oldest))
                groups.append(group)
            src.consumed += src.quota
        masked = sum(mask_old_versions(t) for g in groups for t in g) if self.mask_old_tokens else 0
        self.consumed += 1
        metrics = rollout_metrics(groups)
        if self.mask_old_tokens:
            metrics["rollout/old_tokens_masked"] = float(masked)
        metrics.update({key: value for key, value in self._counters.items()})
        self._counters.clear()
        flat = [t for g in groups for t in g]
        spans = [len({v for v in t.versions if v >= 0}) for t in flat]
        metrics.update(
            {
                "rollout/groups_trained": float(len(groups)),
                "rollout/staleness_mean": sum(lags) / max(1, len(lags)),
                "rollout/staleness_max": float(max(lags, default=0)),
                "rollout/partial_frac": sum(n > 1 for n in spans) / max(1, len(spans)),
                "rollout/in_flight": float(sum(s.in_flight for s in self.sources.values())),
                "rollout/buffered": float(sum(len(s.buffer) for s in self.sources.values())),
                # per step like its neighbours: the samples continued from their tokens since the last batch
                "rollout/resumed_samples": float(self.router.resumed_samples - self._resumed_reported),
            }
        )
        self._resumed_reported = self.router.resumed_samples
        self._notify()  # consumption frees places
        return groups, metrics

    def _collectable(self, src: _Source) -> list[int]:
        state, collectable = self._scheduler_state(src), self.scheduler.collectable
        return [seq for seq, _ in src.buffer if collectable is None or collectable(seq, state)]

    def _drop_stale(self) -> None:
        """Never train beyond the staleness bound: a staler group goes, its prompt is dispatched again."""
        for src in self.sources.values():
            for seq, group in list(src.buffer):
                if self._lag(src.oldest_version(seq, group)) > self.max_staleness:
                    src.drop(seq, group)
                    self._counters["rollout/stale_dropped"] += 1

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The data position, the group counter and the batches consumed (JSON); synchronous
        scheduling has nothing in flight between steps, so this is its whole checkpoint state."""
        state = {"mixer": self.mixer.state(), "next_group_id": self.next_group_id, "consumed": self.consumed}
        if not self.asynchronous:  # empty lists, kept so that the checkpoint reads as it always did
            state["pending"] = {
                name: [dataclasses.asdict(r) for r in src.pending()] for name, src in self.sources.items()
            }
        return state

    async def snapshot(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(state, rollout)``: :meth:`state` and, asynchronously, every source's rollout as it stands
        (see the module docstring; plain data and dataclasses, copied, for ``torch.save``). Call it
        while a weight update holds generation (between :meth:`begin_update` and :meth:`end_update`):
        it waits until no request awaits an engine, and the cut is then consistent."""
        if not self.asynchronous:
            return self.state(), None
        await self.router.settled()
        sources = {}
        for name, src in self.sources.items():
            sources[name] = {
                "next_seq": src.next_seq,
                "consumed": src.consumed,
                "outstanding": dict(src.outstanding),
                "buffer": list(src.buffer),
                "returned": list(src.returned),
                "in_flight": [(seq, gid, recorder.snapshot()) for seq, (gid, recorder) in sorted(src.running.items())]
                + list(src.restored),  # restored and not started yet (no batch was asked for since)
            }
        rollout = {"sources": sources, "counters": dict(self._counters), "resumed_samples": self.router.resumed_samples}
        return self.state(), copy.deepcopy(rollout)  # the run goes on while the checkpoint is written

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: its JSON state (``controller.json``: :meth:`state` with the
        version) and, from an asynchronous run, ``state["rollout"]``, the rollout :meth:`snapshot`
        took (``rollout.pt``). An older checkpoint holds only the records not yet trained
        (``pending``): they are dispatched again first, as new groups."""
        self.mixer.restore(state["mixer"])
        self.next_group_id = int(state["next_group_id"])
        self.consumed = int(state.get("consumed", 0))
        self.version = int(state.get("version", self.version))
        if self.recovery is not None:  # a replacement loaded before the first update takes this version
            self.recovery.version = self.version
        for src in self.sources.values():  # every batch took each source's quota (the staleness budget reads it)
            src.consumed = self.consumed * src.quota
        for name, records in state.get("pending", {}).items():
            self.sources[name].returned.extend(DataRecord(**r) for r in records)
        rollout = state.get("rollout")
        if rollout is None:
            return
        self._counters.update(rollout["counters"])
        self.router.resumed_samples = self._resumed_reported = int(rollout["resumed_samples"])
        for name, saved in rollout["sources"].items():
            src = self.sources[name]
            src.next_seq, src.consumed = int(saved["next_seq"]), int(saved["consumed"])
            src.outstanding = dict(saved["outstanding"])
            src.buffer = list(saved["buffer"])
            src.oldest.clear()
            src.returned = deque(saved["returned"])
            src.restored = [tuple(entry) for entry in saved["in_flight"]]


@dataclass
class _Source:
    """One data source's bookkeeping in the asynchronous mode (counts in groups)."""

    quota: int  # groups per training batch
    next_seq: int = 0  # sequence number of the next group dispatched
    in_flight: int = 0
    consumed: int = 0
    buffer: list[tuple[int, list[Trajectory]]] = field(default_factory=list)  # (seq, group), kept
    outstanding: dict[int, DataRecord] = field(default_factory=dict)  # seq -> record, not yet trained
    returned: deque[DataRecord] = field(default_factory=deque)  # records to dispatch again first
    running: dict[int, tuple[int, GroupRecorder]] = field(default_factory=dict)  # seq -> (group id, its calls)
    restored: list[tuple[int, int, list[RecordedCall]]] = field(default_factory=list)  # (seq, group id, calls)

    # the oldest token version of each buffered group (None: no generated token), computed once: a
    # buffered group never changes, and its staleness is checked on every wake-up of the dispatcher
    oldest: dict[int, int | None] = field(default_factory=dict)

    def oldest_version(self, seq: int, group: list[Trajectory]) -> int | None:
        if seq not in self.oldest:
            self.oldest[seq] = _oldest_version(group)
        return self.oldest[seq]

    def take(self, seq: int) -> tuple[int | None, list[Trajectory]]:
        """Take a buffered group for training: its oldest token version and the group."""
        for k, (s, group) in enumerate(self.buffer):
            if s == seq:
                oldest = self.oldest_version(seq, group)
                del self.buffer[k]
                del self.outstanding[seq]
                del self.oldest[seq]
                return oldest, group
        raise KeyError(seq)

    def drop(self, seq: int, group: list[Trajectory]) -> None:
        """A buffered group too stale to train: its record goes again, first."""
        self.buffer.remove((seq, group))
        self.oldest.pop(seq, None)
        self.returned.append(self.outstanding.pop(seq))

    def pending(self) -> list[DataRecord]:
        """Records dispatched but not trained, in dispatch order, then those waiting to go again."""
        return [self.outstanding[s] for s in sorted(self.outstanding)] + list(self.returned)


def _oldest_version(group: list[Trajectory]) -> int | None:
    """The oldest weight version among a group's generated tokens (None when it has none)."""
    return min((v for t in group for v in t.versions if v >= 0), default=None)


def mask_old_versions(trajectory: Trajectory) -> int:
    """``rollout.mask_old_tokens``: keep in the loss only the tokens of the trajectory's newest
    policy version (a partial rollout's tokens from before a weight update leave the loss; tokens
    no engine sampled, version -1, keep their mask). Returns how many tokens it took out."""
    newest = max(trajectory.versions, default=-1)
    kept = [m if v < 0 or v == newest else 0 for m, v in zip(trajectory.loss_mask, trajectory.versions)]
    removed = sum(1 for before, after in zip(trajectory.loss_mask, kept) if before and not after)
    trajectory.loss_mask = kept
    return removed


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
    lengths: dict[str, list[int]] = defaultdict(list)
    for t in flat:
        lengths[t.source].append(len(t.response_ids))
    for source, values in lengths.items():
        out[f"rollout_per_ds/{source}/response_length_mean"] = sum(values) / len(values)
    return out
