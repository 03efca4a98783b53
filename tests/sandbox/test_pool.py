"""The pool's lifecycle against the real ``local`` backend: warm sandboxes, per-owner leases,
reuse with an emptied work directory, keeping one for a resume, deadlines, the cap, and a soak of
episodes cancelled at random points that must leave nothing behind.

``LOONGSAGE_SANDBOX_SOAK`` sets the soak's number of episodes (60 by default),
``LOONGSAGE_SANDBOX_SOAK_SEED`` its random seed (0).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.pool import SandboxPool
from tests.sandbox.conftest import SMALL, leftovers, needs_jail, owner, run, sandbox_processes

pytestmark = needs_jail
SOAK_EPISODES = int(os.environ.get("LOONGSAGE_SANDBOX_SOAK", "60"))
SOAK_SEED = int(os.environ.get("LOONGSAGE_SANDBOX_SOAK_SEED", "0"))


async def wait_for(predicate, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_warm_reuse_keep_and_close(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        pool = SandboxPool(sb, run="run-test", warm=1, max_sandboxes=1)  # one sandbox: reuse is certain
        try:
            await pool.start()
            await wait_for(lambda: len(pool.idle) == 1)
            warm = set(pool.idle)
            a = await pool.acquire(owner("a"))
            assert a in warm and await pool.acquire(owner("a")) == a  # the same owner, the same sandbox
            assert sb.store.read_marker(a).owner == owner("a")
            await sb.put(a, "state.txt", b"a's")
            await pool.release(owner("a"), keep=True)  # kept for a resume: files and all
            assert await pool.acquire(owner("a")) == a and await sb.get(a, "state.txt") == b"a's"
            await pool.release(owner("a"))
            await wait_for(lambda: a in pool.idle)  # reused: back in the warm set, emptied
            assert (await sb.exec(a, "ls -A", 5)).stdout == ""
            assert sb.store.read_marker(a).trajectory == ""
            assert await pool.acquire(owner("b")) == a and sb.store.read_marker(a).owner == owner("b")
        finally:
            await pool.close()
            await sb.close()
        assert not pool.leases and not pool.idle and not sb.sandbox_ids()

    run(go())


def test_deadline_and_cap(root):
    async def go():
        sb = LocalSandbox(SMALL, str(root))
        pool = SandboxPool(sb, run="run-test", warm=0, max_sandboxes=2, reuse=False)
        try:
            await pool.start()
            short = await pool.acquire(owner("short"), lifetime_s=0.3)
            running = asyncio.ensure_future(sb.exec(short, "sleep 30", 60))
            await pool.acquire(owner("second"))
            third = asyncio.ensure_future(pool.acquire(owner("third")))  # waits: two are live
            await asyncio.sleep(0.1)
            assert not third.done()
            result = await asyncio.wait_for(running, 10)  # the deadline deleted it, its command with it
            assert result.error and "deleted" in result.error
            assert owner("short") not in pool.leases
            await asyncio.wait_for(third, 10)  # the deleted one made room
            assert not [p for p, uid in sandbox_processes()]
        finally:
            await pool.close()
            await sb.close()

    run(go())


def test_bad_pool_settings():
    class Fake:
        reusable = False

    with pytest.raises(ValueError, match="warm=5: must be an integer from 0 to max_sandboxes"):
        SandboxPool(Fake(), run="r", warm=5, max_sandboxes=2)
    with pytest.raises(ValueError, match="run=''"):
        SandboxPool(Fake(), run="")


async def episode(
    pool: SandboxPool, sb: LocalSandbox, i: int, rng: random.Random, locks: dict[int, asyncio.Lock]
) -> None:
    """One trajectory's use of a sandbox; trajectories repeat, so a kept sandbox is resumed later
    (one episode of a trajectory at a time, as a rollout runs them)."""
    lock = locks.setdefault(i % 7, asyncio.Lock())
    try:
        await lock.acquire()
    except asyncio.CancelledError:
        STAGES["waiting its turn"] = STAGES.get("waiting its turn", 0) + 1
        raise
    try:
        await use(pool, sb, owner(f"traj-{i % 7}"), rng)
    finally:
        lock.release()


STAGES: dict[str, int] = {}  # where the soak's cancellations landed


async def use(pool: SandboxPool, sb: LocalSandbox, who, rng: random.Random) -> None:
    stage = "acquire"
    try:
        sandbox_id = await pool.acquire(who)
        stage = "exec"
        cmd = rng.choice(
            [
                "true",
                "echo hi > out.txt; cat out.txt",
                "sleep 0.2",
                "setsid sleep 30 & sleep 0.1",
                "yes | head -c 300000",
                "f(){ f | f & }; f",
            ]
        )
        await sb.exec(sandbox_id, cmd, rng.choice([0.2, 1.0]))
        stage = "put/get"
        await sb.put(sandbox_id, "in/data.bin", os.urandom(1024))
        await sb.get(sandbox_id, "in/data.bin")
        stage = "release"
        await pool.release(who, keep=rng.random() < 0.2)
    except asyncio.CancelledError:
        STAGES[stage] = STAGES.get(stage, 0) + 1
        raise


async def soak(root, episodes: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    STAGES.clear()
    sb = LocalSandbox(SMALL, str(root))
    pool = SandboxPool(sb, run="run-soak", warm=2, max_sandboxes=6)
    await pool.start()
    stats = {"episodes": episodes, "cancelled": 0, "finished": 0, "failed": 0}
    start = time.monotonic()
    pending: set[asyncio.Task] = set()
    locks: dict[int, asyncio.Lock] = {}
    for i in range(episodes):
        task = asyncio.ensure_future(episode(pool, sb, i, rng, locks))
        pending.add(task)
        if rng.random() < 0.6:  # cancel this one at a random point of its life
            when = rng.expovariate(1 / 0.03) if rng.random() < 0.5 else rng.uniform(0, 1.2)  # early, or anywhere
            asyncio.get_running_loop().call_later(when, task.cancel)
        if len(pending) >= 4:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            tally(done, stats)
    done, _ = await asyncio.wait(pending) if pending else (set(), set())
    tally(done, stats)
    in_use = {"leases": len(pool.leases), "idle": len(pool.idle)}
    await pool.close()
    await sb.close()
    stats.update(
        in_use_before_close=in_use,
        cancelled_in=dict(STAGES),
        seconds=round(time.monotonic() - start, 1),
        pool_after_close={"leases": len(pool.leases), "idle": len(pool.idle), "reserved": pool._reserved},
        backend_after_close=len(sb.sandbox_ids()),
    )
    return stats


def tally(done, stats) -> None:
    for task in done:
        if task.cancelled():
            stats["cancelled"] += 1
        elif task.exception() is not None:
            stats["failed"] += 1
            stats.setdefault("errors", []).append(repr(task.exception()))
        else:
            stats["finished"] += 1


def test_cancellation_soak(root):
    stats = run(soak(root, SOAK_EPISODES, SOAK_SEED))
    print("soak", stats)
    assert stats["failed"] == 0, stats
    assert stats["cancelled"] > 0 and stats["finished"] > 0, stats
    assert stats["pool_after_close"] == {"leases": 0, "idle": 0, "reserved": 0} and stats["backend_after_close"] == 0
    left = leftovers(root)
    assert not any(left.values()), left  # again in the root fixture, after a grace period
