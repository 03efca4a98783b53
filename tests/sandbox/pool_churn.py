"""Many leases through a real :class:`SandboxPool` over the real ``local`` backend at once, a share
of them cancelled at chosen points, with a record of each: what the scale test asserts on and the
``sandbox_pool_scale`` benchmark reports.

Every lease is a distinct owner (100 trajectories x attempts). All leases call ``acquire`` together
(in arrival order, one event-loop step apart), run one short real command (``echo`` its name, then
``sleep``) and release. A cancelled lease is cancelled at one of: before its acquire ran, while its
acquire waits (or makes its sandbox), during its command, during its release; where it landed is
recorded. A sampler checks the cap against the pool's count and the sandbox directories on disk.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loongsage.core.contracts import SandboxOwner
from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.pool import SandboxPool

STAGES = ("before acquire", "acquire", "command", "release")


@dataclass
class Lease:
    rank: int  # arrival order: the order of the acquire calls
    cancel_at: str | None  # the stage it is to be cancelled in (None: it runs to its end)
    stage: str = "before acquire"
    called: float | None = None  # monotonic seconds: acquire called, returned, release returned
    granted: float | None = None
    released: float | None = None
    began: int | None = None  # its place in the order the pool began making sandboxes for owners
    began_at: float | None = None  # monotonic seconds: when that began (the pool handed it room)
    landed: str | None = None  # the stage a cancellation landed in
    error: str | None = None


@dataclass
class Churn:
    leases: list[Lease]
    cap: int
    command_s: float
    wall_s: float
    cpu_s: float  # this process: the pool, the backend, the event loop
    children_cpu_s: float  # the jails' processes
    max_live: int  # the largest pool.live seen
    max_dirs: int  # the most sandbox directories seen on disk at once
    samples: int
    tables_after_leases: dict
    tables_after_close: dict
    backend_after_close: int
    notes: dict = field(default_factory=dict)

    @property
    def served(self) -> list[Lease]:
        """Leases whose acquire returned (cancelled later or not)."""
        return [lease for lease in self.leases if lease.granted is not None]

    @property
    def completed(self) -> list[Lease]:
        return [lease for lease in self.leases if lease.released is not None and lease.landed is None]

    def waits(self) -> list[float]:
        return [lease.granted - lease.called for lease in self.served]

    def overtaken(self) -> int:
        """Leases whose sandbox the pool began to make after that of a lease that called acquire
        later (0: first come, first served)."""
        count, latest = 0, -1
        for lease in sorted((x for x in self.leases if x.began is not None), key=lambda x: x.began):
            count += lease.rank < latest
            latest = max(latest, lease.rank)
        return count

    def wait_bound_excess(self, slack_s: float) -> list[tuple[int, float, float]]:
        """Leases that waited for room longer than first-come-first-served allows. All leases
        arrive at once, so until the pool hands a lease room, every sandbox is busy with leases
        that arrived before it: its wait is at most their sandbox-time spread over ``cap``
        sandboxes (Graham's bound for list scheduling). ``slack_s`` covers the sandbox-time the
        leases do not show (the warm set's first creations, deletes that outlive a cancelled
        release). ``(rank, wait, bound)`` of each lease over it."""
        ahead, over = 0.0, []
        for lease in sorted(self.leases, key=lambda x: x.rank):
            if lease.began_at is None:
                continue
            bound = ahead / self.cap + slack_s
            if lease.began_at - lease.called > bound:
                over.append((lease.rank, lease.began_at - lease.called, bound))
            ahead += lease_time(lease)
        return over

    def summary(self) -> dict:
        waits = sorted(self.waits())
        queue = sorted(x.began_at - x.called for x in self.leases if x.began_at is not None)
        n = len(self.leases)
        return {
            "leases": n,
            "cap": self.cap,
            "completed": len(self.completed),
            "cancelled": sum(lease.landed is not None for lease in self.leases),
            "cancelled_in": dict(Counter(lease.landed for lease in self.leases if lease.landed)),
            "failed": sum(lease.error is not None for lease in self.leases),
            "wall_s": self.wall_s,
            "leases_per_s": n / self.wall_s,
            "cpu_ms_per_lease": 1000 * self.cpu_s / n,
            "children_cpu_ms_per_lease": 1000 * self.children_cpu_s / n,
            "wait_s": {"p50": pct(waits, 0.50), "p99": pct(waits, 0.99), "max": waits[-1] if waits else 0.0},
            "lease_s_mean": statistics.fmean(lease_time(x) for x in self.served) if self.served else 0.0,
            "queue_wait_s": {"p50": pct(queue, 0.50), "p99": pct(queue, 0.99)},
            "overtaken": self.overtaken(),
            "max_live": self.max_live,
            "max_dirs_on_disk": self.max_dirs,
        }


class MakeOrder:
    """The real backend, recording the order in which the pool begins making (creating or
    resetting) a sandbox for each owner: the order it handed out room."""

    def __init__(self, backend: LocalSandbox):
        self.backend = backend
        self.order: list[tuple[SandboxOwner, float]] = []

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    async def create(self, owner: SandboxOwner, deadline: float) -> str:
        self.order.append((owner, time.monotonic()))
        return await self.backend.create(owner, deadline)

    async def reset(self, sandbox_id: str, owner: SandboxOwner, deadline: float) -> None:
        self.order.append((owner, time.monotonic()))
        await self.backend.reset(sandbox_id, owner, deadline)


def lease_time(lease: Lease) -> float:
    """How long a lease held room: from the pool handing it room (its sandbox then made) to its
    release's return (or its cancellation)."""
    if lease.began_at is None:
        return 0.0
    return max(0.0, (lease.released or lease.granted or lease.began_at) - lease.began_at)


def pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def pool_tables(pool: SandboxPool) -> dict:
    """The pool's bookkeeping, all zero or empty when nothing is leased or under way."""
    return {
        "leases": len(pool.leases),
        "reserved": pool._reserved,
        "making": len(pool._making),
        "waiting": pool.waiting,
        "deleting": pool._deleting,
        "tasks": len([t for t in pool._tasks if not t.done()]),
    }


def sandbox_dirs(root: Path) -> int:
    with os.scandir(root) as entries:
        return sum(entry.name.startswith("sbx-") for entry in entries)


async def churn(
    root: Path,
    limits,
    leases: int = 1000,
    cap: int = 16,
    warm: int = 4,
    command_s: float = 0.2,
    cancel_share: float = 0.25,
    seed: int = 0,
) -> Churn:
    rng = random.Random(seed)
    plan = [Lease(i, rng.choice(STAGES) if rng.random() < cancel_share else None) for i in range(leases)]
    sb = LocalSandbox(limits, str(root))
    made = MakeOrder(sb)
    pool = SandboxPool(made, run="run-churn", warm=warm, max_sandboxes=cap)
    await pool.start()
    seen = {"live": 0, "dirs": 0, "samples": 0}

    def sample() -> None:
        seen["live"] = max(seen["live"], pool.live)
        seen["dirs"] = max(seen["dirs"], sandbox_dirs(root))
        seen["samples"] += 1

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(0.01)

    async def run_lease(lease: Lease) -> None:
        owner = SandboxOwner("run-churn", f"traj-{lease.rank % 100}", lease.rank // 100)
        me = asyncio.current_task()
        try:
            lease.stage, lease.called = "acquire", time.monotonic()
            if lease.cancel_at == "acquire":  # at a random point of its wait: ranks far back wait longest
                later = rng.uniform(0, 1.5 * command_s * (1 + lease.rank / cap))
                asyncio.get_running_loop().call_later(later, cancel_in, me, lease, "acquire")
            sandbox_id = await pool.acquire(owner)
            lease.granted = time.monotonic()
            sample()
            lease.stage = "command"
            if lease.cancel_at == "command":
                asyncio.get_running_loop().call_later(rng.uniform(0, command_s), cancel_in, me, lease, "command")
            result = await sb.exec(sandbox_id, f"echo lease-{lease.rank}; sleep {command_s}", 30)
            if (result.exit_code, result.stdout) != (0, f"lease-{lease.rank}\n"):
                lease.error = f"command: {result}"
            lease.stage = "release"
            if lease.cancel_at == "release":
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.005), cancel_in, me, lease, "release")
            await pool.release(owner)
            lease.released = time.monotonic()
            lease.stage = "done"
        except asyncio.CancelledError:
            lease.landed = lease.stage
            if lease.stage == "command":  # a cancelled agent gives its sandbox back (the service's rule)
                await pool.release(owner)
            lease.released = time.monotonic()  # the end of its hold, if it held room
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: the test asserts there are none
            lease.error = f"{type(exc).__name__}: {exc}"

    cpu0, children0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    watch = asyncio.ensure_future(sampler())
    tasks = []
    for lease in plan:
        task = asyncio.ensure_future(run_lease(lease))
        tasks.append(task)
        if lease.cancel_at == "before acquire":
            task.cancel()  # before its first step: it never calls acquire
            lease.landed = "before acquire"
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.monotonic() - start
    # what was let go in the background (deletes, resets of cancelled leases) ends on its own
    end = time.monotonic() + 30
    while any(pool_tables(pool)[k] for k in ("reserved", "making", "deleting")) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    after_leases = pool_tables(pool) | {"idle": len(pool.idle)}
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    await pool.close()
    await sb.close()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = {SandboxOwner("run-churn", f"traj-{x.rank % 100}", x.rank // 100): x for x in plan}
    for place, (owner, at) in enumerate(made.order):
        if owner in ranks and ranks[owner].began is None:
            ranks[owner].began, ranks[owner].began_at = place, at
    return Churn(
        leases=plan,
        cap=cap,
        command_s=command_s,
        wall_s=wall,
        cpu_s=time.process_time() - cpu0,
        children_cpu_s=(children.ru_utime + children.ru_stime) - (children0.ru_utime + children0.ru_stime),
        max_live=seen["live"],
        max_dirs=seen["dirs"],
        samples=seen["samples"],
        tables_after_leases=after_leases,
        tables_after_close=pool_tables(pool) | {"idle": len(pool.idle)},
        backend_after_close=len(sb.sandbox_ids()),
    )


def cancel_in(task: asyncio.Task, lease: Lease, stage: str) -> None:
    """Cancel ``task`` if its lease is still in ``stage`` (past it, the lease runs to its end)."""
    if lease.stage == stage:
        task.cancel()
