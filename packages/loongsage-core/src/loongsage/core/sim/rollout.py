"""A run's rollout side over simulated engines: the real ``RolloutService`` (mixer, agents, reward
worker, filters, scheduler, router) driven step by step as the controller drives it, with the
trainer's step a fixed simulated time (:func:`simulate_steps`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongsage.core.sim.clock import run_simulated
from loongsage.core.sim.engine import LatencyModel, LengthModel, LocalHandle, SimEngine, SimHandle


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
    buffer_high_water: int = 0  # most finished groups waiting in the buffers after a batch was taken
    seconds: float = 0.0  # simulated
    scheduler: Any = None


def simulate_steps(
    cfg: Any,
    registry: Any,
    model_path: str,
    *,
    engines: int,
    steps: int,
    train_s: float,
    lengths: LengthModel | None = None,
    latency: LatencyModel | None = None,
) -> SimulatedRun:
    """``steps`` steps of ``cfg``'s rollout over ``engines`` simulated engines: each step takes the next
    batch, trains ``train_s`` simulated seconds and pushes the weights (the engines' version moves on)."""
    from loongsage.core.controller import Controller
    from loongsage.core.rollout import EngineRouter, RolloutService
    from loongsage.core.workers import RewardWorker

    controller = Controller(cfg, registry)
    controller._build_local(model_path)
    parts = controller._rollout_parts
    run = SimulatedRun(scheduler=parts["scheduler"])

    async def main() -> None:
        handles = [SimHandle(SimEngine(latency, lengths)) for _ in range(engines)]
        reward = LocalHandle(RewardWorker(cfg))
        rollout = RolloutService(router=EngineRouter(handles), engines=handles, reward=reward, **parts)
        rollout.start(0)
        for version in range(steps):
            run.batches.append(await rollout.next_batch(version))
            await asyncio.sleep(train_s)  # the trainer's step
            waiting = sum(len(s.buffer) for s in rollout.sources.values())
            run.buffer_high_water = max(run.buffer_high_water, waiting)
            await rollout.begin_update()
            for handle in handles:  # the weight push
                handle.engine.version = version + 1
            rollout.end_update(version + 1)
        await rollout.close()

    _, run.seconds = run_simulated(main())
    return run
