"""The engine router: least-loaded routing over engine replicas, sticky per session, one actor call per
replica per event-loop tick."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from loongsage.core.types import GenerationRequest, GenerationResult, SamplingParams


class EngineRouter:
    """Least-loaded routing over engine actor handles; sticky per session id.

    Requests made in the same event-loop tick are sent to an engine in ONE actor call, so the engine
    sees them together and batches them, and a step of many prompts costs one round trip per engine.
    """

    def __init__(self, engines: list[Any]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = engines
        self.in_flight = [0] * len(engines)
        self._sticky: dict[str, int] = {}
        self._ids = itertools.count()
        self._pending: dict[int, list[tuple[GenerationRequest, asyncio.Future]]] = {}

    def pick(self, session: str | None = None) -> int:
        if session is not None and session in self._sticky:
            return self._sticky[session]
        index = min(range(len(self.engines)), key=lambda i: self.in_flight[i])
        if session is not None:
            self._sticky[session] = index
        return index

    def release_session(self, session: str) -> None:
        self._sticky.pop(session, None)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, session: str | None = None) -> list[GenerationResult]:
        index = self.pick(session)
        request = GenerationRequest(request_id=f"r{next(self._ids)}", input_ids=input_ids, sampling=sampling)
        future = asyncio.get_running_loop().create_future()
        if index not in self._pending:
            self._pending[index] = []
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush(index)))
        self._pending[index].append((request, future))
        self.in_flight[index] += 1
        try:
            return await future
        finally:
            self.in_flight[index] -= 1

    async def _flush(self, index: int) -> None:
        batch = self._pending.pop(index)
        try:
            results = await self.engines[index].generate_many.remote([r for r, _ in batch])
        except Exception as exc:  # the whole call failed: every caller sees it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
