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

Acquires that find no room wait in one queue and get room first come, first served: room freed
is handed to the oldest waiter at once (an acquire arriving meanwhile does not overtake it), at a
constant cost per hand-over however many wait. A sandbox being deleted still counts against
``max_sandboxes`` until its delete ends: it still exists (its directory, its container).

Every method may be cancelled at any point: bookkeeping changes happen without an await in
between, a sandbox in hand but not yet recorded is deleted in the background, room handed to an
acquire cancelled in the same moment goes back to the queue, and deletes and resets run as tasks
of the pool that ``close()`` waits for.
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
        self._deleting = 0  # deletes under way (so do they: the sandbox exists until its delete ends)
        # owners with an acquire under way (waiting, creating or resetting): done when it ends
        self._making: dict[SandboxOwner, asyncio.Future] = {}
        # acquires waiting for room, oldest first; each future gets the room handed to it (a warm
        # sandbox's id, or None: create one). One cancelled while waiting is skipped when reached:
        # removing it at once would scan the queue, as waking every waiter on every change would
        self._queue: deque[asyncio.Future] = deque()
        self._filler = asyncio.Event()  # set when the warm set may need filling
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------------------ public
    @property
    def live(self) -> int:
        """Sandboxes of this pool: warm, leased, and being made, emptied or deleted."""
        return len(self.idle) + len(self.leases) + self._reserved + self._deleting

    @property
    def waiting(self) -> int:
        """Acquires waiting for room (a count over the queue: for metrics and tests)."""
        return sum(not waiter.done() for waiter in self._queue)

    async def start(self) -> None:
        if self.backend.reap_orphans is not None:
            self.reaped_orphans = await self.backend.reap_orphans()
            if self.reaped_orphans:
                log.info("removed %d orphaned sandboxes of dead runs", self.reaped_orphans)
        self._loops = [asyncio.ensure_future(self._fill()), asyncio.ensure_future(self._reap_expired())]

    async def acquire(self, owner: SandboxOwner, lifetime_s: float | None = None) -> str:
        """The sandbox of ``owner`` (its kept one, a warm one, or a new one), until ``lifetime_s``
        from now (the pool's ``lifetime_s`` by default)."""
        deadline = time.time() + (self.lifetime_s if lifetime_s is None else lifetime_s)
        while True:
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            if (lease := self.leases.get(owner)) is not None:
                lease.kept = False
                return lease.sandbox_id
            if (making := self._making.get(owner)) is None:
                break
            # one acquire per owner at a time: a second waits, then gets the first one's sandbox
            await asyncio.wait({making})
        self._making[owner] = done = asyncio.get_running_loop().create_future()
        try:
            return await self._make(owner, deadline)
        finally:
            del self._making[owner]
            done.set_result(None)

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
            task = self._delete(lease.sandbox_id)
        await asyncio.shield(task)

    def owner_of(self, sandbox_id: str) -> SandboxOwner | None:
        return next((o for o, lease in self.leases.items() if lease.sandbox_id == sandbox_id), None)

    async def close(self) -> None:
        """Stop the pool and delete every sandbox it has (leased, kept or warm)."""
        self._closed = True
        self._grant()  # fails the waiting acquires
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        while self.idle:
            self._delete(self.idle.popleft())
        for owner in list(self.leases):
            self._delete(self.leases.pop(owner).sandbox_id)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---------------------------------------------------------------------------- internals
    async def _make(self, owner: SandboxOwner, deadline: float) -> str:
        """Room (first come, first served), then the sandbox: a warm one reset for ``owner``, or a new one."""
        while self._queue and self._queue[0].done():  # cancelled waiters at the head
            self._queue.popleft()
        if not self._queue and self._has_room():
            sandbox_id = self._take_room()
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._queue.append(waiter)
            try:
                sandbox_id = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # room was handed over as it was cancelled
                    self._return_room(waiter.result())
                raise
        try:
            if sandbox_id is not None and self.backend.reset is not None:
                await self.backend.reset(sandbox_id, owner, deadline)
            elif sandbox_id is None:
                sandbox_id = await self.backend.create(owner, deadline)
        except BaseException:
            if sandbox_id is not None:
                self._delete(sandbox_id)
            self._reserved -= 1
            self._grant()
            raise
        self._reserved -= 1  # no await from here: the sandbox is recorded, or deleted
        if self._closed:
            self._delete(sandbox_id)
            raise RuntimeError("sandbox pool is closed")
        self.leases[owner] = Lease(sandbox_id, deadline)
        self._grant()  # the warm set may be short now that the sandbox is out of it
        return sandbox_id

    def _has_room(self) -> bool:
        return bool(self.idle) or self.live < self.max_sandboxes

    def _take_room(self) -> str | None:
        """Reserve room for one acquire: a warm sandbox's id, or None (a new one may be created)."""
        self._reserved += 1
        return self.idle.popleft() if self.idle else None

    def _return_room(self, sandbox_id: str | None) -> None:
        self._reserved -= 1
        if sandbox_id is not None:
            self.idle.appendleft(sandbox_id)
        self._grant()

    def _grant(self) -> None:
        """Hand the room there is to the waiting acquires, oldest first, then let the warm-set
        filler look (called on every change of the counts: constant work per hand-over, nothing
        per waiter left waiting)."""
        while self._queue and (self._closed or self._has_room()):
            waiter = self._queue.popleft()
            if waiter.done():
                continue  # cancelled while it waited
            if self._closed:
                waiter.set_exception(RuntimeError("sandbox pool is closed"))
            else:
                waiter.set_result(self._take_room())
        self._filler.set()

    async def _recycle(self, sandbox_id: str) -> None:
        try:
            await self.backend.reset(sandbox_id, self._idle_owner, time.time() + self.lifetime_s)
        except BaseException:
            self._delete(sandbox_id)
            self._reserved -= 1
            raise
        self._reserved -= 1
        if self._closed:
            self._delete(sandbox_id)
        else:
            self.idle.append(sandbox_id)
            self._grant()

    async def _fill(self) -> None:
        """Keep ``warm`` empty sandboxes ready (room goes to waiting acquires first: ``_grant``
        hands it over before this loop runs again)."""
        while True:
            while not (len(self.idle) + self._reserved < self.warm and self.live < self.max_sandboxes):
                self._filler.clear()
                await self._filler.wait()
            self._reserved += 1
            try:
                sandbox_id = await self.backend.create(self._idle_owner, time.time() + self.lifetime_s)
            except asyncio.CancelledError:
                self._reserved -= 1
                raise
            except Exception as exc:  # a failing backend must not spin: wait, then try again
                log.warning("could not create a warm sandbox: %s", exc)
                self._reserved -= 1
                self._grant()
                await asyncio.sleep(1.0)
                continue
            self._reserved -= 1
            self.idle.append(sandbox_id)
            self._grant()

    async def _reap_expired(self, period_s: float = 0.25) -> None:
        """Delete every lease (kept or not) and warm sandbox past its deadline."""
        idle_since: dict[str, float] = {}
        while True:
            now = time.time()
            for owner, lease in list(self.leases.items()):
                if lease.deadline <= now:
                    log.info("sandbox %s of %s passed its deadline: deleted", lease.sandbox_id, owner)
                    del self.leases[owner]
                    self._delete(lease.sandbox_id)
            for sandbox_id in list(self.idle):
                if now - idle_since.setdefault(sandbox_id, now) >= self.lifetime_s:
                    self.idle.remove(sandbox_id)
                    self._delete(sandbox_id)
            warm = set(self.idle)
            idle_since = {s: t for s, t in idle_since.items() if s in warm}
            await asyncio.sleep(period_s)

    def _delete(self, sandbox_id: str) -> asyncio.Task:
        """Delete in the background; the sandbox counts against ``max_sandboxes`` until it is gone."""
        self._deleting += 1
        task = self._background(self.backend.delete(sandbox_id))
        task.add_done_callback(self._deleted)
        return task

    def _deleted(self, task: asyncio.Task) -> None:
        self._deleting -= 1
        self._grant()

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("sandbox cleanup failed: %s", task.exception())
