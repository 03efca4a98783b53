"""One measured run of the gateway at scale: the real gateway (uvicorn on loopback, ``ChatService``,
the qwen3 parser) on the real ``EngineRouter`` over :class:`~loongsage.core.sim.text.TextSimEngine`
engines in real time, and the scripted agents of :mod:`~loongsage.agentflow.sim.fleet` in a
process of their own against it.

What a run keeps, for its checks and figures:

* every turn as the agent saw it (sent, latency, reply or error);
* every engine call as the gateway made it (:class:`EngineLog`: start and end, and digests of the
  prompt and of each sample's tokens: a few integers a call, so that the record does not weigh
  in the memory measured);
* this process's resident memory before the sessions opened (after a warm-up round through the
  same path) and at its highest while they ran; its CPU time and the fleet's;
* the sessions as closed, and the gateway's and router's tables while open and after closing.

The latency the gateway adds to a turn is the agent's latency (request sent to reply parsed) less
the engine call's (the router and the simulated engine, as the gateway awaited them). It also holds
the agents' own process's waits and the loopback; the gateway's own share is its app's time from
the request's body in to the answer out (:class:`ServerTimes`), less the engine call's. How late a
timer fires on each side's event loop (:class:`LoopLag`) tells what the two processes waited for.
This process's CPU covers the gateway, the router and the simulated engines; :func:`run_direct`
sends the same turns straight to the router, the peer that tells the gateway's share apart.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import time
import zlib
from array import array
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from loongsage.agentflow.sim.fleet import Script, allow_open_files, job_line, turn_seed
from loongsage.core.sim.engine import LatencyModel, LengthModel

# the native engine's H200 model (sim.engine.LatencyModel's defaults) ten times faster: a reply of
# 16 tokens in a batch of 100 rows costs about 7 ms, so a run of thousands of turns is bound by the
# gateway's work, not by waiting for the engines
FAST_LATENCY = LatencyModel(step_fixed_s=2.45e-4, step_per_row_s=1.64e-6, prefill_fixed_s=5e-4, prefill_token_s=2e-6)
SHORT_REPLIES = LengthModel(median=16, p99=48)


@dataclass(frozen=True)
class Scenario:
    sessions: int = 2000
    engines: int = 8
    script: Script = Script()
    latency: LatencyModel = FAST_LATENCY
    lengths: LengthModel = SHORT_REPLIES
    warmup_sessions: int = 32  # one round through the same path before anything is measured

    def __post_init__(self) -> None:
        if not (isinstance(self.sessions, int) and self.sessions >= 1):
            raise ValueError(f"Scenario.sessions={self.sessions!r}: must be an int >= 1")
        if not (isinstance(self.engines, int) and self.engines >= 1):
            raise ValueError(f"Scenario.engines={self.engines!r}: must be an int >= 1")


def digest(ids: Any) -> tuple[int, int]:
    """``(length, crc32)`` of a token list: equal lists, equal digests."""
    return len(ids), zlib.crc32(array("i", ids).tobytes())


@dataclass(frozen=True)
class EngineCall:
    start: float  # time.monotonic()
    end: float
    prompt: tuple[int, int]  # digest of the prompt
    samples: tuple[tuple[int, int], ...]  # digest of each sample's tokens
    max_new_tokens: int
    seed: int | None

    @property
    def seconds(self) -> float:
        return self.end - self.start


class EngineLog:
    """An engine client between the gateway and the router that keeps every call, per session."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.calls: dict[str, list[EngineCall]] = defaultdict(list)

    async def generate(self, input_ids: list[int], sampling: Any, session: str | None = None) -> list[Any]:
        start = time.monotonic()
        results = await self.inner.generate(input_ids, sampling, session)
        call = EngineCall(
            start,
            time.monotonic(),
            digest(input_ids),
            tuple(digest(r.output_ids) for r in results),
            sampling.max_new_tokens,
            sampling.seed,
        )
        self.calls[session].append(call)
        return results

    def release_session(self, session: str) -> None:
        self.inner.release_session(session)


