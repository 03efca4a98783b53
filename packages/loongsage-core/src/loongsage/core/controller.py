"""The single controller: starts one typed group per role (trainer ranks, engine replicas, reward,
critic, teachers; see :mod:`loongsage.core.roles`) and drives the run's loop over them.

One step: the rollout service hands over a batch of scored groups (exact per-source quotas,
generated through the engine router, scored, filtered) -> the train step trains the trainer ranks
on it (:mod:`loongsage.core.step`) -> the trainer pushes its weights to the engines (version += 1)
-> metrics, evaluation, checkpoint. Placement, the services, the groups, the loop, checkpoints and
evaluation are this module's; what happens inside a step is the step's.

The run's services (config ``services``, the chat gateway) start on the rollout's event loop before
the first generation and stop after the last (:mod:`loongsage.core.services`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from loongsage.core import checkpoint as ckpt
from loongsage.core.config import Config
from loongsage.core.data import Mixer, SourceCursor, data_files
from loongsage.core.distill import TeacherPlan, plan_teachers
from loongsage.core.evaluation import Evaluator
from loongsage.core.failures import quiet_stopped_tasks
from loongsage.core.loss import build_loss_plan
from loongsage.core.placement import Placement, free_port
from loongsage.core.profiling import StepProfiles, trace_dir
from loongsage.core.ray_runtime import init_ray_environment, ray_release_steps, start_ray_for
from loongsage.core.roles import CriticGroup, EngineGroup, TeacherGroup, TrainerGroup
from loongsage.core.rollout import EngineRouter, RolloutService
from loongsage.core.services import RunServices, ServiceContext
from loongsage.core.step.train_step import TrainStep, step_features
from loongsage.core.types import ConfigError
from loongsage.core.worker_group import Slot, WorkerGroup, wait_ready
from loongsage.core.workers import CriticWorker, EngineWorker, RewardWorker, TeacherWorker, TrainerWorker, model_args

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
        # one typed group per role, set by _start_actors; ``groups``: every WorkerGroup started, in
        # order (what the end of a run kills, however far the start got)
        self.groups: list[WorkerGroup] = []
        self.trainer: TrainerGroup | None = None
        self.engines: EngineGroup | None = None
        self.critic: CriticGroup | None = None
        self.teachers: TeacherGroup | None = None  # MOPD: one teacher per distinct spec

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
        self.trainer = TrainerGroup(
            self._start_group(
                "trainer",
                TrainerWorker,
                [
                    place.slot(b, (cfg, model_path, r, world, init_method, threads, cores.get(b), held))
                    for r, b in enumerate(place.trainer_bundles)
                ],
                ready="param_checksum",
            ),
            world,
        )
        # a lost engine's replacement starts from its slot: same bundle, same constructor arguments
        self.engines = EngineGroup(
            self._start_group(
                "engine",
                EngineWorker,
                [
                    place.slot(b, (cfg, model_path, i, threads, cores.get(b)), max_concurrency=1000)
                    for i, b in enumerate(place.engine_bundles)
                ],
                ready="version",
            )
        )
        reward = self._start_group(
            "reward", RewardWorker, [Slot(None, {"num_cpus": 0, "max_concurrency": 1000}, (cfg,))]
        )
        # the critic and the teachers share the trainer ranks' bundles without reserving CPUs: the
        # critic the first one; the teachers (forward only, in the train phase of a synchronous step)
        # round robin
        bundles = place.trainer_bundles
        self.critic = CriticGroup(
            self._start_group(
                "critic",
                CriticWorker,
                [place.slot(bundles[0], (cfg, model_path, threads), num_cpus=0)]
                if cfg.trainer.critic is not None
                else [],
            )
        )
        self.teachers = TeacherGroup(
            self._start_group(
                "teacher",
                TeacherWorker,
                [
                    place.slot(bundles[j % len(bundles)], (cfg, plan.spec, plan.model_path, threads), num_cpus=0)
                    for j, plan in enumerate(teacher_plans)
                ],
            ),
            [plan.sources for plan in teacher_plans],
        )
        wait_ready(self.groups)
        self.trainer.read_layout()
        rc = cfg.rollout
        engines = self.engines.actors  # the router swaps a ready replacement into this very list
        self.rollout = RolloutService(
            router=EngineRouter(engines, health_timeout_s=rc.engine_health_timeout_s),
            engines=engines,
            reward=reward.only(),
            restart_engine=self._restart_engine,
            load_engine=self._load_engine,
            max_engine_restarts=rc.max_engine_restarts,
            **self._rollout_parts,
        )
        self.train_step = TrainStep(
            self.loss_plan,
            self.estimator,
            self.filters,
            self.trainer,
            step_features(
                self.loss_plan,
                self.filters,
                self.trainer,
                self.critic,
                self.teachers,
                distilling=bool(held or teacher_plans),
                audit_dir=self.run_dir if cfg.tracking.batches else None,
            ),
            pad_id=self.pad_id,
            mini_batches=cfg.trainer.mini_batches_per_step,
            quotas={s.name: s.prompts_per_step for s in cfg.data_sources},
        )

    def _start_group(
        self, role: str, worker_class: type, slots: list[Slot], ready: str = "__ray_ready__"
    ) -> WorkerGroup:
        group = WorkerGroup.start(role, worker_class, slots, ready=ready)
        self.groups.append(group)
        return group

    def _restart_engine(self, index: int, lost: Any) -> Any:
        """A new engine replica ``index`` from the lost one's slot (called by the rollout's engine
        recovery, in a worker thread). Not put in the engine list: the recovery does that once the
        replacement holds the current weights."""
        return self.engines.replace(index, timeout_s=self.engine_start_timeout_s)

    def _load_engine(self, engine: Any, version: int) -> None:
        """Push the trainer's weights to ``engine`` alone and give it ``version`` (the other engines
        keep theirs). Called only while the trainer is at rest, when its weights are that version's."""
        self.trainer.push_weights_to(engine)  # every rank: the gather is a collective
        EngineGroup.set_version_of(engine, version)

    def _build_local(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        cfg, reg = self.cfg, self.registry
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        cursors = [
            SourceCursor(
                s.name,
                reg.create("data_source", s.reader, f"data_sources[{i}].reader"),
                seed=cfg.run.seed * 7919 + i,
                on_bad_row=s.on_bad_row,
            )
            for i, s in enumerate(cfg.data_sources)
        ]
        self.filters = [
            reg.create("data_filter", f, f"algorithm.filters[{i}]") for i, f in enumerate(cfg.algorithm.filters)
        ]
        # what the rollout service is built from once the actors exist
        self._rollout_parts = dict(
            tokenizer=self.tokenizer,
            mixer=Mixer(cursors, {s.name: s.prompts_per_step for s in cfg.data_sources}),
            agents={
                s.name: reg.create("agent", s.agent, f"data_sources[{i}].agent") for i, s in enumerate(cfg.data_sources)
            },
            sampling={s.name: cfg.sampling_for(s) for s in cfg.data_sources},
            filters=self.filters,
            scheduler=reg.create("rollout_scheduler", cfg.rollout.scheduler, "rollout.scheduler"),
            seed=cfg.run.seed,
            max_refill_rounds=cfg.rollout.max_refill_rounds,
            refill_oversample=cfg.rollout.refill_oversample,
            mask_old_tokens=cfg.rollout.mask_old_tokens,
            # what agents' programs may not read: the labels, and the run's own folder (checkpoints)
            private_paths=(*data_files(cfg.data_sources), str(self.run_dir)),
        )
        self.estimator = reg.create("advantage", cfg.algorithm.advantage, "algorithm.advantage")
        self.loss_plan = build_loss_plan(cfg, reg)
        from loongsage.core.tracking import create_trackers

        self.trackers = create_trackers(reg, cfg, self.run_dir)
        self.evaluator = Evaluator(cfg, reg)

    def _preflight(self, model_path: str) -> None:
        """Backend checks that need the model (a LoRA target's name, say), before any actor starts:
        a backend factory may define ``preflight(params, model_path, world_size=...)``."""
        cfg, reg = self.cfg, self.registry
        supplied = tuple(model_args(cfg, model_path))  # what the framework passes to trainer factories
        for spec, path in (
            (cfg.trainer.backend, "trainer.backend"),
            (cfg.trainer.critic.backend if cfg.trainer.critic else None, "trainer.critic.backend"),
        ):
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

    # ------------------------------------------------------------------ weights and checkpoints
    def push_weights(self) -> dict[str, float]:
        """Every trainer rank exports its weights, rank 0 sends them to the engines; the engines'
        new version becomes the controller's. Returns the transfer's ``sync/*`` metrics."""
        pushed = self.trainer.push_weights(self.engines.actors)
        self.version = pushed.version
        return pushed.metrics

    def resume(self) -> int:
        """Continue from the latest checkpoint: trainer state, data position, the rollout's buffers and
        groups in flight (asynchronous), the restored weights on the engines and the version numbering.
        Returns the step to start at (0 without a checkpoint)."""
        state = ckpt.restore(self.run_dir, self.trainer, self.critic)
        if state is None:
            return 0
        self.rollout.restore(state)
        self.step = int(state["step"])
        self.push_weights()
        self.engines.set_version(int(state["version"]))
        self.version = int(state["version"])
        return self.step

    # ------------------------------------------------------------------ loop
    def run(self) -> dict[str, Any]:
        from loongsage.core.progress import StepProgress

        init_ray_environment()
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
            started_ray = start_ray_for(cfg)
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
            steps = [("close tracker", t.close) for t in getattr(self, "trackers", [])]
            steps += ray_release_steps(self.groups, getattr(self, "placement", None), started_ray)
            for what, release in steps:
                try:
                    release()
                except Exception as exc:  # noqa: BLE001 - logged; the run's own outcome is what propagates
                    log.warning("cleanup: could not %s: %s: %s", what, type(exc).__name__, exc)

    async def _loop(self, start: int, progress: Any) -> dict[str, Any]:
        """The run's services around the training steps: started on this loop (the rollout's) before
        the first generation, handed to agents, stopped when the steps end or fail."""
        cfg = self.cfg
        asyncio.get_running_loop().set_exception_handler(quiet_stopped_tasks)
        self.services = RunServices(cfg.services, self.registry)
        try:
            self.rollout.services = self.services
            await self.services.start(
                ServiceContext(
                    engine=self.rollout.router,
                    tokenizer=self.tokenizer,
                    model_path=self.model_path,
                    run_dir=self.run_dir,
                    registry=self.registry,
                    seed=cfg.run.seed,
                )
            )
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
        # run.profile_steps: every role's actors record the listed steps, t0 to t3 below
        profiles = StepProfiles(cfg.run.profile_steps, trace_dir(cfg), self.groups)
        for step in range(start, cfg.run.total_steps):
            profiled = step + 1 in profiles
            if profiled:
                await asyncio.to_thread(profiles.start, step + 1)
            t0 = time.perf_counter()
            groups, metrics = await self.rollout.next_batch(self.version)
            t1 = time.perf_counter()
            # an asynchronous rollout keeps generating (on its own resources) while this trains
            release = cfg.placement.release_engine_memory  # colocated: the trainer gets the device
            if release:
                released = time.perf_counter()
                await asyncio.to_thread(self.engines.release_memory)
                released = time.perf_counter() - released
            if offload:
                carried += await asyncio.to_thread(self._move_trainers, "onload")
            metrics.update(await asyncio.to_thread(self.train_step, groups, step=step + 1, version=self.version))
            if offload:  # the weights stay for the push
                metrics["timing/trainer_offload_s"] = carried + await asyncio.to_thread(
                    self._move_trainers, "offload", weights=False
                )
            if release:
                resumed = time.perf_counter()
                await asyncio.to_thread(self.engines.resume_memory)
                metrics["timing/engine_memory_s"] = released + time.perf_counter() - resumed
            t2 = time.perf_counter()
            save_now = (
                bool(cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0)
                or step + 1 == cfg.run.total_steps
            )
            await self.rollout.begin_update()  # asynchronous: generations in flight are cut here
            metrics.update(await asyncio.to_thread(self.push_weights))
            if save_now:  # the consistent cut: generation is held, the trainer holds what is saved
                rollout_state, rollout_data = await self.rollout.snapshot()
            self.rollout.end_update(self.version)  # ... and continue from their tokens on the new weights
            t3 = time.perf_counter()
            if profiled:  # after t3: writing the traces counts in none of the step's timings
                await asyncio.to_thread(profiles.stop, step + 1)
            self.step = step + 1
            n = sum(len(g) for g in groups)
            metrics.update(
                {
                    "timing/rollout_s": t1 - t0,
                    "timing/train_s": t2 - t1,
                    "timing/sync_s": t3 - t2,
                    "timing/step_s": t3 - t0,
                    "perf/trajectories_per_s": n / max(t3 - t0, 1e-9),
                    "engine/version": float(self.version),
                    **self.services.metrics(),
                }
            )
            last = self.step == cfg.run.total_steps
            if (ev.every_steps and self.step % ev.every_steps == 0) or last:
                metrics.update(await self.evaluator.run(self.rollout, self.step, pass_k=last))
            self._log(self.step, metrics)
            history.append(metrics)
            progress.update(metrics)
            if save_now:
                state = {"version": self.version, **rollout_state}
                async with self.rollout.trainer_in_use():  # no lost engine's replacement loads meanwhile
                    await asyncio.to_thread(
                        ckpt.save,
                        self.run_dir,
                        self.step,
                        state,
                        self.trainer,
                        self.critic,
                        cfg.checkpoint.keep_last,
                        rollout=rollout_data,
                    )
            if offload:  # after the push and the checkpoint, which read the weights on the device
                carried = await asyncio.to_thread(self._move_trainers, "offload")
        progress.close()
        await self.rollout.close()
        if cfg.checkpoint.export_hf:
            await asyncio.to_thread(ckpt.export_final, self.run_dir, self.trainer)
        return {
            "steps": self.step,
            "version": self.version,
            "run_dir": str(self.run_dir),
            "last_metrics": history[-1] if history else {},
        }

    def _move_trainers(self, method: str, **kwargs: Any) -> float:
        """``offload`` or ``onload`` on every trainer and critic rank; returns the seconds it took."""
        start = time.perf_counter()
        for group in (self.trainer, self.critic):
            if group:
                getattr(group, method)(**kwargs)
        return time.perf_counter() - start

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        for tracker in self.trackers:
            tracker.log(step, metrics)
        # every number of the step in the run's log (not on the terminal): a failed run's log then
        # shows where its metrics were heading
        log.info(
            "step %d: %s",
            step,
            " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()) if isinstance(v, (int, float))),
            extra={"file_only": True},
        )
        shown = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if shown:
            log.info("step %d eval %s", step, " ".join(f"{k}={v:.3f}" for k, v in sorted(shown.items())))
