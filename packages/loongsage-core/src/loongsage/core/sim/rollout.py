"""A run's rollout side over simulated engines: the real ``RolloutService`` (mixer, agents, reward
worker, filters, scheduler, router, engine recovery) driven step by step as the controller drives it,
with the trainer's step a fixed simulated time (:func:`simulate_steps`).

The controller's own sequence is kept: a batch, the trainer's step, then the weight update
(``begin_update``, the push, ``end_update``), with a checkpoint's rollout state taken inside the
update and written after it by the real :func:`loongsage.core.checkpoint.save`. A lost engine is
replaced through the service's real engine recovery; the replacement is a fresh simulated engine,
ready at once (a real one takes its start-up time, during which the router sends the lost requests to
the live engines). The trainer's own state is not simulated: a checkpoint holds the rollout's alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongsage.core.rollout.router import STRAGGLER_RATIO
from loongsage.core.sim.clock import run_simulated
from loongsage.core.sim.engine import LatencyModel, LengthModel, LocalHandle, SimEngine, SimHandle
from loongsage.core.sim.faults import Fault
from loongsage.core.sim.trainer import SimulatedTrainer


def scaffold_model(folder: str | Path) -> str:
    """A model folder with the tiny tokenizer and a config, no weights: what a recipe's ``model.path``
    needs for the rollout side to encode prompts and decode answers."""
    from transformers import Qwen3Config

    from loongsage.core.tinytask.tokenizer import build_tokenizer

    folder = Path(folder)
    build_tokenizer(folder)
    Qwen3Config(vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    return str(folder)


@dataclass
class SimulatedRun:
    batches: list[tuple[list, dict[str, float]]] = field(default_factory=list)  # (groups, metrics) per step
    step_seconds: list[float] = field(default_factory=list)  # simulated, per step: asking for its batch
    update_seconds: list[float] = field(default_factory=list)  # simulated, per step: its weight update
    train_seconds: list[float] = field(default_factory=list)  # simulated, per step: the trainer's step
    first_step: int = 0  # the step the run started at (a resumed run: the checkpoint's)
    buffer_high_water: int = 0  # most finished groups waiting in the buffers after a batch was taken
    seconds: float = 0.0  # simulated
    scheduler: Any = None
    struck: list[tuple[int, int, str]] = field(default_factory=list)  # (step, engine, kind) of each fault
    replacements: list[SimHandle] = field(default_factory=list)  # engines started in place of lost ones
    router: Any = None  # the engine router at the end (its counters: restarts, requests sent again)


class _NoTrainer:
    """The trainer ranks (and critic) a checkpoint saves and loads: none in simulation."""

    def save(self, path: str) -> _Done:
        return _Done()

    def load(self, path: str) -> _Done:
        return _Done()


class _Done:
    def wait(self) -> None:
        return None


def simulate_steps(
    cfg: Any,
    registry: Any,
    model_path: str,
    *,
    engines: int,
    steps: int,
    train_s: float | SimulatedTrainer,
    lengths: LengthModel | None = None,
    latency: LatencyModel | None = None,
    slowdown: dict[int, float] | None = None,
    straggler_ratio: float | None = STRAGGLER_RATIO,
    faults: Sequence[Fault] = (),
    checkpoint_at: int | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
) -> SimulatedRun:
    """Steps up to ``steps`` of ``cfg``'s rollout over ``engines`` simulated engines: each step takes the
    next batch, trains ``train_s`` simulated seconds (or a :class:`SimulatedTrainer`'s time for that
    batch's tokens) and pushes the weights (the engines' version moves on). ``slowdown``: engine
    index -> how many times slower it decodes; ``straggler_ratio``: the router's (None: stragglers'
    requests are not sent to idle engines). ``faults``: engines
    killed or silenced during given steps (:mod:`loongsage.core.sim.faults`). ``checkpoint_at``: after
    that many steps, a checkpoint is written under ``run_dir`` as the controller writes it; ``resume``
    starts from ``run_dir``'s latest checkpoint instead of step 0, over fresh engines."""
    from loongsage.core import checkpoint as ckpt
    from loongsage.core.controller import Controller
    from loongsage.core.rollout import EngineRouter, RolloutService
    from loongsage.core.workers import RewardWorker

    if (checkpoint_at is not None or resume) and run_dir is None:
        raise ValueError("simulate_steps: checkpoint_at and resume need run_dir (where checkpoints are)")
    if checkpoint_at is not None and not 0 < checkpoint_at <= steps:
        raise ValueError(f"simulate_steps: checkpoint_at={checkpoint_at} must be within the run's 1..{steps} steps")
    bad = [i for i in (slowdown or {}) if not 0 <= i < engines]
    if bad:
        raise ValueError(f"simulate_steps: slowdown names engines {bad}, outside 0..{engines - 1}")
    controller = Controller(cfg, registry)
    controller._build_local(model_path)
    parts = controller._rollout_parts
    run = SimulatedRun(scheduler=parts["scheduler"])
    rc = cfg.rollout
    nobody: Any = _NoTrainer()  # for the trainer and the critic

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handles = [
            SimHandle(SimEngine(latency, lengths, slowdown=(slowdown or {}).get(i, 1.0))) for i in range(engines)
        ]

        def restart(index: int, lost: SimHandle) -> SimHandle:  # the controller's _restart_engine
            run.replacements.append(SimHandle(SimEngine(latency, lengths)))
            return run.replacements[-1]

        def load(handle: SimHandle, version: int) -> None:  # the controller's _load_engine
            handle.engine.version = version

        rollout = RolloutService(
            router=EngineRouter(handles, health_timeout_s=rc.engine_health_timeout_s, straggler_ratio=straggler_ratio),
            engines=handles,
            reward=LocalHandle(RewardWorker(cfg)),
            restart_engine=restart,
            load_engine=load,
            max_engine_restarts=rc.max_engine_restarts,
            **parts,
        )
        run.router = rollout.router
        version = 0
        if resume:  # the controller's resume(): the rollout's state, then the weights and their version
            state = ckpt.restore(Path(run_dir), nobody, nobody)
            if state is None:
                raise ValueError(f"simulate_steps: resume=True and no checkpoint under {run_dir}")
            rollout.restore(state)
            run.first_step, version = int(state["step"]), int(state["version"])
            for handle in handles:
                handle.engine.version = version
        updating, deferred = False, []

        def strike(step: int, fault: Fault) -> None:
            if updating:  # an engine lost during the push fails the run; these strike the rollout
                deferred.append((step, fault))
                return
            index = fault.strike(handles)
            if index is not None:
                run.struck.append((step, index, fault.kind))

        for step in range(run.first_step, steps):
            for fault in faults:
                if fault.step == step:
                    loop.call_later(fault.after_s, strike, step, fault)
            started = loop.time()
            run.batches.append(await rollout.next_batch(version))
            run.step_seconds.append(loop.time() - started)
            # the trainer's step: fixed, or following the batch's tokens
            seconds = train_s.step_s(run.batches[-1][0]) if isinstance(train_s, SimulatedTrainer) else train_s
            run.train_seconds.append(seconds)
            await asyncio.sleep(seconds)
            waiting = sum(len(s.buffer) for s in rollout.sources.values())
            run.buffer_high_water = max(run.buffer_high_water, waiting)
            updating, started = True, loop.time()
            await rollout.begin_update()
            for index, handle in enumerate(handles):  # the weight push
                if handle.dead or handle.silent:
                    raise RuntimeError(f"simulated weight push: engine {index} was lost and is still in the list")
                handle.engine.version = version + 1
            version += 1
            if checkpoint_at == step + 1:  # the consistent cut, as the controller takes it
                rollout_state, rollout_data = await rollout.snapshot()
            rollout.end_update(version)
            run.update_seconds.append(loop.time() - started)
            updating = False
            for late in deferred:
                strike(*late)
            deferred.clear()
            if checkpoint_at == step + 1:
                async with rollout.trainer_in_use():
                    await asyncio.to_thread(
                        ckpt.save,
                        Path(run_dir),
                        step + 1,
                        {"version": version, **rollout_state},
                        nobody,
                        nobody,
                        cfg.checkpoint.keep_last,
                        rollout=rollout_data,
                    )
        await rollout.close()

    _, run.seconds = run_simulated(main())
    return run