class ServerTimes:
    """The gateway's app wrapped: per session, when each request's body had arrived whole and when
    the last byte of its answer was handed to the server (``path`` ``/{trajectory}/{attempt}/...``).
    From the body on: a client may send its request's head and body in two writes, and the wait
    between them is the client's."""

    def __init__(self, app: Any):
        self.app = app
        self.times: dict[str, list[tuple[float, float]]] = defaultdict(list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        arrived = [time.monotonic()]

        async def timed_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                arrived[0] = time.monotonic()
            return message

        async def timed_send(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                parts = scope["path"].split("/")
                self.times["/".join(parts[1:3])].append((arrived[0], time.monotonic()))

        await self.app(scope, timed_receive, timed_send)


class LoopLag:
    """How late a timer of ``every_s`` fires on this event loop: how long anything ready (a request
    arriving, an engine's answer) waits for the loop."""

    def __init__(self, every_s: float = 0.01):
        self.every_s, self.lags = every_s, array("d")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.every_s
            await asyncio.sleep(self.every_s)
            self.lags.append(loop.time() - due)


class FleetProcess:
    """``python -m loongsage.agentflow.sim.fleet``, started once and given one job at a time."""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loongsage.agentflow.sim.fleet",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 28,  # one result is one line: megabytes at thousands of sessions
        )

    async def run(self, sessions: list[tuple[str, str]], script: Script) -> dict[str, Any]:
        self.proc.stdin.write(job_line(sessions, script))
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fleet process ended (exit code {await self.proc.wait()})")
        return json.loads(line)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def thread_sched_s() -> tuple[float, float]:
    """Seconds this thread has run on a CPU, and waited for one while ready to run (Linux schedstat):
    how much of its time other work on the machine took."""
    with open("/proc/thread-self/schedstat") as f:
        ran, waited = f.read().split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class GatewayRun:
    scenario: Scenario
    turns: list[list[dict[str, Any]]]  # per session, per turn, as the agent saw it
    engine_calls: list[list[EngineCall]]  # per session, in turn order
    server_times: list[list[tuple[float, float]]]  # per session, per request: its body in, its answer out
    loop_lag_s: list[float]  # the gateway's event loop, every 10 ms of the run
    sessions: list[Any]  # as closed (trajectory store sessions)
    rss_before: int
    rss_peak: int
    cpu_s: float  # this process: gateway, router, simulated engines
    loop_waited_for_cpu: float  # the gateway's loop thread: time waiting for a CPU per time running
    fleet_cpu_s: float
    fleet_loop_lag_s: dict[str, float]  # p50, p99, max: how long a reply waited for the agents' loop
    wall_s: float  # the fleet's run, ramp and pauses included
    tables_open: dict[str, int]
    tables_closed: dict[str, int]
    counters: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(1 for session in self.turns for t in session if "error" not in t)

    def added_latency_s(self) -> list[float]:
        """Per turn answered: the agent's latency less the engine call's (see the module docstring)."""
        return [
            turn["latency_s"] - call.seconds
            for session, calls in zip(self.turns, self.engine_calls)
            for turn, call in zip(session, calls)
            if "error" not in turn
        ]

    def gateway_own_s(self) -> list[float]:
        """Per turn: the gateway's own time (the request's body in to the answer handed to the server)
        less the engine call's."""
        return [
            (end - start) - call.seconds
            for times, calls in zip(self.server_times, self.engine_calls)
            for (start, end), call in zip(times, calls)
        ]

    def peak_conversations(self) -> int:
        """The most sessions between their first request and their last answer at one moment."""
        edges = []
        for session in self.turns:
            answered = [t for t in session if "error" not in t]
            if answered:
                edges += [(session[0]["sent"], 1), (answered[-1]["sent"] + answered[-1]["latency_s"], -1)]
        peak = now = 0
        for _, step in sorted(edges):
            now += step
            peak = max(peak, now)
        return peak

    def engine_s(self) -> list[float]:
        return [call.seconds for calls in self.engine_calls for call in calls]

    def memory_per_session(self) -> float:
        return (self.rss_peak - self.rss_before) / self.scenario.sessions


def tables(gateway: Any, router: Any) -> dict[str, int]:
    """The sizes of everything the gateway and the router keep per session (their private fields:
    what is measured is what they hold)."""
    store = gateway.service.store
    return {
        "sessions": len(store.sessions()),
        "open_trajectory_ids": len(store._latest),
        "closed_trajectory_ids": len(store._closed),
        "router_sticky": len(router._sticky),
        "router_calls": len(router.calls),
        "router_pending": len(router._pending),
    }


def _engines(tokenizer: Any, scenario: Scenario) -> list[Any]:
    from loongsage.core.sim.engine import SimHandle
    from loongsage.core.sim.text import TextSimEngine

    return [SimHandle(TextSimEngine(tokenizer, scenario.latency, scenario.lengths)) for _ in range(scenario.engines)]


async def _sample_peak(peak: list[int], every_s: float = 0.2) -> None:
    while True:
        peak[0] = max(peak[0], rss_bytes())
        await asyncio.sleep(every_s)


async def run_gateway(tokenizer: Any, scenario: Scenario) -> GatewayRun:
    """One run (see the module docstring); the fleet process is started and ended here."""
    from loongsage.agentflow.chat.parsers import Qwen3ChatParser
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.agentflow.trajectories.store import Budget
    from loongsage.core.rollout import EngineRouter

    allow_open_files(2 * scenario.sessions + 256)
    router = EngineRouter(_engines(tokenizer, scenario))
    log = EngineLog(router)
    budget = Budget(max_context_tokens=4096, default_max_tokens=scenario.script.max_tokens)
    gateway = Gateway(ChatService(log, tokenizer, parser=Qwen3ChatParser(), budget=budget))
    server = ServerTimes(gateway.app)
    gateway.app = server  # served as it is when the gateway starts
    lag = LoopLag()
    fleet = FleetProcess()
    await fleet.start()
    await gateway.start()
    try:
        warm = [gateway.open_session(f"warm{i}") for i in range(scenario.warmup_sessions)]
        await fleet.run([(i.openai_base_url, i.api_key) for i in warm], replace(scenario.script, think_s=0, ramp_s=0))
        for info in warm:
            await gateway.close_session(info.trajectory, info.attempt)
        log.calls.clear()
        server.times.clear()
        gc.collect()
        rss_before = rss_bytes()
        peak = [rss_before]
        infos = [gateway.open_session(f"s{i}") for i in range(scenario.sessions)]
        watchers = [asyncio.ensure_future(_sample_peak(peak)), asyncio.ensure_future(lag.run())]
        cpu, sched = time.process_time(), thread_sched_s()
        out = await fleet.run([(i.openai_base_url, i.api_key) for i in infos], scenario.script)
        cpu = time.process_time() - cpu
        ran, waited = (after - before for after, before in zip(thread_sched_s(), sched))
        for watcher in watchers:
            watcher.cancel()
        peak[0] = max(peak[0], rss_bytes())
        tables_open = tables(gateway, router)
        sessions = [await gateway.close_session(i.trajectory, i.attempt) for i in infos]
        tables_closed = tables(gateway, router)
    finally:
        await gateway.stop()
        await fleet.stop()
    errors = [
        f"session {s} turn {t}: {turn['error']}"
        for s, ts in enumerate(out["turns"])
        for t, turn in enumerate(ts)
        if "error" in turn
    ]
    return GatewayRun(
        scenario=scenario,
        turns=out["turns"],
        engine_calls=[log.calls.get(f"{i.trajectory}/{i.attempt}", []) for i in infos],
        server_times=[server.times.get(f"{i.trajectory}/{i.attempt}", []) for i in infos],
        loop_lag_s=list(lag.lags),
        sessions=sessions,
        rss_before=rss_before,
        rss_peak=peak[0],
        cpu_s=cpu,
        loop_waited_for_cpu=waited / max(ran, 1e-9),
        fleet_cpu_s=out["cpu_s"],
        fleet_loop_lag_s=out["loop_lag_s"],
        wall_s=out["wall_s"],
        tables_open=tables_open,
        tables_closed=tables_closed,
        counters=gateway.service.metrics(),
        errors=errors,
    )


@dataclass
class DirectRun:
    latency_s: list[list[float]]  # per session, per turn
    cpu_s: float
    wall_s: float


async def run_direct(tokenizer: Any, scenario: Scenario, like: GatewayRun) -> DirectRun:
    """The turns of ``like`` sent straight to a router over engines of the same kind, as token ids,
    with the same pacing: each prompt as long as the gateway's was, each turn's sampling (seed and
    budget) the same, so the simulated engines decode the same lengths. No HTTP, no gateway."""
    from loongsage.core.rollout import EngineRouter
    from loongsage.core.types import SamplingParams

    router = EngineRouter(_engines(tokenizer, scenario))
    script = scenario.script
    filler = tokenizer.encode(" the sum", add_special_tokens=False)

    async def converse(s: int) -> list[float]:
        rng, latencies = random.Random(turn_seed(script, s, 999)), []
        await asyncio.sleep(s * script.ramp_s / scenario.sessions)
        for t, call in enumerate(like.engine_calls[s]):
            prompt = (filler * (call.prompt[0] // len(filler) + 1))[: call.prompt[0]]
            sampling = SamplingParams(temperature=1.0, max_new_tokens=call.max_new_tokens, seed=call.seed)
            sent = time.monotonic()
            await router.generate(prompt, sampling, session=f"s{s}/0")
            latencies.append(time.monotonic() - sent)
            if t + 1 < script.turns:
                await asyncio.sleep(script.think_s * rng.uniform(0.5, 1.5))
        router.release_session(f"s{s}/0")
        return latencies

    cpu, start = time.process_time(), time.monotonic()
    latencies = await asyncio.gather(*(converse(s) for s in range(scenario.sessions)))
    return DirectRun(list(latencies), time.process_time() - cpu, time.monotonic() - start)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
