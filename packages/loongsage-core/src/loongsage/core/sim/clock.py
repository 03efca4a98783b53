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
from collections.abc import Coroutine
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


def run_simulated(main: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Run ``main`` to completion in simulated time; returns its result and the simulated seconds."""
    loop = SimulatedTimeLoop()
    try:
        result = loop.run_until_complete(main)
        return result, loop.time()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
