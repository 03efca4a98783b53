"""The single controller: starts one worker group per role (trainer ranks, engine replicas, reward,
critic, teachers; see :mod:`loongsage.core.worker_group`) and drives the step loop over them.

One step, as data: the mixer plans exact per-source quotas -> agents generate through the engine
router -> the reward worker scores -> filters keep groups -> (MOPD) each source's teacher scores the
student's tokens -> advantages over the whole batch (MOPD: shaped by the teacher's log-probs) -> the
batch is dealt to DP ranks and mini-batches -> trainer ranks compute old/ref log-probs ->
corrections and global loss weights per mini-batch -> optimizer steps -> the trainer pushes its
weights to the engines (version += 1) -> metrics, evaluation, checkpoint.

The run's services (config ``services``, the chat gateway) start on the rollout's event loop before
the first generation and stop after the last (:mod:`loongsage.core.services`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from typing import Any

import torch

from loongsage.core import checkpoint as ckpt
from loongsage.core.batching import compute_advantages, engine_sampled, exclude_rows, loss_excluded, to_batch, trainable
from loongsage.core.config import Config
from loongsage.core.data import Mixer, SourceCursor
from loongsage.core.distill import TeacherPlan, distill_metrics, fill_teacher_tensors, plan_teachers
from loongsage.core.evaluation import Evaluator
from loongsage.core.loss import consistency_metrics
from loongsage.core.metrics import Metrics
from loongsage.core.placement import Placement, free_port
from loongsage.core.planning import StepPlan, plan_step
from loongsage.core.rollout import EngineRouter, RolloutService
from loongsage.core.services import RunServices, ServiceContext
from loongsage.core.types import ConfigError, TrainBatch, Trajectory
from loongsage.core.workers import (
    CriticWorker,
    EngineWorker,
    RewardWorker,
    TeacherWorker,
    TrainerWorker,
    build_pipeline,
    model_args,
)
from loongsage.core.worker_group import Slot, WorkerGroup, per_rank, wait_ready

log = logging.getLogger("loongsage")


def resolve_model_path(cfg: Config, registry: Any) -> str:
    """The HF folder the run starts from: ``model.path``, or what ``model.builder`` makes (cached)."""
    if cfg.model.builder is None:
        return str(cfg.model.path)
    builder = registry.create("model_builder", cfg.model.builder, "model.builder")
    return str(builder.build())


class Controller:
    engine_start_timeout_s = 600.0  # a lost engine's replacement: actor start and model load

    def __init__(self, cfg: Config, registry: Any):
        self.cfg, self.registry = cfg, registry
        self.run_dir = cfg.run_dir.resolve()  # actors may run in another working directory
        self.step = 0
        self.version = 0
        self.training = False  # the step loop has begun (what a failure's message reports the step of)
        self.rollout: RolloutService | None = None  # built once the engines and the reward worker exist
        # one WorkerGroup per role, set by _start_actors; ``groups``: every group started, in order
        # (what the end of a run kills, however far the start got)
        self.groups: list[WorkerGroup] = []
        self.trainer_group = self.engine_group = self.reward_group = self.critic_group = None
        self.teacher_group: WorkerGroup | None = None  # MOPD: one teacher per distinct spec
        self.teacher_sources: list[list[str]] = []  # the sources each teacher serves, by rank
        self.distilling = False  # MOPD: teachers in workers or held by the trainer ranks
        # the trainer ranks' data-parallel layout (each rank its own until the trainers say otherwise)
        self._set_data_layout([(r, cfg.trainer.world_size, True) for r in range(cfg.trainer.world_size)])

    def _set_data_layout(self, layout: list[tuple[int, int, bool]]) -> None:
        """Rows are dealt to data-parallel ranks; the trainer ranks of one (a model-parallel group)
        all get its rows, and its leader's answers are the ones read."""
        self.dp_size = int(layout[0][1])
        self.dp_of = [int(d) for d, _, _ in layout]
        self.dp_leader = {int(d): r for r, (d, _, lead) in enumerate(layout) if lead}

    # ------------------------------------------------------------------ setup
    def _start_actors(self, model_path: str, teacher_plans: list[TeacherPlan] = ()) -> None:
        cfg = self.cfg
        threads = cfg.placement.torch_threads
        world = cfg.trainer.world_size
        # the critic rides on trainer bundle 0, the teachers round robin over the trainer bundles
        held = [(plan.sources, plan.model_path) for plan in teacher_plans if plan.held_by_trainer]
        teacher_plans = [plan for plan in teacher_plans if not plan.held_by_trainer]
        riders = ([0] if cfg.trainer.critic is not None else []) + [j % world for j in range(len(teacher_plans))]
        place = self.placement = Placement(cfg, riders)
        init_method = f"tcp://127.0.0.1:{free_port()}" if world > 1 else None
        # generation and training overlap under an asynchronous scheduler: on CPU each actor then
        # gets cores of its own, so the two do not slow each other down
        cores = place.cores() if self._rollout_parts["scheduler"].asynchronous else {}
        self.trainer_group = self._start_group("trainer", TrainerWorker, [
            place.slot(b, (cfg, model_path, r, world, init_method, threads, cores.get(b), held))
            for r, b in enumerate(place.trainer_bundles)], ready="param_checksum")
        # a lost engine's replacement starts from its slot: same bundle, same constructor arguments
        self.engine_group = self._start_group("engine", EngineWorker, [
            place.slot(b, (cfg, model_path, i, threads, cores.get(b)), max_concurrency=1000)
            for i, b in enumerate(place.engine_bundles)], ready="version")
        self.reward_group = self._start_group("reward", RewardWorker, [
            Slot(None, {"num_cpus": 0, "max_concurrency": 1000}, (cfg,))])
        # the critic and the teachers share the trainer ranks' bundles without reserving CPUs: the
        # critic the first one; the teachers (forward only, in the train phase of a synchronous step)
        # round robin
        bundles = place.trainer_bundles
        self.critic_group = self._start_group("critic", CriticWorker, [
            place.slot(bundles[0], (cfg, model_path, threads), num_cpus=0)] if cfg.trainer.critic is not None else [])
        self.teacher_group = self._start_group("teacher", TeacherWorker, [
            place.slot(bundles[j % len(bundles)], (cfg, plan.spec, plan.model_path, threads), num_cpus=0)
            for j, plan in enumerate(teacher_plans)])
        self.teacher_sources = [plan.sources for plan in teacher_plans]
        self.distilling = bool(held or teacher_plans)
        wait_ready(self.groups)
        self._set_data_layout(self.trainer_group.call("data_layout"))
        rc = cfg.rollout
        engines = self.engine_group.actors  # the router swaps a ready replacement into this very list
        self.rollout = RolloutService(router=EngineRouter(engines, health_timeout_s=rc.engine_health_timeout_s),
                                      engines=engines, reward=self.reward_group.only(),
                                      restart_engine=self._restart_engine, load_engine=self._load_engine,
                                      max_engine_restarts=rc.max_engine_restarts, **self._rollout_parts)

    def _start_group(self, role: str, worker_class: type, slots: list[Slot],
                     ready: str = "__ray_ready__") -> WorkerGroup:
        group = WorkerGroup.start(role, worker_class, slots, ready=ready)
        self.groups.append(group)
        return group

    def _restart_engine(self, index: int, lost: Any) -> Any:
        """A new engine replica ``index`` from the lost one's slot (called by the rollout's engine
        recovery, in a worker thread). Not put in the engine list: the recovery does that once the
        replacement holds the current weights."""
        return self.engine_group.replace(index, install=False, timeout_s=self.engine_start_timeout_s)

    def _load_engine(self, engine: Any, version: int) -> None:
        """Push the trainer's weights to ``engine`` alone and give it ``version`` (the other engines
        keep theirs). Called only while the trainer is at rest, when its weights are that version's."""
        import ray

        self.trainer_group.call("push_weights", [engine])  # every rank: the gather is a collective
        ray.get(engine.set_version.remote(version))

    def _build_local(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        cfg, reg = self.cfg, self.registry
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        cursors = [
            SourceCursor(s.name, reg.create("data_source", s.reader, f"data_sources[{i}].reader"),
                         seed=cfg.run.seed * 7919 + i, on_bad_row=s.on_bad_row)
            for i, s in enumerate(cfg.data_sources)
        ]
        self.filters = [reg.create("data_filter", f, f"algorithm.filters[{i}]") for i, f in enumerate(cfg.algorithm.filters)]
        # what the rollout service is built from once the actors exist
        self._rollout_parts = dict(
            tokenizer=self.tokenizer, mixer=Mixer(cursors, {s.name: s.prompts_per_step for s in cfg.data_sources}),
            agents={s.name: reg.create("agent", s.agent, f"data_sources[{i}].agent")
                    for i, s in enumerate(cfg.data_sources)},
            sampling={s.name: cfg.sampling_for(s) for s in cfg.data_sources}, filters=self.filters,
            scheduler=reg.create("rollout_scheduler", cfg.rollout.scheduler, "rollout.scheduler"), seed=cfg.run.seed,
            max_refill_rounds=cfg.rollout.max_refill_rounds, refill_oversample=cfg.rollout.refill_oversample,
            mask_old_tokens=cfg.rollout.mask_old_tokens)
        self.estimator = reg.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
        self.pipeline = build_pipeline(cfg, reg)
        from loongsage.core.tracking import create_trackers

        self.trackers = create_trackers(reg, cfg, self.run_dir)
        self.evaluator = Evaluator(cfg, reg)

    def _preflight(self, model_path: str) -> None:
        """Backend checks that need the model (a LoRA target's name, say), before any actor starts:
        a backend factory may define ``preflight(params, model_path, world_size=...)``."""
        cfg, reg = self.cfg, self.registry
        supplied = tuple(model_args(cfg, model_path))  # what the framework passes to trainer factories
        for spec, path in ((cfg.trainer.backend, "trainer.backend"),
                           (cfg.trainer.critic.backend if cfg.trainer.critic else None, "trainer.critic.backend")):
            if spec is None:
                continue
            check = reg.entry("trainer", spec["name"], path).preflight
            if check is None:
                continue
            params = reg.check("trainer", spec, path, skip=supplied)
            try:
                check(params, model_path, world_size=cfg.trainer.world_size)
            except ValueError as exc:
                raise ConfigError(f"{path}.params.{exc}") from None

    # ------------------------------------------------------------------ training
    def _train(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        import ray

        cfg = self.cfg
        groups = [trainable(g) for g in groups]
        groups = [g for g in groups if g]
        trajs = [t for g in groups for t in g]
        if not trajs:
            return {"train/skipped": 1.0}
        batch = to_batch(trajs, self.pad_id)
        # samples a filter keeps out of the loss (DAPO overlong filtering): present for the
        # advantages, masked after them
        excluded = loss_excluded(trajs, self.filters)
        # the train-inference consistency metrics read the trained tokens an engine sampled: teacher-
        # forced ones (sft) have no rollout log-probs. The loss computes them when the training forward
        # gives the old log-probs; a batch that mixes both kinds has them recomputed and measured here.
        trained = batch.response_mask * (~excluded).to(batch.response_mask.dtype)[:, None]
        consistency_mask = trained * engine_sampled(batch)
        partly_sampled = bool(consistency_mask.any()) and not torch.equal(consistency_mask, trained)
        plan = plan_step(groups, self.dp_size, cfg.trainer.mini_batches_per_step,
                         quotas={s.name: s.prompts_per_step for s in cfg.data_sources})
        if self.distilling:
            self._score_with_teachers(batch, plan)
        if cfg.tracking.batches:
            self._audit(plan, trajs)
        metrics = Metrics()
        need_old = (self.pipeline.recompute_old_logprobs(cfg.trainer.mini_batches_per_step)
                    or (self.pipeline.kl_in_reward and self.pipeline.needs_ref_logprobs) or partly_sampled)
        if need_old or self.pipeline.needs_ref_logprobs:
            metrics.merge(self._fill_logprobs(batch, plan, old=need_old, consistency_mask=consistency_mask))
        else:
            batch.old_logprobs = None  # taken from the training forward itself
        token_rewards = None
        if self.pipeline.kl_in_reward and self.pipeline.needs_ref_logprobs:
            token_rewards = self.pipeline.kl_token_rewards(batch)
            count = float(batch.response_mask.sum())
            metrics.add("rollout/kl_reward", float(token_rewards.sum()), count)
            metrics.add("train/kl", float(token_rewards.sum()) / -self.pipeline.kl_coef, count)  # KL(pi_old || ref)
        if self.critic_group:
            batch.values = self.critic_group.call("values", batch)[0] * batch.response_mask
        compute_advantages(batch, self.estimator, values=batch.values, token_rewards=token_rewards)
        if any(f.excludes_from_loss is not None for f in self.filters):
            exclude_rows(batch, excluded)
            metrics.add("train/loss_excluded_frac", float(excluded.sum()), float(len(trajs)))
        if self.distilling:
            metrics.merge(distill_metrics(batch))
            if self.pipeline.pg_coef:
                batch.advantages = self.pipeline.shape_advantages(batch)
        for m in range(plan.mini_batches):
            union = plan.mini_batch_rows(m)
            if not union:
                continue
            mini_batch = batch.select(union)
            # corrections and loss weights over the whole mini-batch (global denominators)
            prepared, corrections = self.pipeline.prepare(mini_batch)
            metrics.merge(corrections)
            shards = [prepared.select(rows) for rows in plan.positions(m)]
            calls = self.trainer_group.call_async("train_step", per_rank([shards[d] for d in self.dp_of]))
            if self.critic_group:  # the value model steps beside the policy, in its own actor
                mini_batch.loss_weights = self.pipeline.aggregation_weights(mini_batch.response_mask)
                calls += self.critic_group.call_async("train_step", mini_batch)
            for out in ray.get(calls):
                metrics.merge(out)
        metrics.gauge("train/advantage_abs_mean", float((batch.advantages.abs() * batch.response_mask).sum()
                                                        / batch.response_mask.sum().clamp(min=1)))
        return metrics.means()

    def _audit(self, plan: StepPlan, trajs: list[Trajectory]) -> None:
        """One row per training step in ``<run_dir>/batches.jsonl``: every trained group's source,
        record index, group id, staleness (policy version minus its oldest token's), rank and
        mini-batch. A resumed run appends; the last row of a step is the one that counts."""
        groups = []
        for rank, rank_rows in enumerate(plan.rows):
            for mb, rows in enumerate(rank_rows):
                members: dict[int, list[Trajectory]] = {}
                for i in rows:
                    members.setdefault(trajs[i].group_id, []).append(trajs[i])
                for gid, group in members.items():
                    tokens = [v for t in group for v in t.versions if v >= 0]
                    groups.append({"source": group[0].source, "index": group[0].metadata.get("record_index"),
                                   "group_id": gid, "staleness": self.version - min(tokens, default=self.version),
                                   "rank": rank, "mini_batch": mb})
        with open(self.run_dir / "batches.jsonl", "a") as fh:
            fh.write(json.dumps({"step": self.step + 1, "version": self.version, "groups": groups}) + "\n")

    def _score_with_teachers(self, batch: TrainBatch, plan: StepPlan) -> None:
        """Every row's teacher scores the student's tokens: teacher workers concurrently (with the
        distribution the divergence reads), or the trainer ranks their own rows, with the teachers
        they hold (the log-probs only: the distribution is computed in the train step)."""
        if not self.teacher_group:
            fill_teacher_tensors(batch, [(rows, {"logprobs": lp})
                                         for rows, lp in self._per_dp_rank("teacher_logprobs", batch, plan)])
            return
        topk, full_vocab = self.pipeline.teacher_request()
        rows_of = {j: [i for i, s in enumerate(batch.sources) if s in sources]
                   for j, sources in enumerate(self.teacher_sources)}
        rows_of = {j: rows for j, rows in rows_of.items() if rows}  # teachers with no row are not called
        scores = self.teacher_group.call("score", per_rank([batch.select(rows) for rows in rows_of.values()]),
                                         topk, full_vocab, ranks=list(rows_of))
        fill_teacher_tensors(batch, list(zip(rows_of.values(), scores)))

    def _per_dp_rank(self, method: str, batch: TrainBatch, plan: StepPlan) -> list[tuple[list[int], Any]]:
        """``(rows, answer)`` of each data-parallel rank with rows, every trainer rank asked to run
        ``method`` on its rank's rows (even none: a split model's forward is a collective) and its
        leader's answer kept."""
        rank_rows = [plan.rank_rows(r) for r in range(plan.world_size)]
        answers = self.trainer_group.call(method, per_rank([batch.select(rank_rows[d]) for d in self.dp_of]))
        return [(rows, answers[self.dp_leader[d]]) for d, rows in enumerate(rank_rows) if rows]

    def _fill_logprobs(self, batch: TrainBatch, plan: StepPlan, *, old: bool,
                       consistency_mask: torch.Tensor | None = None) -> Metrics:
        """Old (and reference) log-probs, each trainer rank computing its own rows; with old ones also
        the consistency metrics over ``consistency_mask`` (default: the response mask)."""
        B, T = batch.input_ids.shape
        batch.old_logprobs = torch.zeros(B, T) if old else None
        batch.ref_logprobs = torch.zeros(B, T) if self.pipeline.needs_ref_logprobs else None
        for rr, out in self._per_dp_rank("logprobs", batch, plan):
            idx = torch.tensor(rr)
            t = out["old_logprobs"].shape[1]
            if batch.old_logprobs is not None:
                batch.old_logprobs[idx, :t] = out["old_logprobs"]
            if batch.ref_logprobs is not None:
                batch.ref_logprobs[idx, :t] = out["ref_logprobs"]
        if batch.old_logprobs is None:
            return Metrics()
        mask = batch.response_mask if consistency_mask is None else consistency_mask
        return consistency_metrics(batch.old_logprobs, batch.rollout_logprobs, mask, self.pipeline.aggregation)

    def push_weights(self) -> dict[str, float]:
        """Every trainer rank exports its weights, rank 0 sends them to the engines; the engines'
        new version becomes the controller's. Returns the transfer's ``sync/*`` metrics."""
        pushed = self.trainer_group.call("push_weights", self.engine_group.actors)[0]
        self.version = pushed.version
        return pushed.metrics

    def resume(self) -> int:
        """Continue from the latest checkpoint: trainer state, data position, the rollout's buffers and
        groups in flight (asynchronous), the restored weights on the engines and the version numbering.
        Returns the step to start at (0 without a checkpoint)."""
        state = ckpt.restore(self.run_dir, self.trainer_group.actors, self.critic_group.only())
        if state is None:
            return 0
        self.rollout.restore(state)
        self.step = int(state["step"])
        self.push_weights()
        self.engine_group.call("set_version", int(state["version"]))
        self.version = int(state["version"])
        return self.step

    # ------------------------------------------------------------------ loop
    def run(self) -> dict[str, Any]:
        init_ray_environment()
        import ray

        from loongsage.core.config import placement_demand
        from loongsage.core.progress import StepProgress

        cfg = self.cfg
        started_ray = False
        try:
            model_path = self.model_path = resolve_model_path(cfg, self.registry)
            log.info("model: %s", model_path)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run_info.json").write_text(json.dumps({"model_path": model_path}, indent=1))
            self._build_local(model_path)
            self._preflight(model_path)
            # teachers' weights are resolved (and cached models built) here, before any actor starts
            teacher_plans = plan_teachers(cfg, self.registry, model_path) if cfg.algorithm.distill else []
            for plan in teacher_plans:
                log.info("teacher for %s: %s", ", ".join(plan.sources), plan.model_path)
            if not ray.is_initialized():
                cpus = math.ceil(placement_demand(cfg)[0]["CPU"] - 1e-9)  # what the bundles reserve
                start_ray(num_cpus=cfg.placement.num_cpus or max(len(os.sched_getaffinity(0)), cpus))
                started_ray = True
            self._start_actors(model_path, teacher_plans)
            start = self.resume() if cfg.checkpoint.resume else 0
            self.progress = StepProgress(cfg.run.total_steps, start, cfg.tracking.progress)
            summary = asyncio.run(self._loop(start, self.progress))
            return summary
        finally:
            if getattr(self, "progress", None) is not None:  # the bar's line ends before any message
                self.progress.close()
            # Release what exists, each step on its own: a failure part-way through setup (some actors
            # started, others not) must surface as itself, never as an error of the cleanup.
            from ray.util.placement_group import remove_placement_group

            steps: list[tuple[str, Any]] = [("close tracker", t.close) for t in getattr(self, "trackers", [])]
            if ray.is_initialized():
                # a group kills every actor it started, an engine's replacement not yet in use included
                steps += [(f"kill the {group.role} actors", group.kill) for group in self.groups]
                placement = getattr(self, "placement", None)
                if placement is not None:
                    steps.append(("remove placement group", lambda: remove_placement_group(placement.pg)))
            if started_ray:
                steps.append(("shut Ray down", ray.shutdown))
                steps.append(("restore Ray's printing", _restore_worker_output))
            for what, release in steps:
                try:
                    release()
                except Exception as exc:  # noqa: BLE001 - logged; the run's own outcome is what propagates
                    log.warning("cleanup: could not %s: %s: %s", what, type(exc).__name__, exc)

    async def _loop(self, start: int, progress: Any) -> dict[str, Any]:
        """The run's services around the training steps: started on this loop (the rollout's) before
        the first generation, handed to agents, stopped when the steps end or fail."""
        cfg = self.cfg
        self.services = RunServices(cfg.services, self.registry)
        try:
            self.rollout.services = self.services
            await self.services.start(ServiceContext(
                engine=self.rollout.router, tokenizer=self.tokenizer, model_path=self.model_path,
                run_dir=self.run_dir, registry=self.registry, seed=cfg.run.seed))
            return await self._steps(start, progress)
        finally:
            await self.services.stop()

    async def _steps(self, start: int, progress: Any) -> dict[str, Any]:
        cfg = self.cfg
        ev = cfg.evaluation
        history: list[dict[str, float]] = []
        offload = cfg.placement.offload_trainer  # colocated: the engines get the device while they generate
        carried = 0.0  # the time of the last offload, reported with the next step
        if offload:
            carried = await asyncio.to_thread(self._move_trainers, "offload")
        self.training = True
        if start == 0:
            self._log(0, await self.evaluator.run(self.rollout, self.step))
        for step in range(start, cfg.run.total_steps):
            t0 = time.perf_counter()
            groups, metrics = await self.rollout.next_batch(self.version)
            t1 = time.perf_counter()
            # an asynchronous rollout keeps generating (on its own resources) while this trains
            release = cfg.placement.release_engine_memory  # colocated: the trainer gets the device
            if release:
                released = time.perf_counter()
                await asyncio.to_thread(self.engine_group.call, "release_memory")
                released = time.perf_counter() - released
            if offload:
                carried += await asyncio.to_thread(self._move_trainers, "onload")
            metrics.update(await asyncio.to_thread(self._train, groups))
            if offload:  # the weights stay for the push
                metrics["timing/trainer_offload_s"] = carried + await asyncio.to_thread(
                    self._move_trainers, "offload", weights=False)
            if release:
                resumed = time.perf_counter()
                await asyncio.to_thread(self.engine_group.call, "resume_memory")
                metrics["timing/engine_memory_s"] = released + time.perf_counter() - resumed
            t2 = time.perf_counter()
            save_now = bool(cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0) \
                or step + 1 == cfg.run.total_steps
            await self.rollout.begin_update()  # asynchronous: generations in flight are cut here
            metrics.update(await asyncio.to_thread(self.push_weights))
            if save_now:  # the consistent cut: generation is held, the trainer holds what is saved
                rollout_state, rollout_data = await self.rollout.snapshot()
            self.rollout.end_update(self.version)  # ... and continue from their tokens on the new weights
            t3 = time.perf_counter()
            self.step = step + 1
            n = sum(len(g) for g in groups)
            metrics.update({
                "timing/rollout_s": t1 - t0, "timing/train_s": t2 - t1, "timing/sync_s": t3 - t2,
                "timing/step_s": t3 - t0, "perf/trajectories_per_s": n / max(t3 - t0, 1e-9),
                "engine/version": float(self.version), **self.services.metrics(),
            })
            last = self.step == cfg.run.total_steps
            if (ev.every_steps and self.step % ev.every_steps == 0) or last:
                metrics.update(await self.evaluator.run(self.rollout, self.step, pass_k=last))
            self._log(self.step, metrics)
            history.append(metrics)
            progress.update(metrics)
            if save_now:
                state = {"version": self.version, **rollout_state}
                async with self.rollout.trainer_in_use():  # no lost engine's replacement loads meanwhile
                    await asyncio.to_thread(ckpt.save, self.run_dir, self.step, state, self.trainer_group.actors,
                                            self.critic_group.only(), cfg.checkpoint.keep_last, rollout=rollout_data)
            if offload:  # after the push and the checkpoint, which read the weights on the device
                carried = await asyncio.to_thread(self._move_trainers, "offload")
        progress.close()
        await self.rollout.close()
        if cfg.checkpoint.export_hf:
            await asyncio.to_thread(ckpt.export_final, self.run_dir, self.trainer_group.actors)
        return {"steps": self.step, "version": self.version, "run_dir": str(self.run_dir),
                "last_metrics": history[-1] if history else {}}

    def _move_trainers(self, method: str, **kwargs: Any) -> float:
        """``offload`` or ``onload`` on every trainer and critic rank; returns the seconds it took."""
        start = time.perf_counter()
        for group in (self.trainer_group, self.critic_group):
            if group:
                group.call(method, **kwargs)
        return time.perf_counter() - start

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        for tracker in self.trackers:
            tracker.log(step, metrics)
        # every number of the step in the run's log (not on the terminal): a failed run's log then
        # shows where its metrics were heading
        log.info("step %d: %s", step, " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items())
                                               if isinstance(v, (int, float))), extra={"file_only": True})
        shown = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if shown:
            log.info("step %d eval %s", step, " ".join(f"{k}={v:.3f}" for k, v in sorted(shown.items())))


def start_ray(num_cpus: int) -> None:
    """Start a local Ray for this run. Its workers' output (and the raylet's messages) go to the
    run's log rather than the terminal, which keeps the launcher's own lines; a Ray that does not
    come up is one :class:`RunError` line."""
    import ray

    from loongsage.core.failures import RunError, launched, reinstall_stop_handlers

    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if os.environ.get("RAY_ADDRESS"):
            hint = f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} is set: unset it so that the run starts a Ray of its own"
        elif isinstance(exc, TimeoutError) or "timed out" in str(exc):
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            hint = (f"the machine is too busy for Ray to come up in time (load average {load:.1f} on {os.cpu_count()} "
                    "cores); try again when it is less busy")
        else:
            hint = "see the traceback"
        raise RunError(f"Ray did not start: {first}; {hint}") from exc
    if launched():  # the launcher's run: its log files are set up to take the actors' output
        reinstall_stop_handlers()  # ray.init replaced SIGTERM's
        _route_worker_output()


