"""What the gateway generates with: anything with the engine router's interface.

In a run the gateway sits on the rollout service's :class:`~loongsage.core.rollout.EngineRouter`
(least-loaded, sticky per session, partial rollout across weight updates, failover): it already
has ``async generate(input_ids, sampling, session)``. :class:`DirectEngine` gives an engine object
in this process (the embedded :class:`~loongsage.core.engine.native.NativeEngine`, say) the same
interface, for a gateway without Ray.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

from loongsage.core.types import GenerationRequest, GenerationResult, SamplingParams


class EngineClient(Protocol):
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> list[GenerationResult]:
        """The ``sampling.n`` samples of one prompt; a bad request raises ``ValueError``."""
        ...

    def release_session(self, session: str) -> None:
        """The session is over (a router forgets which engine held it)."""
        ...


class DirectEngine:
    """An engine of this process behind the router's interface (one engine, no stickiness to keep).

    The engine must be awaited on one event loop: the gateway's.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._ids = itertools.count()

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> list[GenerationResult]:
        request = GenerationRequest(f"gw-{next(self._ids)}", list(input_ids), sampling)
        return await self.engine.generate(request)

    def release_session(self, session: str) -> None:
        pass
