"""The Ray actors the controller drives: trainer ranks, engine replicas, the reward worker, the
critic and the distillation teachers.

Plain classes: the controller wraps them with ``ray.remote`` at placement time, so this module
imports without Ray and the same classes run in-process in tests and benchmarks. Each records a
``torch.profiler`` trace of the steps ``run.profile_steps`` lists (its mixin, :mod:`loongsage.core.profiling`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from loongsage.core.concurrency import gather_all
from loongsage.core.config import Config
from loongsage.core.contracts import Critic, RewardContext
from loongsage.core.loss import build_loss_plan
from loongsage.core.metrics import Metrics
from loongsage.core.profiling import AsyncProfiledActor, ProfiledActor
from loongsage.core.rewarding import call_reward
from loongsage.core.types import DataRecord, EngineUnavailable, RewardInfraError, Status, TrainBatch, Trajectory

_log = logging.getLogger(__name__)


def setup_worker(threads: int, cores: list[int] | None = None) -> None:
    """Per-actor process setup: pinned to ``cores`` when given, torch threads (0: one per usable
    core), and no per-file progress bars in the run's log."""
    from transformers.utils import logging as hf_logging

    if cores:
        os.sched_setaffinity(0, cores)
    # the cores this process may run on (a container or `taskset` may allow fewer than the machine has)
    usable = len(cores) if cores else len(os.sched_getaffinity(0))
    torch.set_num_threads(threads if threads > 0 else usable)
    hf_logging.disable_progress_bar()


def model_args(cfg: Config, model_path: str) -> dict[str, Any]:
    """What the framework supplies to trainer and engine factories (never set under params)."""
    return {"model_path": model_path, "dtype": cfg.model.dtype, "fp32_lm_head": cfg.model.fp32_lm_head}


@dataclass
class PushResult:
    """What a weight push left behind: the engines' new weight version and the transport's
    ``sync/*`` statistics (logged with the step)."""

    version: int
    metrics: dict[str, float] = field(default_factory=dict)


