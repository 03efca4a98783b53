"""The engine router: least-loaded routing over engine replicas, sticky per session, one actor call per
replica per event-loop tick, token-level partial rollout across weight updates, failover when an
engine dies, and every call's state in view for checkpoints.

Partial rollout: :meth:`EngineRouter.pause_for_update` holds new requests and aborts what is in
flight; each caller's aborted samples wait, and after :meth:`EngineRouter.resume_after_update` they
go on from the tokens already generated, on the new weights (``GenerationRequest.resume_from``: the
remaining budget is ``max_new_tokens`` minus what was generated). The caller gets one result per
sample whose tokens carry the version that produced them; agents never see the update.

Failover: an engine is lost when its actor call raises ``RayActorError`` (the actor died), or when a
call fails or stays silent for ``health_timeout_s`` and a health probe (``engine.health``, bounded by
the same timeout) does not answer or raises ``EngineUnavailable`` (the server behind the engine is
gone). The router then stops routing to it, tells its owner
(``on_engine_lost(index, handle)``, which starts a replacement), and sends every request that was
waiting on it again: to another live engine, or to the replacement once the owner calls
:meth:`EngineRouter.engine_replaced`. A request goes again as it was (same prompt, sampling and seed,
same ``resume_from``), so on the same weights it samples the same tokens; agents never see the loss.
Without an owner (``on_engine_lost`` unset) a lost engine fails its callers, as any other error does.

Stragglers: least-loaded routing counts requests, not throughput, so an engine much slower than the
others (a bad GPU, a throttled node) gets as many requests as they do, and a synchronous step waits
for its share. The router keeps each engine's observed decode rate (sampled tokens per second of a
request, from the answers) and the run's; an engine ``straggler_ratio`` times slower than the run is
a straggler. When an engine is idle, a request still running on a straggler that the idle engine
decodes at least ``straggler_ratio`` times faster is sent to it too, as it is (same prompt,
sampling, seed and ``resume_from``), so on the same weights it samples the same tokens; the first
answer is kept and the other copy aborted. The copy starts from the prompt rather than from the
straggler's tokens so far: continuing those would need a cut, and a continuation's seed depends on
where it was cut. A request has at most one copy, and none is made while an update holds generation.

Calls: every ``generate`` is a :class:`Call` while it runs (``EngineRouter.calls``): its prompt,
sampling (seed included), session and results so far: ``None`` until an engine answered, then the
``n`` samples, finished or cut (``ABORT``, with their tokens, log-probs and versions so far). A call's
results change in the same event-loop step as the answer arrives, so they are never behind what the
engines returned. :meth:`EngineRouter.settled` waits until no call awaits an engine's answer: after
:meth:`EngineRouter.pause_for_update` that comes quickly (the aborted requests answer at once; one
that reached its engine after the abort just finishes), and then every call's state is fixed until
:meth:`EngineRouter.resume_after_update`. That is the moment a checkpoint takes the rollout's state
(see :mod:`loongsage.core.rollout.replay`). :meth:`EngineRouter.run` runs a call given as a ``Call``;
one that holds results already (a call restored from a checkpoint) continues its cut samples.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from loongsage.core.rollout.seeds import request_seed
from loongsage.core.types import EngineUnavailable, FinishReason, GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger("loongsage")

# An engine this many times slower than the run is a straggler. Equal engines differ by less: a
# request's rate moves with its engine's batch (2.7x from 1 row to 256 in loongsage.core.sim's
# latency model of the native engine)
STRAGGLER_RATIO = 4.0


class EngineLost(Exception):
    """An engine died or stopped answering; the requests it held are sent again."""


@dataclass(eq=False)
class Call:
    """One ``generate`` call as the router holds it (compared by identity: two calls may ask the same)."""

    input_ids: list[int]
    sampling: SamplingParams
    session: str | None = None
    results: list[GenerationResult] | None = None  # None until an engine answered; cut samples are ABORT


class _Rate:
    """Sampled tokens per second of a request, a moving average over recent answers."""

    __slots__ = ("tokens", "seconds", "answers", "keep")

    def __init__(self, keep: float):
        self.tokens = self.seconds = 0.0
        self.answers = 0
        self.keep = keep  # weight of the past at each new answer

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * self.keep + tokens
        self.seconds = self.seconds * self.keep + seconds
        self.answers += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(eq=False)
class _Flight:
    """A request sent to an engine and not answered yet (straggler hedging's view of it)."""

    request: GenerationRequest
    future: asyncio.Future
    engine: int
    copy: tuple[int, str] | None = None  # (engine, request id) of its copy on a faster engine
    answered_by_copy: bool = False


class EngineRouter:
    """Least-loaded routing over engine actor handles; sticky per session id.

    Requests made in the same event-loop tick are sent to an engine in ONE actor call, so the engine
    sees them together and batches them, and a step of many prompts costs one round trip per engine.
    ``engines`` is kept by reference: a replacement is swapped into the caller's own list.
    ``straggler_ratio``: how many times slower than the run an engine decodes before its requests are
    also sent to idle engines (see the module docstring); None turns that off.
    """

    def __init__(
        self, engines: list[Any], *, health_timeout_s: float = 30.0, straggler_ratio: float | None = STRAGGLER_RATIO
    ):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if not health_timeout_s > 0:
            raise ValueError(f"EngineRouter: health_timeout_s={health_timeout_s!r} must be > 0")
        if straggler_ratio is not None and not straggler_ratio > 1:
            raise ValueError(f"EngineRouter: straggler_ratio={straggler_ratio!r} must be > 1 (or None: off)")
        self.engines = engines
        self.health_timeout_s = float(health_timeout_s)
        self.in_flight = [0] * len(engines)
        # (requests in flight, engine) for every change of a load; entries whose load is no longer
        # the engine's, or whose engine is down, are dropped when they reach the top: pick() costs
        # O(log engines), not a scan of every engine per request
        self._loads = [(0, i) for i in range(len(engines))]
        self._sticky: dict[str, int] = {}
        self._ids = itertools.count()
        self._pending: dict[int, list[tuple[GenerationRequest, asyncio.Future]]] = {}
        self._open: asyncio.Event | None = None  # cleared while a weight update holds generation
        self._routable: asyncio.Event | None = None  # set whenever an engine comes back (or routing fails)
        self.calls: set[Call] = set()  # the generate calls in progress
        self._awaiting = 0  # requests sent and not yet answered
        self._quiet: asyncio.Event | None = None  # set whenever _awaiting drops to 0
        self.updates = 0  # weight updates that paused generation so far
        self.resumed_samples = 0  # samples continued from their tokens after an update
        # failover: engines not routed to (index -> the lost handle), set by the owner
        self.on_engine_lost: Callable[[int, Any], None] | None = None
        self.down: dict[int, Any] = {}
        self.engine_restarts = 0  # replacements routed to so far
        self.requests_redispatched = 0  # requests sent again because their engine was lost
        self._failed: BaseException | None = None
        # stragglers: decode rates observed, the requests not answered yet, the engines with none
        self.straggler_ratio = straggler_ratio
        self.requests_hedged = 0  # requests also sent to a faster engine
        self.hedges_won = 0  # ... of which the copy answered first
        self._rates = [_Rate(keep=0.75) for _ in engines]
        self._run_rate = _Rate(keep=1 - 1 / (16 + len(engines)))  # over the last few answers of every engine
        self._flights: list[dict[asyncio.Future, _Flight]] = [{} for _ in engines]  # without a copy yet
        self._idle = set(range(len(engines)))
        self._stragglers: set[int] = set()  # engines whose observed rate makes them stragglers
        self._background: set[asyncio.Task] = set()  # engine calls under way, aborts of the copies that lost

    # ------------------------------------------------------------------ routing
    def pick(self, session: str | None = None) -> int | None:
        """The engine for a request: the session's own while it is up, else the least loaded one
        that is up; None while every engine is down."""
        if session is not None and self._sticky.get(session) not in (None, *self.down):
            return self._sticky[session]
        loads = self._loads
        while loads and (loads[0][1] in self.down or loads[0][0] != self.in_flight[loads[0][1]]):
            heapq.heappop(loads)
        if not loads:
            return None
        index = loads[0][1]  # the least loaded engine that is up, the lowest index among equals
        if session is not None:
            self._sticky[session] = index
        return index

    def _load(self, index: int, change: int) -> None:
        self.in_flight[index] += change
        heapq.heappush(self._loads, (self.in_flight[index], index))
        if len(self._loads) > 4 * len(self.engines) + 64:  # stale entries: rebuild, amortised O(1)
            self._reindex()
        if self.in_flight[index]:
            self._idle.discard(index)
        else:
            self._idle.add(index)
            if self._stragglers:
                self._hedge_onto(index)

    def _reindex(self) -> None:
        self._loads = [(load, i) for i, load in enumerate(self.in_flight) if i not in self.down]
        heapq.heapify(self._loads)

    def release_session(self, session: str) -> None:
        self._sticky.pop(session, None)

    def _gate(self) -> asyncio.Event:
        if self._open is None:  # created on the running loop
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def _pass_gate(self) -> None:
        # a waiter woken by the gate opening runs later: the gate may have closed again by then
        while not self._gate().is_set():
            await self._gate().wait()

    def _routable_event(self) -> asyncio.Event:
        if self._routable is None:
            self._routable = asyncio.Event()
        return self._routable

    # ------------------------------------------------------------------ weight updates
    async def pause_for_update(self) -> None:
        """Hold new requests and abort every engine's requests in flight (their callers wait)."""
        self._gate().clear()
        self.updates += 1
        live = [(i, e) for i, e in enumerate(self.engines) if i not in self.down]
        await asyncio.gather(*(self._abort_all(i, e) for i, e in live))

    async def _abort_all(self, index: int, engine: Any) -> None:
        try:
            await asyncio.wait_for(_awaitable(engine.abort.remote(None)), self.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a lost engine's requests are sent again instead
            if not await self._lost(index, engine, exc):
                raise

    async def check_engines(self) -> None:
        """Probe every engine routed to; one that does not answer is lost (and replaced)."""
        if self.on_engine_lost is None:
            return
        live = [(i, e) for i, e in enumerate(self.engines) if i not in self.down]
        answers = await asyncio.gather(*(self.healthy(e) for _, e in live))
        for (index, engine), ok in zip(live, answers):
            if not ok:
                await self._lost(index, engine, EngineLost("no answer to a health probe"))

    async def settled(self) -> None:
        """Wait until no request awaits an engine's answer (every call's results are then fixed while
        the update holds generation)."""
        while self._awaiting:
            if self._quiet is None:
                self._quiet = asyncio.Event()
            self._quiet.clear()
            await self._quiet.wait()

    def resume_after_update(self) -> None:
        """Let held requests go and aborted samples continue, on the weights now in the engines."""
        self._gate().set()

    # ------------------------------------------------------------------ failover
    def engine_replaced(self, index: int, engine: Any) -> None:
        """The owner's replacement of engine ``index`` holds the current weights: route to it."""
        self.engines[index] = engine
        self._rates[index] = _Rate(keep=0.75)  # a new engine: its rate is learned again
        self._stragglers.discard(index)
        if self.down.pop(index, None) is not None:
            self.engine_restarts += 1
            heapq.heappush(self._loads, (self.in_flight[index], index))
        self._routable_event().set()

    def fail(self, error: BaseException) -> None:
        """No replacement is coming: every request waiting for an engine fails with ``error``."""
        self._failed = error
        self._routable_event().set()

    async def healthy(self, engine: Any) -> bool:
        """Whether ``engine`` answers a health probe within ``health_timeout_s``."""
        from ray.exceptions import RayActorError

        try:
            await asyncio.wait_for(_awaitable(engine.health.remote()), self.health_timeout_s)
        except (TimeoutError, RayActorError, EngineUnavailable):  # dead, silent, or its server gone
            return False
        except Exception:  # noqa: BLE001 - it answered, with an error of its own: alive
            return True
        return True

    async def _lost(self, index: int, engine: Any, error: BaseException) -> bool:
        """Whether the requests of a failed call to ``engine`` go again: the engine is lost (it died, or
        does not answer a health probe; its owner is told), or only the call was. A live engine's own
        error is its callers' to see."""
        from ray.exceptions import ActorDiedError, RayActorError

        if self.on_engine_lost is None:
            return False
        if self.engines[index] is not engine or index in self.down:
            return True  # already lost, and being replaced
        if not isinstance(error, (ActorDiedError, EngineLost)) and await self.healthy(engine):
            return isinstance(error, RayActorError)
        if self.engines[index] is engine and index not in self.down:
            log.warning(
                "rollout: engine %d lost (%s: %s); starting a replacement",
                index,
                type(error).__name__,
                (str(error).splitlines() or [""])[0],
            )
            self.down[index] = engine
            self.on_engine_lost(index, engine)
        return True

    # ------------------------------------------------------------------ generation
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> list[GenerationResult]:
        """The ``sampling.n`` samples of one prompt; samples cut by a weight update are continued."""
        return await self.run(Call(list(input_ids), sampling, session))

    async def run(self, call: Call) -> list[GenerationResult]:
        """Generate ``call``'s samples, keeping its results current (see the module docstring). A call
        that holds results already continues the cut ones from their tokens and keeps the others."""
        self.calls.add(call)
        try:
            await self._pass_gate()
            updates = self.updates
            if call.results is None:
                call.results = await self._submit(call.session, call.input_ids, call.sampling)
            else:
                updates = -1  # restored: its cut samples go on now
            while updates != self.updates and any(r.finish_reason is FinishReason.ABORT for r in call.results):
                await self._pass_gate()
                updates = self.updates
                cut = [j for j, r in enumerate(call.results) if r.finish_reason is FinishReason.ABORT]
                await asyncio.gather(*(self._continue(call, j) for j in cut))
            return list(call.results)
        finally:
            self.calls.discard(call)

    async def _continue(self, call: Call, sample: int) -> None:
        partial = call.results[sample]
        self.resumed_samples += 1
        (call.results[sample],) = await self._submit(
            call.session, call.input_ids, _continuation(call.sampling, sample, partial), resume_from=partial
        )

    async def _submit(
        self,
        session: str | None,
        input_ids: list[int],
        sampling: SamplingParams,
        resume_from: GenerationResult | None = None,
    ) -> list[GenerationResult]:
        request = GenerationRequest(
            request_id=f"r{next(self._ids)}", input_ids=input_ids, sampling=sampling, resume_from=resume_from
        )
        while True:
            index = await self._route(session)
            future = asyncio.get_running_loop().create_future()
            self._send(index, request, future)
            self._load(index, +1)
            self._awaiting += 1
            flight = self._flights[index][future] = _Flight(request, future, index)
            if index in self._stragglers:  # routed by count to an engine known to be slow: copy it now
                self._hedge_from(index)
            try:
                return await future
            except EngineLost:
                # the same request again (its seed with it), under a fresh id, after any update hold
                self.requests_redispatched += 1
                request = replace(request, request_id=f"r{next(self._ids)}")
            finally:
                self._landed(flight)
                self._load(index, -1)
                self._awaiting -= 1
                if not self._awaiting and self._quiet is not None:
                    self._quiet.set()
            await self._pass_gate()

    def _send(self, index: int, request: GenerationRequest, future: asyncio.Future) -> None:
        """Queue ``request`` for engine ``index``'s call of this event-loop tick."""
        if index not in self._pending:
            self._pending[index] = []
            asyncio.get_running_loop().call_soon(lambda i=index: self._in_background(self._flush(i)))
        self._pending[index].append((request, future))

    # ------------------------------------------------------------------ stragglers
    def _observe(self, index: int, request: GenerationRequest, results: list[GenerationResult], seconds: float):
        """An engine's answer: its decode rate (the longest sample's new tokens over the call's time)."""
        if self.straggler_ratio is None or seconds <= 0:
            return
        before = len(request.resume_from.output_ids) if request.resume_from is not None else 0
        if any(r.finish_reason is FinishReason.ABORT for r in results):
            return  # cut short: its time says nothing of the engine's pace
        tokens = max((len(r.output_ids) for r in results), default=0) - before
        if tokens < 32:  # a short answer's time is mostly the call's and the prefill's, not decoding
            return
        self._rates[index].add(tokens, seconds)
        self._run_rate.add(tokens, seconds)
        if self._is_straggler(index):
            self._stragglers.add(index)
            self._hedge_from(index)
        else:
            self._stragglers.discard(index)

    def _is_straggler(self, index: int) -> bool:
        # an answer of its own (of 32 tokens or more: its pace, not its prefill) against a few of the run's
        enough = self._rates[index].answers >= 1 and self._run_rate.answers >= 8
        return enough and self._rates[index].value * self.straggler_ratio <= self._run_rate.value

    def _hedge_from(self, slow: int) -> None:
        """Copy straggler ``slow``'s requests to the idle engines, the lowest index first."""
        for idle in sorted(self._idle):
            if not self._flights[slow]:
                return
            self._hedge_onto(idle)

    def _hedge_onto(self, idle: int) -> None:
        """Send engine ``idle`` a copy of the oldest request of a straggler it decodes faster than."""
        if idle in self.down or idle in self._stragglers or not self._gate().is_set():
            return
        speed = self._rates[idle].value if self._rates[idle].answers else self._run_rate.value
        for slow in sorted(self._stragglers):
            if slow in self.down or speed < self.straggler_ratio * self._rates[slow].value:
                continue
            flight = self._oldest_unanswered(slow)
            if flight is None:
                continue
            copy = replace(flight.request, request_id=f"r{next(self._ids)}")
            flight.copy = (idle, copy.request_id)
            answer = asyncio.get_running_loop().create_future()
            answer.add_done_callback(lambda done, f=flight: self._copy_answered(f, done))
            self._send(idle, copy, answer)
            self.requests_hedged += 1
            self._load(idle, +1)
            return

    def _oldest_unanswered(self, slow: int) -> _Flight | None:
        """Take the oldest request of engine ``slow`` without a copy yet (on a slow engine, the furthest
        from done); None when it has none left."""
        flights = self._flights[slow]
        while flights:
            flight = flights.pop(next(iter(flights)))
            if not flight.future.done():  # else answered in this event-loop step, its caller not yet run
                return flight
        return None

    def _copy_answered(self, flight: _Flight, answer: asyncio.Future) -> None:
        """A copy's answer: the request's if it came first and is complete. An error, or a cut (a weight
        update aborts the original as well, which then goes on from its own tokens), leaves the original."""
        self._load(flight.copy[0], -1)
        if answer.cancelled() or answer.exception() is not None or flight.future.done():
            return
        if any(r.finish_reason is FinishReason.ABORT for r in answer.result()):
            return
        flight.answered_by_copy = True
        self.hedges_won += 1
        flight.future.set_result(answer.result())

    def _landed(self, flight: _Flight) -> None:
        """A request was answered (or failed): forget it, and abort its copy that did not answer first."""
        self._flights[flight.engine].pop(flight.future, None)
        if flight.copy is None:
            return
        loser, request_id = (flight.engine, flight.request.request_id) if flight.answered_by_copy else flight.copy
        self._in_background(self._abort_quietly(self.engines[loser], request_id))

    def _in_background(self, call: Any) -> None:
        """Run ``call`` as a task held until it ends (the loop keeps only a weak reference to one)."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, engine: Any, request_id: str) -> None:
        try:
            await asyncio.wait_for(_awaitable(engine.abort.remote([request_id])), self.health_timeout_s)
        except Exception:  # noqa: BLE001 - it answered meanwhile, or its engine is lost (seen elsewhere)
            pass

    async def _route(self, session: str | None) -> int:
        while True:
            if self._failed is not None:
                raise RuntimeError(f"rollout: no engine to generate on: {self._failed}") from self._failed
            index = self.pick(session)
            if index is not None:
                return index
            self._routable_event().clear()
            await self._routable_event().wait()

    async def _flush(self, index: int) -> None:
        """Send one tick's requests to an engine in one call; each caller gets its answer as soon as
        the engine finishes that request (a streamed reply), not when the slowest one is done."""
        batch = self._pending.pop(index)
        engine = self.engines[index]
        sent = asyncio.get_running_loop().time()
        try:
            stream = engine.generate_stream.options(num_returns="streaming").remote([r for r, _ in batch])
            async for k, result in self._answers(stream, engine):
                request, future = batch[k]
                if not future.done():
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                if not isinstance(result, Exception):
                    self._observe(index, request, result, asyncio.get_running_loop().time() - sent)
        except Exception as exc:  # the call failed: every caller still waiting sees it, or goes again
            error = EngineLost(f"engine {index}") if await self._lost(index, engine, exc) else exc
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)

    async def _answers(self, stream: Any, engine: Any):
        """The stream's ``(k, result)`` items; a silence of ``health_timeout_s`` is probed, and an
        engine that does not answer the probe is lost (a long generation on a live engine is not)."""
        while True:
            item = asyncio.ensure_future(stream.__anext__())
            while not (await asyncio.wait({item}, timeout=self.health_timeout_s))[0]:
                if not await self.healthy(engine):
                    item.cancel()
                    raise EngineLost(f"no answer within rollout.engine_health_timeout_s={self.health_timeout_s:g}")
            try:
                ref = item.result()
            except StopAsyncIteration:
                return
            yield await ref


def _awaitable(ref: Any) -> Any:
    """An object ref as something ``asyncio.wait_for`` can wrap in a task."""

    async def wait() -> Any:
        return await ref

    return wait()


def _continuation(sampling: SamplingParams, sample: int, partial: GenerationResult) -> SamplingParams:
    """Sampling of one aborted sample's continuation: a single sample whose seed (when the request
    had one) is its own, derived from the sample's index and how far it got."""
    seed = None
    if sampling.seed is not None:
        seed = request_seed(sampling.seed, (sample + 1) * 1_000_003 + len(partial.output_ids))
    return replace(sampling, n=1, seed=seed)
