"""A simulated rollout engine: the engine actor's calls as the router makes them, with the time a
GPU engine would take, in simulated time (:mod:`loongsage.core.sim.clock`).

:class:`SimEngine` batches continuously, as the native engine does: every live row gains one token
per decode step, and a step takes ``LatencyModel.step_s(rows)`` (a fixed cost plus a cost per row,
fitted to measured engines). A new request first waits ``LatencyModel.prefill_s(prompt tokens)``.
Between two changes of its batch the engine sets one timer, for the next row to finish, so a run
costs events per request, not per token. Each sample's length is drawn from a
:class:`LengthModel` (log-normal by default: long-tailed, the median and the 99th percentile
chosen) with the request's seed, so a request sent again draws the same length.

:class:`SimHandle` wraps it as an actor handle: ``handle.generate_stream.options(
num_returns="streaming").remote(requests)``, ``handle.abort.remote(...)`` and
``handle.health.remote()`` behave as the Ray calls the router makes (and ``set_version``, the engine
recovery's). Faults: ``kill()`` (every call then fails as a dead actor's does), ``silence()`` (calls
and health probes never answer) and ``slowdown`` (every step takes that many times longer).
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib
from dataclasses import dataclass
from typing import Any

from loongsage.core.types import FinishReason, GenerationRequest, GenerationResult


@dataclass(frozen=True)
class LatencyModel:
    """Seconds of one decode step over ``rows`` live rows, and of a prefill of ``tokens`` tokens.

    The defaults are the native engine on one H200 with a Qwen3-1.7B-shaped model
    (``bench/results/engine_gpu.json``: 64 / 128 / 256 rows decode at 19,064 / 29,923 / 38,361
    tokens/s, which a step of 2.45 ms + 16.4 us per row reproduces within 5%).
    """

    step_fixed_s: float = 2.45e-3
    step_per_row_s: float = 16.4e-6
    prefill_fixed_s: float = 5e-3
    prefill_token_s: float = 2e-5

    def step_s(self, rows: int) -> float:
        return self.step_fixed_s + self.step_per_row_s * rows

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_token_s * tokens


@dataclass(frozen=True)
class LengthModel:
    """Sampled tokens per sample: log-normal with the given median and 99th percentile, at least 1."""

    median: float = 256.0
    p99: float = 2560.0

    def draw(self, rng: random.Random, limit: int) -> int:
        sigma = math.log(self.p99 / self.median) / 2.3263478740408408  # z of the 99th percentile
        return max(1, min(limit, round(rng.lognormvariate(math.log(self.median), sigma))))


class _Row:
    __slots__ = ("request", "left", "done", "future")

    def __init__(self, request: GenerationRequest, length: int, future: asyncio.Future):
        self.request, self.future = request, future
        self.left = float(length)  # tokens still to sample
        self.done = 0.0


class SimEngine:
    """A continuous-batching engine in simulated time (see the module docstring)."""

    def __init__(
        self,
        latency: LatencyModel | None = None,
        lengths: LengthModel | None = None,
        *,
        slowdown: float = 1.0,
        max_rows: int = 256,
    ):
        self.latency, self.lengths = latency or LatencyModel(), lengths or LengthModel()
        self.slowdown, self.max_rows = float(slowdown), int(max_rows)
        self.version = 0
        self.rows: list[_Row] = []
        self.waiting: list[_Row] = []  # admitted when a row frees (max_rows)
        self.generated_tokens = 0
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the engine's calls
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        futures = [self._add(request, sample) for sample in range(request.sampling.n)]
        return [await f for f in futures]

    def abort(self, request_ids: list[str] | None = None) -> int:
        """Cut every row (or those of ``request_ids``): they answer ``ABORT`` with their tokens so far."""
        self._advance()
        cut = [r for r in self.rows + self.waiting if request_ids is None or r.request.request_id in request_ids]
        for row in cut:
            self._finish(row, FinishReason.ABORT)
        self._schedule()
        return len(cut)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "running_rows": len(self.rows), "waiting_rows": len(self.waiting)}

    # ------------------------------------------------------------------ simulated decoding
    def _add(self, request: GenerationRequest, sample: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        seed = request.sampling.seed
        key = zlib.crc32(f"{request.request_id}/{sample}".encode()) if seed is None else seed * 1_000_003 + sample
        budget = request.sampling.max_new_tokens
        done_before = len(request.resume_from.output_ids) if request.resume_from is not None else 0
        # a continued sample (cut by an update or its engine lost) draws its length again, at least
        # one more token and within the budget left
        total = self.lengths.draw(random.Random(key), budget)
        left = max(1, min(total, budget) - done_before)
        row = _Row(request, left, loop.create_future())
        self._advance()
        prefill = self.latency.prefill_s(len(request.input_ids) + done_before) * self.slowdown
        loop.call_later(prefill, self._join, row)
        return row.future

    def _join(self, row: _Row) -> None:
        if row.future.done():  # aborted during its prefill
            return
        self._advance()
        (self.rows if len(self.rows) < self.max_rows else self.waiting).append(row)
        self._schedule()

    def _step_s(self) -> float:
        return self.latency.step_s(len(self.rows)) * self.slowdown

    def _advance(self) -> None:
        """Credit every live row with the tokens decoded since the last change of the batch."""
        now = asyncio.get_running_loop().time()
        if self.rows:
            steps = (now - self._last) / self._step_s()
            for row in self.rows:
                row.left -= steps
                row.done += steps
        self._last = now

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.rows:
            steps = max(0.0, min(r.left for r in self.rows))
            self._timer = asyncio.get_running_loop().call_later(steps * self._step_s(), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        for row in [r for r in self.rows if r.left <= 1e-6]:
            self._finish(row, FinishReason.LENGTH)
        while self.waiting and len(self.rows) < self.max_rows:
            self.rows.append(self.waiting.pop(0))
        self._schedule()

    def _finish(self, row: _Row, reason: FinishReason) -> None:
        if row in self.rows:
            self.rows.remove(row)
        elif row in self.waiting:
            self.waiting.remove(row)
        # done + left is the drawn length; in real time a late timer credits steps past it
        length = row.done + row.left
        tokens = round(min(row.done, length)) if reason is FinishReason.ABORT else round(length)
        self.generated_tokens += tokens
        if not row.future.done():
            prior = row.request.resume_from  # a continued sample answers its earlier tokens, then the new ones
            ids, logprobs, versions = (prior.output_ids, prior.logprobs, prior.versions) if prior else ([], [], [])
            row.future.set_result(
                GenerationResult(
                    row.request.request_id,
                    [*ids, *[7] * tokens],
                    [*logprobs, *[-1.0] * tokens],
                    [*versions, *[self.version] * tokens],
                    reason,
                )
            )


class SimHandle:
    """A :class:`SimEngine` behind the actor-handle calls the engine router makes (see the module docstring)."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.dead = self.silent = False
        self.calls = 0
        self.generate_stream = _Method(self._stream)
        self.abort = _Method(self._abort)
        self.health = _Method(self._health)
        self.set_version = _Method(self._set_version)

    def kill(self) -> None:
        """From now on every call fails as a dead Ray actor's does; its rows are gone."""
        self.dead = True
        self.engine.abort()

    def silence(self) -> None:
        """From now on nothing answers: calls in flight, new calls and health probes hang."""
        self.silent = True

    async def _check(self) -> None:
        if self.silent:
            await asyncio.Event().wait()  # forever
        if self.dead:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()

    def _stream(self, requests: list[GenerationRequest]):
        self.calls += 1
        return _Stream(self, requests)

    async def _abort(self, request_ids: list[str] | None) -> int:
        await self._check()
        return self.engine.abort(request_ids)

    async def _health(self) -> dict[str, Any]:
        await self._check()
        return self.engine.health()

    async def _set_version(self, version: int) -> None:
        await self._check()
        self.engine.version = int(version)


