"""Run-scoped services: things that live as long as a run and that agents reach (the chat gateway).

A service is a ``service`` backend (``loongsage_backends``, :class:`~loongsage.core.contracts.RunService`)
named in the config's ``services`` list. The controller starts every service after the engines and
the rollout service exist, on the event loop that runs the rollout, in list order; each ``start``
gets a :class:`ServiceContext` (the engine router, the tokenizer, the registry, ...) and returns
the handle agents see as ``ctx.services[<name>]``. Services stop in reverse order when the run
ends, also when it fails. A new kind of service needs a plugin, never a change to the controller.

Two optional methods reach beyond agents. ``share()`` gives a picklable handle that the reward
worker (another process) hands to rewards taking a context (``ctx.services[<name>]``), and
``finish(trajectories)`` runs once the rollout is done with a batch of trajectories (every reward
returned): the sandbox service frees the sandboxes they worked in there, after their rewards ran
tests in them.

Because services share the rollout's event loop, a service may call the engine router directly:
requests it sends wait while a weight update holds generation and, under an asynchronous
scheduler, are cut at the update and continued on the new weights like any agent's.

``loongsage serve`` (:mod:`loongsage.core.serving`) starts the same services over engines alone,
for agents outside a training run; their context then carries :class:`Serving` (else ``None``):
the port and host to listen on, where to record, and lists a service fills with what the user is
told at start (where clients point) and at stop (what it recorded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("loongsage")


@dataclass
class Serving:
    """What ``loongsage serve`` asks of the services it starts (the chat gateway uses it)."""

    record_dir: Path  # where served sessions are written as they go
    port: int = 0  # 0: a free port
    host: str | None = None  # None: the service's own (loopback by default)
    lines: list[str] = field(default_factory=list)  # filled by start: printed once every service started
    summary: list[str] = field(default_factory=list)  # filled by stop: joined into the last line


@dataclass
class ServiceContext:
    """What a service may use when it starts."""

    engine: Any  # the engine router: async generate(input_ids, sampling, session), release_session(session)
    tokenizer: Any
    model_path: str
    run_dir: Path
    registry: Any  # creates other plugins (a chat parser, middlewares) by name
    seed: int
    serving: Serving | None = None  # set by `loongsage serve` only


class RunServices:
    """The run's services, started in order and stopped in reverse (each stop on its own)."""

    def __init__(self, specs: list[dict[str, Any]], registry: Any):
        self.entries = [
            (spec["name"], registry.create("service", spec, f"services.{i}")) for i, spec in enumerate(specs)
        ]
        self.handles: dict[str, Any] = {}
        self.shared: dict[str, Any] = {}  # share() of the services that have it: for rewards
        self._started: list[tuple[str, Any]] = []

    async def start(self, ctx: ServiceContext) -> dict[str, Any]:
        """Start every service; returns ``{name: handle}`` (what agents get as ``ctx.services``)."""
        for name, service in self.entries:
            self.handles[name] = await service.start(ctx)
            self._started.append((name, service))
            if service.share is not None:
                self.shared[name] = service.share()
            log.info("service %s started", name)
        return self.handles

    async def finish(self, trajectories: list[Any]) -> None:
        """Tell every service with ``finish`` that the rollout is done with ``trajectories``."""
        for _, service in self._started:
            if service.finish is not None:
                await service.finish(trajectories)

    async def stop(self) -> None:
        """Stop what was started, newest first; a service that fails to stop is logged, and the
        others still stop."""
        while self._started:
            name, service = self._started.pop()
            try:
                await service.stop()
            except Exception as exc:  # noqa: BLE001 - the run's own outcome is what propagates
                log.warning("service %s did not stop cleanly: %s: %s", name, type(exc).__name__, exc)
        self.handles.clear()
        self.shared.clear()

    def metrics(self) -> dict[str, float]:
        """Every started service's counters (a service without ``metrics`` has none)."""
        out: dict[str, float] = {}
        for _, service in self._started:
            if service.metrics is not None:
                out.update(service.metrics())
        return out
