"""An asyncio event loop in simulated time.

:class:`SimulatedTimeLoop` runs ordinary asyncio code (``sleep``, ``wait_for``, timeouts, timers)
unchanged, but whenever nothing is ready to run it moves its clock straight to the next timer
instead of waiting for it. A run whose engines "take" an hour of generation then takes as long as
its Python work does, and ``loop.time()`` reads the simulated seconds.

It serves programs without real I/O: a loop with nothing ready and no timer would wait forever
and raises ``SimulationStalled`` instead (the program under test deadlocked).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing can ever run again: no callback is ready and no timer is set."""


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that answers a wait of ``timeout`` seconds by advancing the loop's clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)  # the loop's own wake-up pipe, if anything wrote to it
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled("simulation stalled: no callback is ready and no timer is set")
        self.now += timeout
        return []


class SimulatedTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is simulated and jumps to the next timer when idle."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(selector=self._jumping)

    def time(self) -> float:
        return self._jumping.now

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        """Run ``func`` at once, on the loop's thread (``asyncio.to_thread`` included): a worker thread's
        time is real, and the clock would jump past it; inline, its work takes no simulated time and
        the run stays deterministic. A function that waits on the loop itself would block here."""
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as exc:  # noqa: BLE001 - the awaiting caller sees it, as from a thread
            future.set_exception(exc)
        return future


def run_simulated(main: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Run ``main`` to completion in simulated time; returns its result and the simulated seconds.
    Tasks still pending then (a call to a silenced engine, say) are cancelled, as ``asyncio.run`` does."""
    loop = SimulatedTimeLoop()
    try:
        result = loop.run_until_complete(main)
        return result, loop.time()
    finally:
        loop.set_exception_handler(_quiet_about_abandoned_answers)
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _quiet_about_abandoned_answers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Once the run is over, an engine's answer that its caller, cancelled with the rest, never read
    is no error; anything else is reported as usual."""
    if context.get("message") != "Task exception was never retrieved":
        loop.default_exception_handler(context)
