"""The engine router: least-loaded routing over engine replicas, sticky per session, one actor call per
replica per event-loop tick, and token-level partial rollout across weight updates.

Partial rollout: :meth:`EngineRouter.pause_for_update` holds new requests and aborts what is in
flight; each caller's aborted samples wait, and after :meth:`EngineRouter.resume_after_update` they
go on from the tokens already generated, on the new weights (``GenerationRequest.resume_from``: the
remaining budget is ``max_new_tokens`` minus what was generated). The caller gets one result per
sample whose tokens carry the version that produced each of them; agents never see the update.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from dataclasses import replace

from loongsage.core.rollout.seeds import request_seed
from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams


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
        self._open: asyncio.Event | None = None  # cleared while a weight update holds generation
        self.updates = 0  # weight updates that paused generation so far
        self.resumed_samples = 0  # samples continued from their tokens after an update

    def pick(self, session: str | None = None) -> int:
        if session is not None and session in self._sticky:
            return self._sticky[session]
        index = min(range(len(self.engines)), key=lambda i: self.in_flight[i])
        if session is not None:
            self._sticky[session] = index
        return index

    def release_session(self, session: str) -> None:
        self._sticky.pop(session, None)

    def _gate(self) -> asyncio.Event:
        if self._open is None:  # created on the running loop
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def pause_for_update(self) -> None:
        """Hold new requests and abort every engine's requests in flight (their callers wait)."""
        self._gate().clear()
        self.updates += 1
        await asyncio.gather(*(engine.abort.remote(None) for engine in self.engines))

    def resume_after_update(self) -> None:
        """Let held requests go and aborted samples continue, on the weights now in the engines."""
        self._gate().set()

    async def generate(self, input_ids: list[int], sampling: SamplingParams, session: str | None = None) -> list[GenerationResult]:
        """The ``sampling.n`` samples of one prompt; samples cut by a weight update are continued."""
        await self._gate().wait()
        updates = self.updates
        results = await self._submit(self.pick(session), input_ids, sampling)
        while updates != self.updates and any(r.finish_reason is FinishReason.ABORT for r in results):
            await self._gate().wait()
            updates = self.updates
            cut = [j for j, r in enumerate(results) if r.finish_reason is FinishReason.ABORT]
            index = self.pick(session)
            more = await asyncio.gather(*(self._submit(index, input_ids, _continuation(sampling, j, results[j]),
                                                       resume_from=results[j]) for j in cut))
            for j, (result,) in zip(cut, more):
                results[j] = result
            self.resumed_samples += len(cut)
        return results

    async def _submit(self, index: int, input_ids: list[int], sampling: SamplingParams,
                      resume_from: GenerationResult | None = None) -> list[GenerationResult]:
        request = GenerationRequest(request_id=f"r{next(self._ids)}", input_ids=input_ids, sampling=sampling,
                                    resume_from=resume_from)
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
        """Send one tick's requests to an engine in one call; each caller gets its answer as soon as
        the engine finishes that request (a streamed reply), not when the slowest one is done."""
        batch = self._pending.pop(index)
        try:
            stream = self.engines[index].generate_stream.options(num_returns="streaming").remote([r for r, _ in batch])
            async for ref in stream:
                k, result = await ref
                future = batch[k][1]
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        except Exception as exc:  # the call failed: every caller still waiting sees it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)


def _continuation(sampling: SamplingParams, sample: int, partial: GenerationResult) -> SamplingParams:
    """Sampling of one aborted sample's continuation: a single sample whose seed (when the request
    had one) is its own, derived from the sample's index and how far it got."""
    seed = None
    if sampling.seed is not None:
        seed = request_seed(sampling.seed, (sample + 1) * 1_000_003 + len(partial.output_ids))
    return replace(sampling, n=1, seed=seed)
