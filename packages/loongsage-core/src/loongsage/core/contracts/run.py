"""The contracts of the backends that live as long as the run, in the driver.

The tracker (where every step's metrics go) and the run service (started with the run, reached by
agents as ``ctx.services`` and by rewards through its shared handle).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal, Protocol

from loongsage.core.types import Trajectory

TrackerArg = Literal["run_dir", "run_name", "config", "resume"]
"""What the framework can hand a tracker's factory (:attr:`Tracker.receives`)."""


class Tracker(Protocol):
    """A ``tracker`` backend: where every step's metrics go.

    Runs in the driver: ``log`` once per step (and per evaluation), ``close`` once at the end.
    Built with its params and the framework's arguments it ``receives``.
    """

    kind: ClassVar[Literal["tracker"]] = "tracker"
    receives: ClassVar[tuple[TrackerArg, ...]] = ()
    """The framework's arguments its factory is built with, besides its params (declared on the
    factory, read before it builds): ``run_dir`` (the run's folder), ``run_name``, ``config`` (the
    validated run config as a plain dict), ``resume`` (``checkpoint.resume``). A user may set none
    of these four as params."""
    preflight: ClassVar[Callable[..., None] | None] = None
    """Optional classmethod ``preflight(params)``, run at config validation; raises ``ValueError``
    with a one-line reason (a missing optional package)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class RunService(Protocol):
    """A ``service`` backend: lives as long as the run and is reached by agents (the chat gateway).

    Runs in the driver, on the event loop that runs the rollout (see :mod:`loongsage.core.services`):
    ``start`` once when the run starts, after the engines, ``stop`` once when it ends (also after an
    error). What ``start`` returns is what agents get as ``ctx.services[<name>]``.
    """

    kind: ClassVar[Literal["service"]] = "service"
    metrics: ClassVar[Callable[[], dict[str, float]] | None] = None
    """Optional method ``metrics()``: the service's counters, added to every step's metrics."""
    share: ClassVar[Callable[[], Any] | None] = None
    """Optional method ``share()``, called once after ``start``: a picklable handle for the run's
    other processes; rewards get it as ``ctx.services[<name>]`` (:class:`RewardContext`)."""
    finish: ClassVar[Callable[[list[Trajectory]], Awaitable[None]] | None] = None
    """Optional ``async finish(trajectories)``: the rollout is done with these trajectories (scored,
    or their scoring failed): free what they held (their sandboxes)."""

    async def start(self, ctx: Any) -> Any: ...

    async def stop(self) -> None: ...