class LocalHandle:
    """Any object's methods as actor calls: ``handle.method.remote(...)`` calls ``obj.method(...)``
    (a coroutine method's call is awaited by the caller, as a Ray object ref is)."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class _Method:
    """``handle.method.remote(...)`` and ``handle.method.options(...).remote(...)``."""

    def __init__(self, fn):
        self._fn = fn

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class _Stream:
    """The answers of one ``generate_stream`` call as a streaming Ray call yields them: ``(k, result)``
    for request ``k``, in the order they finish."""

    def __init__(self, handle: SimHandle, requests: list[GenerationRequest]):
        self.handle = handle
        self.done: asyncio.Queue = asyncio.Queue()
        self.left = len(requests)
        self.tasks = [asyncio.ensure_future(self._one(k, r)) for k, r in enumerate(requests)]

    async def _one(self, k: int, request: GenerationRequest) -> None:
        try:
            await self.handle._check()
            result = await self.handle.engine.generate(request)
            await self.handle._check()  # killed or silenced while generating
        except Exception as exc:  # noqa: BLE001 - the stream ends with the actor's error
            await self.done.put(exc)
            return
        await self.done.put((k, result))

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if self.left == 0:
            raise StopAsyncIteration
        try:
            item = await self.done.get()
        except asyncio.CancelledError:  # the caller gave up on the call (a silent engine): so does it
            for task in self.tasks:
                task.cancel()
            raise
        if isinstance(item, Exception):
            self.left = 0
            for task in self.tasks:
                task.cancel()
            raise item
        self.left -= 1
        future = asyncio.get_running_loop().create_future()
        future.set_result(item)
        return future
