"""The engine router at scale, in simulated time: up to 1,000 simulated engines with long-tailed
response lengths behind the real :class:`~loongsage.core.rollout.router.EngineRouter`, and engines
killed, silenced or slowed during the run (:mod:`loongsage.core.sim`)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from loongsage.core.rollout.router import EngineRouter
from loongsage.core.sim.clock import SimulationStalled, run_simulated
from loongsage.core.sim.engine import LatencyModel, LengthModel, SimEngine, SimHandle
from loongsage.core.types import FinishReason, GenerationRequest, SamplingParams

BUDGET, PROMPT = 4096, 128
LENGTHS = LengthModel(median=256, p99=2560)  # the tail an order of magnitude above the median


def test_the_simulated_clock_jumps_to_the_next_timer_and_reports_a_stall():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        assert loop.time() == 3600
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30)
        return loop.time()

    assert run_simulated(main()) == (3630, 3630)
    with pytest.raises(SimulationStalled):
        run_simulated(asyncio.Event().wait())


def test_a_simulated_engine_decodes_at_its_latency_models_rate():
    latency = LatencyModel()

    async def main():
        engine = SimEngine(latency, LengthModel(median=300, p99=300))  # every sample 300 tokens
        sampling = SamplingParams(temperature=1.0, max_new_tokens=BUDGET, n=4)
        requests = [GenerationRequest(f"r{i}", [1] * PROMPT, sampling) for i in range(16)]
        answers = await asyncio.gather(*(engine.generate(r) for r in requests))
        return answers, engine.generated_tokens

    (answers, tokens), seconds = run_simulated(main())
    assert tokens == 16 * 4 * 300
    assert all(len(r.output_ids) == 300 and r.finish_reason is FinishReason.LENGTH for a in answers for r in a)
    # all 64 rows join after one prefill and decode 300 steps together
    assert seconds == pytest.approx(latency.prefill_s(PROMPT) + 300 * latency.step_s(64), rel=1e-9)


def _expected_length(seed: int) -> int:
    return LENGTHS.draw(random.Random(seed * 1_000_003), BUDGET)


def _run(
    engines: int,
    requests: int,
    *,
    faults=None,
    replace_after_s: float = 2.0,
    health_timeout_s: float = 10.0,
    slowdown: dict[int, float] | None = None,
    **router_options,
):
    """Every request through the router; returns (results, router, handles, seconds)."""

    async def main():
        handles = [SimHandle(SimEngine(lengths=LENGTHS, slowdown=(slowdown or {}).get(i, 1.0))) for i in range(engines)]
        router = EngineRouter(handles, health_timeout_s=health_timeout_s, **router_options)

        def lost(index: int, handle: SimHandle) -> None:
            async def replace() -> None:
                await asyncio.sleep(replace_after_s)
                router.engine_replaced(index, SimHandle(SimEngine(lengths=LENGTHS)))

            asyncio.ensure_future(replace())

        router.on_engine_lost = lost
        if faults:
            faults(asyncio.get_running_loop(), handles)
        sampling = [SamplingParams(temperature=1.0, max_new_tokens=BUDGET, seed=seed) for seed in range(requests)]
        results = await asyncio.gather(*(router.generate([1] * PROMPT, s) for s in sampling))
        return results, router, handles

    (results, router, handles), seconds = run_simulated(main())
    return results, router, handles, seconds


def _clean_bound(requests: int, engines: int) -> float:
    """A run without faults ends once the longest sample is decoded on a fully loaded engine."""
    longest = max(_expected_length(seed) for seed in range(requests))
    return LatencyModel().prefill_s(PROMPT) + longest * LatencyModel().step_s(math.ceil(requests / engines))


def test_a_thousand_engines_answer_every_request_once_with_its_own_length():
    engines, requests = 1000, 16_000
    results, router, handles, seconds = _run(engines, requests)
    assert len(results) == requests and all(len(r) == 1 for r in results)
    # every request's one sample, with the length its seed draws: none lost, none answered twice
    assert [len(r[0].output_ids) for r in results] == [_expected_length(seed) for seed in range(requests)]
    assert all(r[0].finish_reason is FinishReason.LENGTH for r in results)
    # least-loaded routing spread the 16,000 requests evenly: one call of 16 requests per engine
    assert all(h.calls == 1 for h in handles) and router.in_flight == [0] * engines
    assert seconds <= _clean_bound(requests, engines) * 1.001
    assert router.requests_redispatched == 0


def test_killed_engines_are_replaced_and_their_requests_sent_again():
    engines, requests, killed = 200, 3200, 10  # 5% of the engines die during the run

    busy = []  # killed while holding requests (an idle dead engine is noticed at its next call)

    def faults(loop, handles):
        rng = random.Random(7)

        def kill(handle: SimHandle) -> None:
            busy.append(bool(handle.engine.rows or handle.engine.waiting))
            handle.kill()

        for index in rng.sample(range(engines), killed):
            loop.call_later(rng.uniform(0.5, 5.0), kill, handles[index])

    results, router, _, seconds = _run(engines, requests, faults=faults, replace_after_s=2.0)
    assert len(results) == requests and all(len(r) == 1 and r[0].output_ids for r in results)
    assert all(r[0].finish_reason is FinishReason.LENGTH for r in results)
    assert len(busy) == killed and sum(busy) >= killed // 2
    assert router.engine_restarts == sum(busy) and router.requests_redispatched > 0 and not router.down
    # a lost request starts again from its prompt: at most one more longest generation, plus the wait
    # for the replacement when no engine was free, and never a stall
    assert seconds <= 2 * _clean_bound(requests, engines) + 5.0 + 2.0


def test_silent_engines_are_given_up_after_the_health_timeout():
    engines, requests, silent, timeout = 200, 3200, 10, 10.0

    busy = []

    def faults(loop, handles):
        def silence(handle: SimHandle) -> None:
            busy.append(bool(handle.engine.rows or handle.engine.waiting))
            handle.silence()

        for index in random.Random(8).sample(range(engines), silent):
            loop.call_later(2.0, silence, handles[index])

    results, router, _, seconds = _run(engines, requests, faults=faults, health_timeout_s=timeout)
    assert len(results) == requests and all(len(r) == 1 and r[0].output_ids for r in results)
    assert len(busy) == silent and sum(busy) >= silent // 2
    assert router.engine_restarts == sum(busy) and router.requests_redispatched > 0
    # a silent engine's requests wait one health timeout (the stream) plus one more (the probe)
    # before they go again: no stall beyond that
    assert seconds <= 2 * _clean_bound(requests, engines) + 2.0 + 2 * timeout + 2.0


def test_one_slow_engine_no_longer_holds_a_synchronous_step():
    """One engine of 64 ten times slower: least-loaded routing gives it its 16 requests like any other,
    and the step waited for them (2.4x). The router now sends a straggler's requests to engines that
    went idle as well, keeping the first answer: the step ends as if every engine were fast."""
    engines, requests = 64, 1024
    expected = [_expected_length(seed) for seed in range(requests)]
    _, clean_router, _, clean_s = _run(engines, requests)
    assert clean_router.requests_hedged == 0  # equal engines: nothing to hedge
    results, router, handles, seconds = _run(engines, requests, slowdown={0: 10.0})
    # every request answered once, with exactly the tokens its seed draws, whichever engine answered
    assert [len(r) for r in results] == [1] * requests
    assert [len(r[0].output_ids) for r in results] == expected
    assert all(r[0].finish_reason is FinishReason.LENGTH for r in results)
    assert seconds <= 1.25 * clean_s, (seconds, clean_s)
    # only the slow engine's requests were copied, once each, and the copies that lost were aborted
    assert 0 < router.hedges_won <= router.requests_hedged <= requests // engines
    assert router.in_flight == [0] * engines and not any(h.engine.rows for h in handles)
    # without the copies the same step waits for the slow engine's share
    *_, unhedged_s = _run(engines, requests, slowdown={0: 10.0}, straggler_ratio=None)
    assert unhedged_s > 1.8 * clean_s, (unhedged_s, clean_s)