class TrainerWorker(ProfiledActor):
    """One data-parallel rank of the policy trainer (plus a frozen reference when KL needs it)."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
        threads: int = 0,
        cores: list[int] | None = None,
        teachers: list[tuple[list[str], str]] = (),
    ):
        from loongsage.core.plugins import load_registry

        setup_worker(threads, cores)
        torch.manual_seed(cfg.run.seed + rank)
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        if world_size > 1:
            # an actor on a GPU sends CUDA tensors (gradients, shards) by NCCL, CPU ones by gloo
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
            )
        registry = load_registry(cfg.plugins)
        supplied = model_args(cfg, model_path)
        self.backend = registry.create("trainer", cfg.trainer.backend, "trainer.backend", **supplied)
        opt = cfg.trainer.optimizer
        self.backend.setup_optimizer(opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.grad_clip, opt.warmup_steps)
        plan = build_loss_plan(cfg, registry)
        self.loss = plan.closure()
        self.needs_ref_logprobs = plan.needs_ref_logprobs
        self.transport = registry.create("transport", cfg.rollout.transport, "rollout.transport") if rank == 0 else None
        self.reference = None
        # A frozen reference for KL: its own model, unless the backend holds the starting policy
        # already (LoRA: the base weights with the adapters switched off).
        if self.needs_ref_logprobs and not self.backend.holds_reference:
            self.reference = registry.create("trainer", cfg.trainer.backend, "trainer.backend", **supplied)
        for sources, teacher_path in teachers:  # MOPD teachers held by the trainer (name: trainer)
            self.backend.add_teacher(sources, teacher_path)
        self.token_budget = cfg.trainer.micro_batch_tokens

    def logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Old (current-weights) log-probs and entropy; reference log-probs when KL needs them."""
        old, entropy = self.backend.logprobs(batch, self.token_budget)
        out = {"old_logprobs": old, "entropy": entropy}
        if self.reference is not None:
            out["ref_logprobs"] = self.reference.logprobs(batch, self.token_budget)[0]
        elif self.needs_ref_logprobs:
            out["ref_logprobs"] = self.backend.reference_logprobs(batch, self.token_budget)
        return out

    def teacher_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The held teachers' log-probs of the student's tokens (each row by its source's teacher)."""
        return self.backend.teacher_logprobs(batch, self.token_budget)

    def data_layout(self) -> tuple[int, int, bool]:
        """``(data-parallel rank, data-parallel size, leader)``. The ranks of one data-parallel rank
        (a model-parallel group) get the same rows; its leader answers for them."""
        return self.backend.data_parallel or (self.rank, self.world_size, True)

    def train_step(self, mini_batch: TrainBatch) -> Metrics:
        start = time.perf_counter()
        metrics = self.backend.train_step(mini_batch, self.loss, self.token_budget)
        dp_rank, _, leader = self.data_layout()
        if not leader:
            return Metrics()  # the same rows as its leader: its sums would count them twice
        # the gradient norm and learning rate are the model's, the same on every rank: the first
        # data-parallel rank's leader reports them, the others their shares of the sums
        if dp_rank != 0:
            return metrics.without_gauges()
        # the trainer's own share of the step's train phase (the rest: batch building, transfers)
        return metrics.total("timing/trainer_compute_s", time.perf_counter() - start)

    def push_weights(self, engines: list[Any]) -> PushResult | None:
        """Every rank calls (gathering shards is a collective); rank 0 sends to the engines and
        returns what the push did (the other ranks None)."""
        weights = self.backend.export_weights()
        if self.transport is None:
            for _ in weights:
                pass
            return None
        stats = self.transport.push(weights, engines)
        return PushResult(version=int(stats["sync/version"]), metrics=stats)

    def param_checksum(self) -> float:
        return self.backend.param_checksum()

    def offload(self, weights: bool = True) -> None:
        """Free the device for a colocated engine (the reference model's weights too)."""
        self.backend.offload(weights=weights)
        if self.reference is not None:
            self.reference.offload()

    def onload(self) -> None:
        self.backend.onload()
        if self.reference is not None:
            self.reference.onload()

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def export_hf(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.backend.export_hf(path, AutoTokenizer.from_pretrained(self.model_path))


class EngineWorker(AsyncProfiledActor):
    """One rollout engine replica; receives weights through the transport's buckets."""

    def __init__(self, cfg: Config, model_path: str, index: int = 0, threads: int = 0, cores: list[int] | None = None):
        from loongsage.core.plugins import load_registry

        setup_worker(threads, cores)
        registry = load_registry(cfg.plugins)
        self.engine = registry.create(
            "engine",
            cfg.rollout.engine,
            "rollout.engine",
            **model_args(cfg, model_path),
            seed=cfg.run.seed * 1000 + index,
        )
        offered = self.engine.weight_receiver
        own = offered(cfg.rollout.transport["name"]) if offered is not None else None
        self.receiver = own or registry.create("transport", cfg.rollout.transport, "rollout.transport").receiver()
        self._staging: list[tuple[str, torch.Tensor]] = []
        self._push_error: str | None = None  # why a bucket of the push under way failed

    async def generate(self, request):
        return await self.engine.generate(request)

    async def generate_stream(self, requests: list):
        """Several requests in one call, answered as each finishes: yields ``(k, results or error)``
        with ``k`` the request's position (the caller asks for a streaming reply)."""

        async def one(k: int, request):
            try:
                return k, await self.engine.generate(request)
            except EngineUnavailable:
                raise  # the engine is gone: the whole call fails and the run replaces it
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                return k, exc

        # started in order (as_completed alone would start them in set order): the engine queues
        # them as they come, and that order decides slots and batches
        tasks = [asyncio.ensure_future(one(k, r)) for k, r in enumerate(requests)]
        for finished in asyncio.as_completed(tasks):
            yield await finished

    def receive_bucket(self, *parts: Any, first: bool = False, commit: bool = False) -> int:
        """Stage one message of the transport's sender, its ``parts`` as sent (Ray hands an object
        ref among them over as its value); ``first``: a new push, whatever an earlier one left
        staged is dropped; with ``commit`` (the last) swap everything in at once. Returns the
        version. On any error the staged tensors are dropped and the engine keeps its version."""
        if first:
            self._staging, self._push_error = [], None
        if self._push_error is not None:  # a sender that does not wait per bucket learns it at the commit
            raise RuntimeError(
                f"an earlier bucket of this weight push failed ({self._push_error}); "
                f"nothing was committed, the engine keeps version {self.engine.version}"
            )
        try:
            if parts:
                self._staging.extend(self.receiver.receive(*parts))
            return self.commit_weights() if commit else self.engine.version
        except BaseException as exc:
            self._staging, self._push_error = [], f"{type(exc).__name__}: {exc}"[:300]
            raise

    def transport_setup(self, **kwargs: Any) -> Any:
        """What the transport's sender asks of this receiver before sending (join its group)."""
        if self.receiver.setup is None:
            raise RuntimeError(f"transport receiver {type(self.receiver).__name__} has no setup")
        return self.receiver.setup(**kwargs)

    def weight_checksums(self) -> dict[str, int]:
        """A checksum per HF-named tensor of the engine's weights (equal to the trainer's after an update)."""
        from loongsage.core.buckets import checksums

        if self.engine.named_weights is None:
            raise RuntimeError(f"engine {type(self.engine).__name__} does not expose its weights (named_weights)")
        return checksums(self.engine.named_weights())

    def commit_weights(self) -> int:
        """Swap the staged weights in atomically (between decode steps); returns the new version."""
        staged, self._staging = self._staging, []
        return self.engine.update_weights(staged)

    def set_version(self, version: int) -> None:
        """Continue a resumed run's version numbering."""
        self.engine.set_version(version)

    async def abort(self, request_ids: list[str] | None = None) -> list:
        """Abort requests (None: all); their results carry the tokens generated so far."""
        return await self.engine.abort(request_ids)

    def flush_cache(self) -> int:
        """Forget retained prefix caches (what runs next computes as on a fresh engine)."""
        return self.engine.flush_cache()

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def release_memory(self) -> None:
        """Give the device to a colocated trainer (KV cache freed, weights to host on a GPU)."""
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def version(self) -> int:
        return self.engine.version

    def health(self) -> dict:
        return self.engine.health()


class RewardWorker(AsyncProfiledActor):
    """Scores trajectories with each source's reward.

    A reward that cannot score one trajectory fails that trajectory, never its batch: whatever it
    raises (an agent that filled its sandbox, a response a parser chokes on) marks the trajectory
    ``failed`` with the reason, and the batch goes on. One exception is kept: a reward that raises
    the same error on every trajectory of a batch (two or more) has a bug of its own or a data set
    it cannot read, and training on nothing would hide that, so the run stops saying so.
    """

    def __init__(self, cfg: Config):
        from loongsage.core.plugins import load_registry

        registry = load_registry(cfg.plugins)
        self.rewards = {
            s.name: registry.create("reward", s.reward, f"data_sources[{i}].reward")
            for i, s in enumerate(cfg.data_sources)
        }
        self.names = {
            s.name: s.reward.get("name", "?") if isinstance(s.reward, dict) else "?" for s in cfg.data_sources
        }

    async def score(
        self, trajectories: list[Trajectory], records: list[DataRecord], services: dict[str, Any] | None = None
    ) -> list[tuple[float | None, str]]:
        """``(reward or None, status)`` per trajectory; ``services``: the run services' shared
        handles, handed to rewards that take a context."""
        ctx = RewardContext(services=dict(services or {}))
        errors: list[BaseException | None] = [None] * len(trajectories)

        async def one(i: int, t: Trajectory, r: DataRecord) -> tuple[float | None, str]:
            try:
                value = call_reward(self.rewards[t.source], t, r, ctx)
                if inspect.isawaitable(value):
                    value = await value
                return float(value), t.status.value
            except RewardInfraError as exc:
                return None, Status.FAILED.value + f": {exc}"
            except Exception as exc:  # noqa: BLE001 - one trajectory's failure, told in its status
                errors[i] = exc
                _log.warning(
                    "reward %r of source %r failed on trajectory %s/%s: %s: %s",
                    self.names.get(t.source),
                    t.source,
                    t.group_id,
                    t.sample_index,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                return None, Status.FAILED.value + f": reward raised {type(exc).__name__}: {exc}"[:500]

        scores = await gather_all(*(one(i, t, r) for i, (t, r) in enumerate(zip(trajectories, records))))
        if len(trajectories) >= 2 and all(e is not None for e in errors) and len({type(e) for e in errors}) == 1:
            t, exc = trajectories[0], errors[0]
            raise RuntimeError(
                f"reward {self.names.get(t.source)!r} of source {t.source!r} raised the same kind of error "
                f"on all {len(trajectories)} trajectories of a batch: {type(exc).__name__}: {exc}"
            ) from exc
        return scores


class TeacherWorker(ProfiledActor):
    """A forward-only distillation teacher (MOPD), shared by the data sources that name its spec."""

    def __init__(self, cfg: Config, spec: dict[str, Any], model_path: str, threads: int = 0):
        from loongsage.core.plugins import load_registry

        setup_worker(threads)
        registry = load_registry(cfg.plugins)
        self.backend = registry.create("teacher", spec, "teacher", model_path=model_path)

    def score(self, batch: TrainBatch, topk: int = 0, full_vocab: bool = False) -> dict[str, torch.Tensor | None]:
        """Teacher log-probs of the student's tokens (+ top-k or full-vocab log-probs when asked)."""
        return self.backend.score(batch, topk=topk, full_vocab=full_vocab)


class CriticWorker(ProfiledActor):
    """The value model of PPO: values before the update, then clipped value-loss steps."""

    def __init__(self, cfg: Config, model_path: str, threads: int = 0):
        from loongsage.core.loss import ValueLoss
        from loongsage.core.plugins import load_registry

        setup_worker(threads)
        critic = cfg.trainer.critic
        registry = load_registry(cfg.plugins)
        self.backend = registry.create(
            "trainer", critic.backend, "trainer.critic.backend", contract=Critic, **model_args(cfg, model_path)
        )
        opt = critic.optimizer
        self.backend.setup_optimizer(opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.grad_clip, opt.warmup_steps)
        self.loss = ValueLoss(clip=critic.value_clip)
        self.token_budget = cfg.trainer.micro_batch_tokens

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.values(batch, self.token_budget)

    def train_step(self, mini_batch: TrainBatch) -> Metrics:
        return self.backend.train_step(mini_batch, self.loss, self.token_budget).renamed("train/", "critic/")

    def offload(self, weights: bool = True) -> None:
        self.backend.offload(weights=weights)

    def onload(self) -> None:
        self.backend.onload()

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)
