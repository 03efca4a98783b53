"""Sandboxes ahead of need, one per owner, each until its deadline.

:class:`SandboxPool` wraps any :class:`~loongsage.core.contracts.Sandbox` backend:

* ``start()`` removes what dead runs left behind (the backend's ``reap_orphans``), then keeps
  ``warm`` empty sandboxes ready in the background;
* ``acquire(owner)`` hands out a warm sandbox (given to the owner with ``reset``) or creates one,
  never more than ``max_sandboxes`` at once (further callers wait); the same owner gets the same
  sandbox back while it holds one (a kept sandbox of a resumed trajectory, say);
* ``release(owner, keep=False)`` ends the lease: the sandbox is emptied and returned to the warm
  set when that set is short, the backend is ``reusable`` and ``reuse`` is on, otherwise deleted; ``keep=True`` keeps
  it for the owner (a partial rollout that will resume), still under its deadline;
* a lease past its deadline is deleted by the pool's reaper; ``close()`` deletes everything.

Every method may be cancelled at any point: bookkeeping changes happen without an await in
between, a sandbox in hand but not yet recorded is deleted in the background, and deletes and
resets run as tasks of the pool that ``close()`` waits for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from loongsage.core.contracts import Sandbox, SandboxOwner

log = logging.getLogger(__name__)


@dataclass
class Lease:
    sandbox_id: str
    deadline: float  # time.time() seconds
    kept: bool = False


class SandboxPool:
    def __init__(
        self,
        backend: Sandbox,
        *,
        run: str,
        warm: int = 0,
        max_sandboxes: int = 64,
        lifetime_s: float = 3600.0,
        reuse: bool = True,
    ):
        if not isinstance(run, str) or not run:
            raise ValueError(f"sandbox pool run={run!r}: must be a non-empty run id")
        if not isinstance(max_sandboxes, int) or max_sandboxes < 1:
            raise ValueError(f"sandbox pool max_sandboxes={max_sandboxes!r}: must be a positive integer")
        if not isinstance(warm, int) or not 0 <= warm <= max_sandboxes:
            raise ValueError(
                f"sandbox pool warm={warm!r}: must be an integer from 0 to max_sandboxes ({max_sandboxes})"
            )
        if not isinstance(lifetime_s, (int, float)) or not 0 < lifetime_s < math.inf:
            raise ValueError(f"sandbox pool lifetime_s={lifetime_s!r}: must be a positive finite number of seconds")
        self.backend, self.run, self.warm = backend, run, warm
        self.max_sandboxes, self.lifetime_s = max_sandboxes, float(lifetime_s)
        self.reuse = reuse and backend.reusable
        self.idle: deque[str] = deque()
        self.leases: dict[SandboxOwner, Lease] = {}
        self.reaped_orphans = 0
        self._idle_owner = SandboxOwner(run, "", 0)  # warm sandboxes belong to the run until handed out
        self._reserved = 0  # creations and resets under way (they count against max_sandboxes)
        self._making: set[SandboxOwner] = set()  # owners whose acquire is creating or resetting
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------------------ public
    @property
    def live(self) -> int:
        """Sandboxes of this pool: warm, leased, and being made or emptied."""
        return len(self.idle) + len(self.leases) + self._reserved

    async def start(self) -> None:
        if self.backend.reap_orphans is not None:
            self.reaped_orphans = await self.backend.reap_orphans()
            if self.reaped_orphans:
                log.info("removed %d orphaned sandboxes of dead runs", self.reaped_orphans)
        self._loops = [asyncio.ensure_future(self._fill()), asyncio.ensure_future(self._reap_expired())]

    async def acquire(self, owner: SandboxOwner, lifetime_s: float | None = None) -> str:
        """The sandbox of ``owner`` (its kept one, a warm one, or a new one), until ``lifetime_s``
        from now (the pool's ``lifetime_s`` by default)."""
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        if (lease := self.leases.get(owner)) is not None:
            lease.kept = False
            return lease.sandbox_id
        deadline = time.time() + (self.lifetime_s if lifetime_s is None else lifetime_s)
        async with self._changed:
            # one acquire per owner at a time: a second waits and then gets the first one's sandbox
            await self._changed.wait_for(
                lambda: (
                    self._closed
                    or owner not in self._making
                    and (owner in self.leases or self.idle or self.live < self.max_sandboxes)
                )
            )
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            if (lease := self.leases.get(owner)) is not None:
                return lease.sandbox_id
            sandbox_id = self.idle.popleft() if self.idle else None
            self._making.add(owner)
            self._reserved += 1
        try:
            if sandbox_id is not None and self.backend.reset is not None:
                await self.backend.reset(sandbox_id, owner, deadline)
            elif sandbox_id is None:
                sandbox_id = await self.backend.create(owner, deadline)
        except BaseException:
            if sandbox_id is not None:
                self._background(self.backend.delete(sandbox_id))
            self._making.discard(owner)
            self._reserved -= 1
            self._notify()
            raise
        self.leases[owner] = Lease(sandbox_id, deadline)  # no await since the sandbox was made
        self._making.discard(owner)
        self._reserved -= 1
        self._notify()
        return sandbox_id

    async def release(self, owner: SandboxOwner, keep: bool = False) -> None:
        """End ``owner``'s lease; ``keep``: hold the sandbox for the owner (a resume) instead."""
        lease = self.leases.get(owner)
        if lease is None:
            return
        if keep:
            lease.kept = True
            return
        del self.leases[owner]
        if self.reuse and not self._closed and len(self.idle) + self._reserved < self.warm:
            self._reserved += 1
            task = self._background(self._recycle(lease.sandbox_id))
        else:
            task = self._background(self.backend.delete(lease.sandbox_id))
        self._notify()
        await asyncio.shield(task)

    def owner_of(self, sandbox_id: str) -> SandboxOwner | None:
        return next((o for o, lease in self.leases.items() if lease.sandbox_id == sandbox_id), None)

    async def close(self) -> None:
        """Stop the pool and delete every sandbox it has (leased, kept or warm)."""
        self._closed = True
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        while self.idle:
            self._background(self.backend.delete(self.idle.popleft()))
        for owner in list(self.leases):
            self._background(self.backend.delete(self.leases.pop(owner).sandbox_id))
        self._notify()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---------------------------------------------------------------------------- internals
    async def _recycle(self, sandbox_id: str) -> None:
        try:
            await self.backend.reset(sandbox_id, self._idle_owner, time.time() + self.lifetime_s)
        except BaseException:
            await self.backend.delete(sandbox_id)
            raise
        finally:
            self._reserved -= 1
        if self._closed:
            await self.backend.delete(sandbox_id)
        else:
            self.idle.append(sandbox_id)
        self._notify()

    async def _fill(self) -> None:
        """Keep ``warm`` empty sandboxes ready."""
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: len(self.idle) + self._reserved < self.warm and self.live < self.max_sandboxes
                )
                self._reserved += 1
            sandbox_id = None
            try:
                sandbox_id = await self.backend.create(self._idle_owner, time.time() + self.lifetime_s)
            except asyncio.CancelledError:
                self._reserved -= 1
                raise
            except Exception as exc:  # a failing backend must not spin: wait, then try again
                log.warning("could not create a warm sandbox: %s", exc)
                self._reserved -= 1
                await asyncio.sleep(1.0)
                continue
            self._reserved -= 1
            self.idle.append(sandbox_id)
            self._notify()

    async def _reap_expired(self, period_s: float = 0.25) -> None:
        """Delete every lease (kept or not) and warm sandbox past its deadline."""
        idle_since: dict[str, float] = {}
        while True:
            now = time.time()
            for owner, lease in list(self.leases.items()):
                if lease.deadline <= now:
                    log.info("sandbox %s of %s passed its deadline: deleted", lease.sandbox_id, owner)
                    del self.leases[owner]
                    self._background(self.backend.delete(lease.sandbox_id))
            for sandbox_id in list(self.idle):
                if now - idle_since.setdefault(sandbox_id, now) >= self.lifetime_s:
                    self.idle.remove(sandbox_id)
                    self._background(self.backend.delete(sandbox_id))
            idle_since = {s: t for s, t in idle_since.items() if s in self.idle}
            self._notify()
            await asyncio.sleep(period_s)

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("sandbox cleanup failed: %s", task.exception())
        self._notify()

    def _notify(self) -> None:
        """Wake waiters of the condition (from synchronous code: the wake-up is its own small task)."""

        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.ensure_future(wake())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