def _route_worker_output() -> None:
    """Send what Ray prints for the actors (their stdout and stderr, the raylet's error messages) to
    the ``loongsage.workers`` logger, which writes only to the log files. Ray prints them through
    one handler of its stream dispatcher and one function; where a Ray version has neither, its own
    printing stays."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    if not hasattr(dispatcher, "remove_handler") or not hasattr(ray_worker, "print_to_stdstream"):
        return
    workers = logging.getLogger("loongsage.workers")

    events = getattr(ray_worker, "filter_autoscaler_events", lambda lines: ())

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        pid = data.get("pid")
        lines = data.get("lines", ())
        if pid == "autoscaler":  # its periodic status report every few seconds; only its events, as Ray does
            lines = list(events(lines))
        who = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({pid}) " if pid in ("raylet", "autoscaler") else f"({who} pid={pid}) "
        for line in lines:
            workers.info("%s%s", prefix, line, extra={"file_only": True})

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", to_log)  # ray.shutdown removes it
    _ray_printing.setdefault("print_to_stdstream", ray_worker.print_to_stdstream)
    ray_worker.print_to_stdstream = to_log


_ray_printing: dict[str, Any] = {}  # what _route_worker_output replaced in Ray, put back after the run


def _restore_worker_output() -> None:
    if "print_to_stdstream" in _ray_printing:
        from ray._private import worker as ray_worker

        ray_worker.print_to_stdstream = _ray_printing.pop("print_to_stdstream")


def init_ray_environment() -> None:
    """Call before the first ``import ray``: Ray reads this switch at import time.

    Workers run in this very environment (same interpreter, same site-packages); Ray's `uv run` hook
    would instead try to rebuild a uv project inside every worker's working directory."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


