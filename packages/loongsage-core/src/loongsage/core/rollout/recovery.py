"""Engine recovery: a lost engine is replaced in its own placement bundle and given the current weights.

The router notices a lost engine (see :mod:`loongsage.core.rollout.router`) and calls
:meth:`EngineRecovery.engine_lost`. The replacement then goes through three stages:

1. started: its owner's ``restart(index, lost)`` kills what is left of the old actor and starts a new
   one with the same constructor arguments in the same bundle (in a worker thread, off the loop);
2. loaded: it must hold the weights of the version the other engines hold before anything is routed
   to it. Those weights are the trainer's own while the trainer is at rest (between a weight update
   and the next training batch), and only then: ``load(engine, version)`` pushes them to the
   replacement alone and sets its version (the others keep theirs). While the trainer trains, the
   replacement waits, and the weight update that ends the step takes it in with the other engines:
   :meth:`before_update` puts it in the engine list at the current version, so the update's push
   brings it to the new version with them;
3. routed: :meth:`EngineRouter.engine_replaced`; the requests that were waiting for it go.

A training batch is handed out only when no replacement is being loaded (:meth:`before_batch`), so
the trainer's weights never change under a push; nor does a checkpoint start under one
(:meth:`trainer_in_use`): with several trainer ranks both are collectives, which must run in the same
order on every rank. ``max_restarts`` bounds the replacements of a run:
the next loss fails the run with one line naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from loongsage.core.rollout.router import EngineRouter

log = logging.getLogger("loongsage")


@dataclass
class _Replacement:
    lost: Any  # the lost actor handle
    started: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    covered: bool = False  # taken in by a weight update (routed when the update ends)
    task: asyncio.Task | None = None


class EngineRecovery:
    """Replaces the engines the router loses; see the module docstring for the stages.

    ``restart(index, lost) -> handle`` and ``load(handle, version)`` are blocking calls of the owner
    (run in worker threads); ``on_error(exc)`` hears of a replacement that failed.
    """

    def __init__(
        self,
        router: EngineRouter,
        *,
        restart: Callable[[int, Any], Any],
        load: Callable[[Any, int], None],
        max_restarts: int,
        on_error: Callable[[BaseException], None],
    ):
        self.router, self._restart, self._load = router, restart, load
        self.max_restarts, self._on_error = int(max_restarts), on_error
        self.version = 0  # the version the engines hold
        self.training = False  # the trainer's weights may differ from the engines' (a batch is out)
        self.started = 0  # replacements started in this run
        self._loading = 0  # replacements being loaded from the trainer now
        self._replacing: dict[int, _Replacement] = {}
        self._changed: asyncio.Event | None = None
        router.on_engine_lost = self.engine_lost

    def _event(self) -> asyncio.Event:
        if self._changed is None:  # created on the running loop
            self._changed = asyncio.Event()
        return self._changed

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self._event().clear()
            await self._event().wait()

    def _notify(self) -> None:
        self._event().set()

    # ------------------------------------------------------------------ the router's side
    def engine_lost(self, index: int, lost: Any) -> None:
        if index in self._replacing:
            return
        if self.started >= self.max_restarts:
            self._fail(
                RuntimeError(
                    f"rollout: engine {index} was lost and rollout.max_engine_restarts={self.max_restarts} "
                    f"replacement(s) were made already; raise it (0 = a lost engine fails the run), or find in "
                    f"the engine actor's log why engines die"
                )
            )
            return
        self.started += 1
        rep = self._replacing[index] = _Replacement(lost)
        rep.task = asyncio.ensure_future(self._replace(index, rep))

    async def _replace(self, index: int, rep: _Replacement) -> None:
        try:
            engine = await asyncio.to_thread(self._restart, index, rep.lost)
            rep.started.set_result(engine)
            await self._until(lambda: rep.covered or not self.training)
            if rep.covered:  # the update in progress loads it; its end routes it
                return
            self._loading += 1
            try:
                await asyncio.to_thread(self._load, engine, self.version)
            finally:
                self._loading -= 1
                self._notify()
            del self._replacing[index]
            self.router.engine_replaced(index, engine)
            log.warning("rollout: engine %d replaced (version %d)", index, self.version)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the run fails with it
            if not rep.started.done():
                rep.started.set_exception(exc)
                rep.started.exception()  # retrieved: before_update may never ask
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.router.fail(exc)
        self._on_error(exc)

    # ------------------------------------------------------------------ the training loop's side
    async def before_batch(self) -> None:
        """A training batch is about to go out: wait for any replacement being loaded from the trainer."""
        await self._until(lambda: self._loading == 0)
        self.training = True

    async def before_update(self, version: int) -> None:
        """The weight push is next: every lost engine's replacement joins the engine list at ``version``
        (still not routed to), so the push reaches a live actor at every index and loads the
        replacements with the others."""
        self.version = version
        for index, rep in list(self._replacing.items()):
            engine = await rep.started
            if not rep.covered:
                await engine.set_version.remote(version)
                self.router.engines[index] = engine
                rep.covered = True
        self._notify()

    @contextlib.asynccontextmanager
    async def trainer_in_use(self) -> AsyncIterator[None]:
        """The trainer ranks are busy outside a step (a checkpoint): no replacement loads meanwhile."""
        await self._until(lambda: self._loading == 0)
        training, self.training = self.training, True
        try:
            yield
        finally:
            self.training = training
            self._notify()

    def after_update(self, version: int) -> None:
        """The engines hold ``version``, the trainer is at rest: replacements the update loaded are
        routed to, the others may load now."""
        self.version, self.training = version, False
        for index, rep in list(self._replacing.items()):
            if rep.covered:
                del self._replacing[index]
                self.router.engine_replaced(index, self.router.engines[index])
                log.warning("rollout: engine %d replaced (version %d, with the weight update)", index, version)
        self._notify()

    async def close(self) -> None:
        await self._until(lambda: self._loading == 0)  # a push in a worker thread cannot be cancelled
        tasks = [rep.task for rep in self._replacing.values() if rep.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
