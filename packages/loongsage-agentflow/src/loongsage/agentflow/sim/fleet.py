"""Scripted agents: many gateway sessions at once, each a multi-turn conversation through the
official ``openai`` client, with a tool's pause between turns.

Session ``s`` starts ``s * ramp_s / sessions`` seconds in, sends its task, and per turn: waits for
the reply, pauses (its tool runs: uniform in ``[0.5, 1.5] * think_s``, seeded per session), and
answers with a message shaped like the tool's output. Every turn goes through the official
``openai`` client (its transport, headers and errors): ``chat.completions.create``, or by default
its generic ``post`` of the same body, which skips the SDK's typed-parameter walk (a third of its
CPU per turn) so that the agents' process keeps up on a small machine. Every session has an HTTP
client of its own, as a separate agent program would (one shared pool would scan all of its
connections for every request); the clients share one TLS context, which is what makes a client
costly to create.

The fleet runs in a process of its own, so that its clients' CPU is not the gateway's:
``python -m loongsage.agentflow.sim.fleet`` reads one JSON job a line
(``{"sessions": [[openai_base_url, api_key], ...], "script": {...}}``) and writes one JSON result a
line (per session, per turn: when it was sent, its latency, its reply or its error).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import resource
import sys
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any

SYSTEM = "You are a careful assistant. Work step by step and use the lookup tool when a number is unknown."
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a number up",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
}


@dataclass(frozen=True)
class Script:
    """What every session does (see the module docstring)."""

    turns: int = 3
    max_tokens: int = 48
    think_s: float = 4.0  # mean pause between turns
    ramp_s: float = 4.0  # session s starts s * ramp_s / sessions seconds in
    tools: bool = True  # offer the lookup tool on every turn
    # True: chat.completions.create, with the SDK's typed parameters and response models (about 1.7 ms
    # more of the agent's CPU a turn); False: the same request through the client's generic post
    typed: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.turns, int) and self.turns >= 1):
            raise ValueError(f"Script.turns={self.turns!r}: must be an int >= 1")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"Script.max_tokens={self.max_tokens!r}: must be an int >= 1")
        if not (self.think_s >= 0 and self.ramp_s >= 0):
            raise ValueError(f"Script: think_s={self.think_s!r} and ramp_s={self.ramp_s!r} must be >= 0")


def first_messages(s: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {s}: add {17 * s + 3} and {29 * s % 97}, then check the sum twice."},
    ]


def tool_output(s: int, t: int) -> str:
    """What session ``s``'s tool answered after reply ``t``."""
    return f'lookup(n={s + t}) returned {{"value": {(31 * s + 7 * t) % 1000}, "step": {t}}}. Continue.'


def turn_seed(script: Script, s: int, t: int) -> int:
    return (script.seed * 1_000_003 + s) * 1000 + t


async def run(sessions: list[tuple[str, str]], script: Script) -> dict[str, Any]:
    """Every session's conversation at once (see the module docstring)."""
    import ssl

    import httpx
    import openai

    allow_open_files(2 * len(sessions) + 256)
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(verify=tls, timeout=600) for _ in sessions]
    clients = [
        openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, http_client=http)
        for (url, key), http in zip(sessions, https)
    ]
    tools = [LOOKUP] if script.tools else None

    async def converse(s: int) -> list[dict[str, Any]]:
        rng, turns = random.Random(turn_seed(script, s, 999)), []
        messages = first_messages(s)
        await asyncio.sleep(s * script.ramp_s / len(sessions))
        for t in range(script.turns):
            sent = time.monotonic()
            body = {
                "model": "sim",
                "messages": messages,
                "max_tokens": script.max_tokens,
                "temperature": 1.0,
                "seed": turn_seed(script, s, t),
                **({"tools": tools} if tools else {}),
            }
            try:
                if script.typed:
                    reply = (await clients[s].chat.completions.create(**body)).model_dump(exclude_none=True)
                else:
                    reply = (await clients[s].post("/chat/completions", body=body, cast_to=httpx.Response)).json()
            except Exception as exc:  # noqa: BLE001 - reported, the conversation cannot go on
                status = getattr(exc, "status_code", None)
                turns.append({"sent": sent, "error": f"{type(exc).__name__} ({status}): {exc}"[:300]})
                return turns
            choice = reply["choices"][0]
            turns.append(
                {
                    "sent": sent,
                    "latency_s": time.monotonic() - sent,
                    "content": choice["message"]["content"],
                    "finish_reason": choice["finish_reason"],
                    "completion_tokens": reply["usage"]["completion_tokens"],
                }
            )
            if t + 1 < script.turns:
                await asyncio.sleep(script.think_s * rng.uniform(0.5, 1.5))  # the tool runs
                messages += [choice["message"], {"role": "user", "content": tool_output(s, t)}]
        return turns

    lag = asyncio.ensure_future(_loop_lag(lags := array("d")))
    # what exists now (the clients: tens of thousands of objects) is never garbage: full collections
    # that walk it all would pause every agent for tens of milliseconds
    gc.freeze()
    cpu, start = time.process_time(), time.monotonic()
    try:
        turns = await asyncio.gather(*(converse(s) for s in range(len(sessions))))
    finally:
        lag.cancel()
        await asyncio.gather(*(http.aclose() for http in https))
        gc.unfreeze()  # the next job's clients are others
    ordered = sorted(lags) or [0.0]
    return {
        "turns": turns,
        "cpu_s": time.process_time() - cpu,
        "wall_s": time.monotonic() - start,
        "loop_lag_s": {"p50": ordered[len(ordered) // 2], "p99": ordered[int(0.99 * len(ordered))], "max": ordered[-1]},
    }


async def _loop_lag(lags: array, every_s: float = 0.01) -> None:
    """How late a timer fires on the agents' loop: how long a reply that arrived waits to be read."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        lags.append(loop.time() - due)


def allow_open_files(needed: int) -> None:
    """Raise the soft limit on open files to ``needed`` (a socket per session), within the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise RuntimeError(f"open files: {needed} needed, the hard limit is {hard} (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def job_line(sessions: list[tuple[str, str]], script: Script) -> bytes:
    return (json.dumps({"sessions": sessions, "script": asdict(script)}) + "\n").encode()


def main() -> int:
    for line in sys.stdin:
        job = json.loads(line)
        result = asyncio.run(run([tuple(s) for s in job["sessions"]], Script(**job["script"])))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
