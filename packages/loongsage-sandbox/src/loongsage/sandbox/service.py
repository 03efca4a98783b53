"""Sandboxes as a run service: ``services: [{name: sandboxes, params: {...}}]``.

The run's :class:`~loongsage.sandbox.pool.SandboxPool` lives in an actor of its own on the driver's
machine (:class:`SandboxHost`), so that both sides of a trajectory reach the same sandbox:

* the agent, in the driver: ``sandboxes = ctx.services["sandboxes"]``, then
  ``box = await sandboxes.acquire(f"g{ctx.group_id}-s{k}")`` (a :class:`SandboxSession`: exec,
  files, its directory on the host), and ``box.attach(trajectory)`` on the trajectory it produced;
* its reward, in the reward worker: ``box = sandbox_of(trajectory, ctx)`` (the reward declares
  ``takes_context`` and gets a :class:`~loongsage.core.contracts.RewardContext`) runs the task's tests in the very
  sandbox the agent worked in (the R2E/SWE pattern).

Lifecycle: a trajectory's sandbox is released once the rollout is done with it, after every reward
of its batch returned (the service's ``finish``). An agent that fails or is cancelled releases its
sandboxes itself (:meth:`SandboxSession.release`; ``keep=True`` holds one for an owner that will
resume). Under the asynchronous schedulers' partial rollout an agent is never cancelled at a weight
update (its generation is cut and continued), so its sandbox simply stays with it. What slips
through all of that is removed at its deadline by the pool's reaper, and everything when the run
ends, even when it fails; sandboxes of a run that died are removed by the next run's pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongsage.core.contracts import ExecResult, RewardContext, SandboxOwner
from loongsage.core.schema import ranged
from loongsage.core.types import Trajectory

SERVICE = "sandboxes"  # the service's name, under which agents and rewards reach it
METADATA_KEY = "sandbox"  # trajectory.metadata[METADATA_KEY]: which sandbox a trajectory worked in


class SandboxHost:
    """The pool and its backend in an actor of their own (async: every call may overlap)."""

    def __init__(self, backend: dict[str, Any], plugins: tuple[str, ...], run: str, pool: dict[str, Any]):
        from loongsage.core.plugins import load_registry
        from loongsage.sandbox.pool import SandboxPool

        self.backend = load_registry(plugins).create("sandbox", backend, "services.sandboxes.params.backend")
        self.pool = SandboxPool(self.backend, run=run, **pool)
        self.run = run
        self.acquired = self.released = 0

    async def start(self) -> int:
        await self.pool.start()
        return self.pool.reaped_orphans

    async def acquire(self, trajectory: str, attempt: int, lifetime_s: float | None) -> tuple[str, str | None]:
        sandbox_id = await self.pool.acquire(SandboxOwner(self.run, trajectory, attempt), lifetime_s)
        self.acquired += 1
        host = self.backend.host_path(sandbox_id) if self.backend.host_path is not None else None
        return sandbox_id, host

    async def release(self, owners: list[tuple[str, int]], keep: bool = False) -> None:
        for trajectory, attempt in owners:
            owner = SandboxOwner(self.run, trajectory, attempt)
            if owner in self.pool.leases and not keep:
                self.released += 1
            await self.pool.release(owner, keep=keep)

    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        return await self.backend.exec(sandbox_id, cmd, timeout)

    async def put(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self.backend.put(sandbox_id, path, data)

    async def get(self, sandbox_id: str, path: str) -> bytes:
        return await self.backend.get(sandbox_id, path)

    async def put_archive(self, sandbox_id: str, path: str, archive: bytes) -> int:
        if self.backend.put_archive is None:
            raise NotImplementedError(f"sandbox backend {type(self.backend).__name__} has no put_archive")
        return await self.backend.put_archive(sandbox_id, path, archive)

    async def adopt(self, sandbox_id: str) -> int:
        return await self.backend.adopt(sandbox_id) if self.backend.adopt is not None else 0

    def stats(self) -> dict[str, float]:
        return {
            "sandbox/live": float(self.pool.live),
            "sandbox/leased": float(len(self.pool.leases)),
            "sandbox/warm": float(len(self.pool.idle)),
            "sandbox/waiting": float(self.pool.waiting),
            "sandbox/acquired": float(self.acquired),
            "sandbox/released": float(self.released),
            "sandbox/orphans_reaped": float(self.pool.reaped_orphans),
        }

    async def close(self) -> None:
        await self.pool.close()
        if self.backend.close is not None:  # the Sandbox contract's optional close
            await self.backend.close()


@dataclass
class SandboxSession:
    """One leased sandbox, reachable from any process of the run (it pickles as its ids)."""

    host: Any  # the SandboxHost actor
    service: str
    sandbox_id: str
    trajectory: str
    attempt: int = 0
    host_path: str | None = None  # the work directory on the driver's machine (backends that have one)

    async def exec(self, cmd: str, timeout: float = 60.0) -> ExecResult:
        return await self.host.exec.remote(self.sandbox_id, cmd, timeout)

    async def put(self, path: str, data: bytes) -> None:
        await self.host.put.remote(self.sandbox_id, path, data)

    async def get(self, path: str) -> bytes:
        return await self.host.get.remote(self.sandbox_id, path)

    async def put_archive(self, path: str, archive: bytes) -> int:
        return await self.host.put_archive.remote(self.sandbox_id, path, archive)

    async def adopt(self) -> int:
        """Hand the files a host program wrote into :attr:`host_path` to the sandbox."""
        return await self.host.adopt.remote(self.sandbox_id)

    async def release(self, keep: bool = False) -> None:
        """End the lease now (``keep``: hold the sandbox for this owner's resume, until its deadline)."""
        await self.host.release.remote([(self.trajectory, self.attempt)], keep)

    def attach(self, trajectory: Trajectory) -> None:
        """Record on ``trajectory`` that it worked in this sandbox: its reward finds it there, and
        the lease ends when the rollout is done with the trajectory."""
        trajectory.metadata[METADATA_KEY] = {
            "service": self.service,
            "id": self.sandbox_id,
            "trajectory": self.trajectory,
            "attempt": self.attempt,
        }


@dataclass
class Sandboxes:
    """What agents get as ``ctx.services[<name>]`` and rewards as ``ctx.services[<name>]``."""

    host: Any
    service: str

    async def acquire(self, trajectory: str, attempt: int = 0, lifetime_s: float | None = None) -> SandboxSession:
        """The sandbox of ``(trajectory, attempt)`` (its kept one, a warm one, or a new one)."""
        sandbox_id, host_path = await self.host.acquire.remote(trajectory, attempt, lifetime_s)
        return SandboxSession(self.host, self.service, sandbox_id, trajectory, attempt, host_path)

    def session(self, trajectory: Trajectory) -> SandboxSession | None:
        """The sandbox ``trajectory`` worked in (None: it had none from this service)."""
        ref = trajectory.metadata.get(METADATA_KEY)
        if not isinstance(ref, dict) or ref.get("service") != self.service:
            return None
        return SandboxSession(self.host, self.service, ref["id"], ref["trajectory"], ref["attempt"])

    async def finish(self, trajectories: list[Trajectory]) -> None:
        owners = [(s.trajectory, s.attempt) for t in trajectories if (s := self.session(t)) is not None]
        if owners:
            await self.host.release.remote(owners)


def sandbox_of(trajectory: Trajectory, ctx: RewardContext | None) -> SandboxSession | None:
    """For a reward that ``takes_context``: the sandbox ``trajectory`` worked in, through the
    context's services (None: it had none, the run has no sandbox service, or the reward was called
    without a context)."""
    ref = trajectory.metadata.get(METADATA_KEY)
    if not isinstance(ref, dict) or ctx is None:
        return None
    sandboxes = ctx.services.get(ref.get("service"))
    return sandboxes.session(trajectory) if isinstance(sandboxes, Sandboxes) else None


@dataclass
class SandboxService:
    """The run's sandbox pool (service ``sandboxes``): ``backend`` is a ``loongsage_sandboxes`` spec."""

    kind: ClassVar[str] = "service"

    backend: dict[str, Any] = field(default_factory=lambda: {"name": "local"})
    warm: int = ranged(0, ge=0, note="empty sandboxes kept ready")
    max_sandboxes: int = ranged(64, ge=1, note="sandboxes at once; acquirers beyond it wait")
    lifetime_s: float = ranged(3600.0, gt=0, note="a lease's deadline from its acquire")
    reuse: bool = True  # empty a released sandbox and hand it out again (backends that can)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, dict) or not isinstance(self.backend.get("name"), str):
            raise ValueError(
                f"sandboxes.backend={self.backend!r}: must be a mapping with 'name' "
                f"(a loongsage_sandboxes backend, e.g. local) and optional 'params'"
            )
        if self.warm > self.max_sandboxes or not math.isfinite(self.lifetime_s):
            raise ValueError(
                f"sandboxes: warm={self.warm} must be at most max_sandboxes={self.max_sandboxes} "
                f"and lifetime_s={self.lifetime_s} finite"
            )
        self._host: Any = None
        self._client: Sandboxes | None = None
        self._stats: dict[str, float] = {}

    async def start(self, ctx: Any) -> Sandboxes:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ctx.registry.check("sandbox", self.backend, "services.sandboxes.params.backend")
        pool = {
            "warm": self.warm,
            "max_sandboxes": self.max_sandboxes,
            "lifetime_s": self.lifetime_s,
            "reuse": self.reuse,
        }
        # on the driver's machine: the command agent runs its programs in the sandboxes' directories
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(SandboxHost).options(num_cpus=0, scheduling_strategy=here, max_concurrency=1000)
        self._host = actor.remote(self.backend, tuple(ctx.registry.extra_modules), ctx.run_dir.name or "run", pool)
        await self._host.start.remote()
        self._client = Sandboxes(self._host, SERVICE)
        return self._client

    def share(self) -> Sandboxes:
        return self._client

    async def finish(self, trajectories: list[Trajectory]) -> None:
        await self._client.finish(trajectories)
        self._stats = await self._host.stats.remote()

    def metrics(self) -> dict[str, float]:
        return dict(self._stats)

    async def stop(self) -> None:
        if self._host is None:
            return
        import ray

        try:
            await self._host.close.remote()
        finally:
            ray.kill(self._host)
            self._host = None
