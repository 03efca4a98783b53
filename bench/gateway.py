"""The chat gateway vs token ids straight to the engine: concurrent multi-turn sessions, one run.

``--sessions`` (64) scripted conversations run at once, each ``--turns`` (4) turns: a system
message and a task (one tool offered, ``--tools 0``: none), then per turn a sampled reply
(``--max-tokens``, temperature 1, a fixed seed per session and turn) followed by the next scripted
user message (text shaped like a tool's output). All sides use one native engine over the embedded
tiny Qwen3 (built offline; agentflow's tools template and qwen3 chat parser), in this process:

* ``gateway``: one official ``openai.AsyncOpenAI`` client per session, over loopback HTTP to the
  real gateway (uvicorn; ``Gateway(ChatService(DirectEngine(engine), ...))``), streaming off; the
  clients run on the event loop of the gateway and the engine, as the ``chat`` agent's do.
* ``direct``: the same turns as token ids to the same engine client
  (``DirectEngine.generate(input_ids, sampling, session=...)``), every session at once, each
  session's turns in order. The input ids and sampling of every turn are the ones the engine got
  from the gateway in its warm-up round (a thin recording wrapper between gateway and engine):
  every side generates the same tokens from the same prefixes. The direct side tokenizes nothing;
  it is the engine's cost alone.
* ``gateway_ext``: as ``gateway``, with the clients in a process of their own (started once,
  before anything is timed), as an agent program's would be.
* ``gateway_stream`` (``--stream``): as ``gateway`` with ``stream=True``.

Each side runs once on the full workload to warm up, then the sides take turns ``--repeats``
times (``--sides`` order, a gateway side first). The engine's retained prefixes are flushed before
every round, so no side reuses another's cache (within a round, a session's later turns reuse its
earlier ones on every side alike).

Checked every round: each gateway turn's prompt extends the previous turn's prompt and the tokens
sampled for it (TITO), the gateway counted every later turn as appended (no new segment), and the
tokens each side generated equal those of the first warm-up round, turn by turn.

Reported, per side: turns/s (median and min-max over rounds) and its ratio to ``direct`` (ratio of
the medians, and per repeat); the capacity ratio: turns per CPU second of this process (the
engine's) against ``direct``'s (ratio of the medians, and per repeat); CPU per turn of this
process, split into the engine's steps and the rest (HTTP, gateway, in-process clients, the event
loop), and of the client process; latency per turn (request sent -> response parsed; for a stream,
its last chunk), and the latency a turn adds: gateway latency minus the direct latency of the same
session and turn in the same repeat (median and p90), the difference of the median latencies, and
the gateway turn's latency outside its engine call.

The goal (0.8x the direct turns/s) concerns ``gateway_ext``: agents are programs of their own
(sandboxes, other machines), so the ``openai`` SDK's CPU (~3 ms per turn, more than the gateway's
own) is not spent in the engine's process, while ``gateway`` charges it there (reported beside, as
the worst case). ``gateway_ext`` needs cores the engine's process does not use: on two cores shared
with other work its turns/s mostly measure how soon each process is scheduled after the other
answered, so run it on free cores (``taskset``). Capacity (turns per CPU second of the engine's
process) is reported beside: the throughput once the engine's core is the bottleneck.

    python bench/gateway.py [--sessions 64] [--turns 4] [--max-tokens 32] [--repeats 3] [--stream]
                            [--sides gateway,direct,gateway_ext] [--threads 1] [--quick]
                            [--out-dir bench/results] [--suffix NAME]

Writes ``<out-dir>/gateway[.SUFFIX].json`` and ``.md`` (``--quick``: 8 sessions, 2 turns, 1
repeat, under ``bench/work/gateway_quick/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402

from loongsage.agentflow.sim.fleet import LOOKUP, first_messages  # noqa: E402  (the same conversation)

NAME = "gateway"
SIDES = {
    "gateway": "gateway, clients in the engine's process and event loop",
    "direct": "token ids straight to the engine client",
    "gateway_ext": "gateway, clients in a process of their own",
    "gateway_stream": "gateway, stream=True, clients in the engine's process",
}


def follow_up(s: int, t: int) -> str:
    """The scripted message after reply ``t``: shaped like a tool's output, then a nudge."""
    return (
        f'lookup(n={s + t}) returned {{"value": {(31 * s + 7 * t) % 1000}, "step": {t}}}. Continue with the next step.'
    )


def seed_of(s: int, t: int) -> int:
    return 1000 * s + t


class Recorder:
    """Between the gateway and the engine client: keeps each call's input ids, sampling, output ids
    and the seconds the engine took, per session, in turn order."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, {}

    async def generate(self, input_ids, sampling, session=None):
        start = time.perf_counter()
        results = await self.inner.generate(input_ids, sampling, session)
        self.calls.setdefault(session, []).append(
            {
                "input_ids": list(input_ids),
                "sampling": sampling,
                "output_ids": list(results[0].output_ids),
                "engine_s": time.perf_counter() - start,
            }
        )
        return results

    def release_session(self, session):
        self.inner.release_session(session)


# ------------------------------------------------------------------------------------------ sides
async def converse(infos: list[tuple[str, str]], args, stream: bool) -> dict[str, Any]:
    """Every session's scripted conversation at once, one ``AsyncOpenAI`` client per session
    (``infos``: base URL and key of each); per session and turn the latency from the request sent
    to the response parsed (for a stream: to its last chunk)."""
    import openai

    clients = [openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600) for url, key in infos]
    tools = [LOOKUP] * bool(args.tools)

    async def one(s: int) -> list[float]:
        client, latencies = clients[s], []
        messages: list[dict[str, Any]] = first_messages(s)
        for t in range(args.turns):
            kwargs = dict(
                model="tiny",
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=1.0,
                seed=seed_of(s, t),
                **({"tools": tools} if tools else {}),
            )
            start = time.perf_counter()
            if stream:
                content, reasoning = [], []
                async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                    for choice in chunk.choices:
                        content.append(choice.delta.content or "")
                        reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
                reply = {"role": "assistant", "content": "".join(content)}
                if "".join(reasoning):
                    reply["reasoning_content"] = "".join(reasoning)
            else:
                r = await client.chat.completions.create(**kwargs)
                reply = r.choices[0].message.model_dump(exclude_none=True)
            latencies.append(time.perf_counter() - start)
            if reply.get("tool_calls"):  # the tiny model does not write calls; a stray one would need a tool result
                raise RuntimeError(f"session {s} turn {t}: unexpected tool call {reply['tool_calls']}")
            messages += [reply, {"role": "user", "content": follow_up(s, t)}]
        return latencies

    start_cpu, start = time.process_time(), time.perf_counter()  # the clients exist already, as an agent's would
    try:
        latencies = await asyncio.gather(*(one(s) for s in range(len(infos))))
        return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu, "latency_s": latencies}
    finally:
        for c in clients:
            await c.close()


def client_worker() -> int:
    """``--client-worker``: run conversations for the parent, one JSON job per stdin line, one JSON
    result per stdout line (the clients then use a process and an interpreter of their own, as an
    agent program's would)."""
    for line in sys.stdin:
        job = json.loads(line)
        out = asyncio.run(converse([tuple(i) for i in job["infos"]], argparse.Namespace(**job["args"]), job["stream"]))
        print(json.dumps(out), flush=True)
    return 0


class ClientProcess:
    """The parent's end of a :func:`client_worker` (started once, before anything is timed)."""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client-worker", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )

    async def converse(self, infos, args, stream: bool) -> dict[str, Any]:
        job = {
            "infos": infos,
            "stream": stream,
            "args": {"turns": args.turns, "max_tokens": args.max_tokens, "tools": args.tools},
        }
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process ended (exit code {await self.proc.wait()})")
        return json.loads(line)

    async def stop(self) -> None:
        self.proc.stdin.close()
        await self.proc.wait()


async def gateway_round(
    gw, recorder: Recorder, args, tag: str, stream: bool, clients: ClientProcess | None = None
) -> dict[str, Any]:
    """All sessions through the gateway at once, the clients in this process (on the gateway's
    and the engine's event loop) or in ``clients``' process."""
    infos = [gw.open_session(f"{tag}-s{s}") for s in range(args.sessions)]
    urls = [(i.openai_base_url, i.api_key) for i in infos]
    before = dict(gw.service.counters)
    if clients is None:  # the CPU of this process while the conversations ran: engine, gateway and clients
        out = await converse(urls, args, stream)
    else:  # this process (engine and gateway) apart from the client process's own
        start_cpu = time.process_time()
        out = await clients.converse(urls, args, stream)
        out["client_cpu_s"], out["cpu_s"] = out["cpu_s"], time.process_time() - start_cpu
    calls = [recorder.calls.pop(f"{i.trajectory}/{i.attempt}") for i in infos]
    for i in infos:
        await gw.close_session(i.trajectory, i.attempt)
    counters = {k: v - before.get(k, 0) for k, v in gw.service.counters.items() if v != before.get(k, 0)}
    return {
        **out,
        "calls": calls,
        "gateway_counters": counters,
        "engine_s": [[c["engine_s"] for c in session] for session in calls],
    }


async def direct_round(engine, replay: list[list[dict[str, Any]]], args) -> dict[str, Any]:
    """The recorded turns as token ids to the engine client, every session at once, turns in order."""

    async def one(s: int) -> tuple[list[float], list[list[int]]]:
        latencies, outputs = [], []
        for _turn, call in enumerate(replay[s]):
            start = time.perf_counter()
            results = await engine.generate(call["input_ids"], replace(call["sampling"]), session=f"direct-s{s}")
            latencies.append(time.perf_counter() - start)
            outputs.append(list(results[0].output_ids))
        return latencies, outputs

    start_cpu, start = time.process_time(), time.perf_counter()
    done = await asyncio.gather(*(one(s) for s in range(args.sessions)))
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return {"wall_s": wall, "cpu_s": cpu, "latency_s": [d[0] for d in done], "outputs": [d[1] for d in done]}


# ------------------------------------------------------------------------------------------ checks
def tito_violations(calls: list[list[dict[str, Any]]]) -> int:
    """Turns whose prompt does not start with the previous prompt plus the tokens sampled for it."""
    bad = 0
    for session in calls:
        for prev, cur in zip(session, session[1:]):
            bad += (
                cur["input_ids"][: len(prev["input_ids"]) + len(prev["output_ids"])]
                != prev["input_ids"] + prev["output_ids"]
            )
    return bad


def mismatches(reference: list[list[list[int]]], outputs: list[list[list[int]]]) -> int:
    """Turns whose generated tokens differ from the reference's (a turn missing on either side counts)."""
    missing = abs(sum(map(len, reference)) - sum(map(len, outputs)))
    return missing + sum(a != b for ra, rb in zip(reference, outputs) for a, b in zip(ra, rb))


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "n": len(ordered),
    }


def engine_counters(native) -> dict[str, int]:
    return {k: native._stats[k] for k in ("steps", "generated_tokens", "prefill_tokens", "prefix_hit_tokens")}


def time_steps(native) -> dict[str, float]:
    """Count the CPU seconds of the engine's steps (forward, sampling, bookkeeping): the rest of a
    round's CPU is what surrounds the engine (HTTP, gateway, clients, the event loop)."""
    spent, step = {"cpu_s": 0.0}, native._step

    def timed(batch):
        start = time.thread_time()
        try:
            return step(batch)
        finally:
            spent["cpu_s"] += time.thread_time() - start

    native._step = timed  # the scheduler calls self._step: the instance's attribute comes first
    return spent


# ------------------------------------------------------------------------------------------ main
async def run(args) -> dict[str, Any]:
    import torch

    from loongsage.agentflow.chat.parsers import Qwen3ChatParser
    from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
    from loongsage.agentflow.gateway.engines import DirectEngine
    from loongsage.agentflow.gateway.server import Gateway
    from loongsage.agentflow.gateway.service import ChatService
    from loongsage.agentflow.trajectories.store import Budget
    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.tinytask.tiny_model import build_tiny_qwen3

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_gateway_")
    _, tokenizer = build_tiny_qwen3(tmp, max_position_embeddings=args.max_model_len)
    tokenizer.chat_template = QWEN3_TOOLS_TEMPLATE
    native = NativeEngine(tmp, max_model_len=args.max_model_len, max_batch_size=args.sessions)
    step_time = time_steps(native)
    engine = DirectEngine(native)
    recorder = Recorder(engine)
    budget = Budget(max_context_tokens=args.max_model_len, default_max_tokens=args.max_tokens)
    gw = Gateway(ChatService(recorder, tokenizer, parser=Qwen3ChatParser(), budget=budget))
    await gw.start()
    # which HTTP parser uvicorn picked ("auto": httptools when installed, else the pure-Python h11)
    http = gw._server.config.http_protocol_class.__name__
    sides = args.sides
    clients = ClientProcess() if "gateway_ext" in sides else None
    if clients:
        await clients.start()
    rounds: list[dict[str, Any]] = []
    reference: list[list[list[int]]] | None = None
    replay: list[list[dict[str, Any]]] | None = None
    try:
        for k in range(-1, args.repeats):  # k = -1: the warm-up round of every side, not timed
            for side in sides:
                native.flush_cache()
                counters0, step_cpu0 = engine_counters(native), step_time["cpu_s"]
                if side == "direct":
                    out = await direct_round(engine, replay, args)
                else:
                    out = await gateway_round(
                        gw,
                        recorder,
                        args,
                        f"r{k + 1}-{side}",
                        side == "gateway_stream",
                        clients if side == "gateway_ext" else None,
                    )
                    calls = out.pop("calls")
                    out["outputs"] = [[c["output_ids"] for c in session] for session in calls]
                    out["tito_violations"] = tito_violations(calls)
                    out["prompt_tokens_last_turn"] = stats([len(s[-1]["input_ids"]) for s in calls])
                    if replay is None:
                        replay = calls
                if reference is None:
                    reference = out["outputs"]
                out["token_mismatched_turns"] = mismatches(reference, out["outputs"])
                out["generated_tokens"] = sum(len(o) for session in out.pop("outputs") for o in session)
                out["engine_counters"] = {k2: v - counters0[k2] for k2, v in engine_counters(native).items()}
                out["engine_step_cpu_s"] = step_time["cpu_s"] - step_cpu0
                out.update(
                    side=side,
                    repeat=k,
                    warmup=k < 0,
                    turns=args.sessions * args.turns,
                    turns_per_s=args.sessions * args.turns / out["wall_s"],
                    loadavg_1m=os.getloadavg()[0],
                )
                rounds.append(out)
                print(
                    f"{'warm-up' if k < 0 else f'repeat {k + 1}'} {side:>14}: {out['wall_s']:.2f} s, "
                    f"{out['turns_per_s']:.1f} turns/s, cpu {out['cpu_s']:.2f} s, "
                    f"{out['engine_counters']['steps']} engine steps, "
                    f"mismatched turns {out['token_mismatched_turns']}, load {out['loadavg_1m']:.1f}",
                    flush=True,
                )
    finally:
        if clients:
            await clients.stop()
        await gw.stop()
    return {
        "rounds": rounds,
        "sides": sides,
        "uvicorn_http": http,
        "reference_tokens": reference,
        "replayed_prompt_tokens": [[len(c["input_ids"]) for c in s] for s in replay],
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    timed = [r for r in result["rounds"] if not r["warmup"]]
    by_side = {side: [r for r in timed if r["side"] == side] for side in result["sides"]}
    summary: dict[str, Any] = {"sides": {}}
    for side, rs in by_side.items():
        summary["sides"][side] = {
            "turns_per_s": stats([r["turns_per_s"] for r in rs]),
            "wall_s": stats([r["wall_s"] for r in rs]),
            "cpu_s_per_turn": stats([r["cpu_s"] / r["turns"] for r in rs]),
            "engine_step_cpu_s_per_turn": stats([r["engine_step_cpu_s"] / r["turns"] for r in rs]),
            "other_cpu_s_per_turn": stats([(r["cpu_s"] - r["engine_step_cpu_s"]) / r["turns"] for r in rs]),
            "latency_s": stats([x for r in rs for session in r["latency_s"] for x in session]),
            "engine_steps": stats([r["engine_counters"]["steps"] for r in rs]),
            "prefix_hit_tokens": stats([r["engine_counters"]["prefix_hit_tokens"] for r in rs]),
            "generated_tokens": [r["generated_tokens"] for r in rs],
            "token_mismatched_turns": sum(r["token_mismatched_turns"] for r in rs),
        }
        if all("client_cpu_s" in r for r in rs):
            summary["sides"][side]["client_process_cpu_s_per_turn"] = stats(
                [r["client_cpu_s"] / r["turns"] for r in rs]
            )
    direct = summary["sides"]["direct"]
    for side in (s for s in result["sides"] if s != "direct"):
        s = summary["sides"][side]
        pairs = list(zip(by_side[side], by_side["direct"]))  # rounds of the same repeat
        added = [g - d for rg, rd in pairs for sg, sd in zip(rg["latency_s"], rd["latency_s"]) for g, d in zip(sg, sd)]
        outside = [
            lat - eng
            for r in by_side[side]
            for sl, se in zip(r["latency_s"], r["engine_s"])
            for lat, eng in zip(sl, se)
        ]
        s["vs_direct"] = {
            "turns_per_s_ratio_of_medians": s["turns_per_s"]["median"] / direct["turns_per_s"]["median"],
            "turns_per_s_ratio_per_repeat": [rg["turns_per_s"] / rd["turns_per_s"] for rg, rd in pairs],
            "cpu_per_turn_ratio_of_medians": s["cpu_s_per_turn"]["median"] / direct["cpu_s_per_turn"]["median"],
            "capacity_ratio_of_medians": direct["cpu_s_per_turn"]["median"] / s["cpu_s_per_turn"]["median"],
            "capacity_ratio_per_repeat": [rd["cpu_s"] / rg["cpu_s"] for rg, rd in pairs],
            "added_cpu_ms_per_turn": 1000 * (s["cpu_s_per_turn"]["median"] - direct["cpu_s_per_turn"]["median"]),
            "added_latency_paired_s": stats(added),
            "added_latency_median_difference_s": s["latency_s"]["median"] - direct["latency_s"]["median"],
            "latency_outside_engine_call_s": stats(outside),
        }
        s["tito_violations"] = sum(r["tito_violations"] for r in by_side[side])
        s["gateway_counters"] = by_side[side][0]["gateway_counters"]
    summary["tokens_match"] = all(v["token_mismatched_turns"] == 0 for v in summary["sides"].values())
    return summary


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    summ, st = result["summary"], result["settings"]
    sides = summ["sides"]
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    source = result["source"]
    lines = [
        f"commit `{source['commit'][:10]}` (uncommitted files: {source['uncommitted_files']}); "
        f"{st['sessions']} sessions x {st['turns']} turns, max_tokens {st['max_tokens']}, tools offered: "
        f"{st['tools']}; {st['repeats']} interleaved repeats after one warm-up round per side; "
        f"torch threads {st['threads']}; uvicorn {result['uvicorn_http']}; {result['machine']['affinity']} "
        f"cores; load (1 min) "
        f"{result['loadavg_1m_before_after'][0]:.1f} before, {result['loadavg_1m_before_after'][1]:.1f} after",
        "",
    ]
    lines += [f"- `{side}`: {SIDES[side]}" for side in sides] + [""]
    lines += [
        "| side | turns/s median (min-max) | vs direct | capacity vs direct (turns per CPU s, engine's "
        "process) | CPU ms/turn, engine's process: all = engine steps + rest | CPU ms/turn, client process | "
        "latency/turn median (p90) ms | engine steps | tokens generated | turns with other tokens |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for side, s in sides.items():
        tps, lat = s["turns_per_s"], s["latency_s"]
        ratio = s["vs_direct"]["turns_per_s_ratio_of_medians"] if "vs_direct" in s else 1.0
        capacity = s["vs_direct"]["capacity_ratio_of_medians"] if "vs_direct" in s else 1.0
        cpu = (
            f"{ms(s['cpu_s_per_turn']['median'])} = {ms(s['engine_step_cpu_s_per_turn']['median'])} + "
            f"{ms(s['other_cpu_s_per_turn']['median'])}"
        )
        client = ms(s["client_process_cpu_s_per_turn"]["median"]) if "client_process_cpu_s_per_turn" in s else "-"
        lines.append(
            f"| {side} | {tps['median']:.1f} ({tps['min']:.1f}-{tps['max']:.1f}) | {ratio:.2f}x | "
            f"{capacity:.2f}x | {cpu} | "
            f"{client} | {ms(lat['median'])} ({ms(lat['p90'])}) | {s['engine_steps']['median']:.0f} | "
            f"{s['generated_tokens'][0]} | {s['token_mismatched_turns']} |"
        )
    lines += [
        "",
        "| side | ratio per repeat: turns/s; capacity | added CPU ms/turn (engine's process) | "
        "added latency/turn, paired: median (p90) ms | difference of median latencies ms | "
        "latency outside the engine call: median (p90) ms "
        "| TITO violations | turns: new segments, appended |",
        "|---|---|---:|---|---:|---|---:|---|",
    ]
    for side, s in sides.items():
        if "vs_direct" not in s:
            continue
        v = s["vs_direct"]
        a, o = v["added_latency_paired_s"], v["latency_outside_engine_call_s"]
        cats = ", ".join(
            f"{k.removeprefix('segments/')} {n}"
            for k, n in s["gateway_counters"].items()
            if k.startswith(("segments/", "turns_appended"))
        )
        lines.append(
            f"| {side} | {', '.join(f'{x:.2f}' for x in v['turns_per_s_ratio_per_repeat'])}; "
            f"{', '.join(f'{x:.2f}' for x in v['capacity_ratio_per_repeat'])} | "
            f"{v['added_cpu_ms_per_turn']:.1f} | {ms(a['median'])} ({ms(a['p90'])}) | "
            f"{ms(v['added_latency_median_difference_s'])} | {ms(o['median'])} ({ms(o['p90'])}) | "
            f"{s['tito_violations']} | {cats} |"
        )
    lines += ["", f"Generated tokens equal on every side and round, turn by turn: **{summ['tokens_match']}**.", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", type=int, default=1, choices=[0, 1], help="offer one tool on every turn (1) or none")
    ap.add_argument(
        "--sides",
        default="gateway,direct,gateway_ext",
        help="comma-separated, in the order each repeat runs them; a gateway side first (the direct "
        f"side replays its warm-up): {', '.join(SIDES)}",
    )
    ap.add_argument("--stream", action="store_true", help="add the side gateway_stream")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 sessions, 2 turns, 1 repeat, under bench/work/")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--suffix", default="", help="write gateway.SUFFIX.json/.md (a variant beside the main result)")
    ap.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_worker:
        return client_worker()
    args.sides = [x for x in args.sides.split(",") if x] + ["gateway_stream"] * args.stream
    if (
        (unknown := set(args.sides) - set(SIDES))
        or "direct" not in args.sides
        or args.sides[0] == "direct"
        or len(set(args.sides)) != len(args.sides)
    ):
        ap.error(
            f"--sides {','.join(args.sides)}: each of {', '.join(SIDES)} at most once, direct among them and not "
            f"first{f' (unknown: {sorted(unknown)})' if unknown else ''}"
        )
    if args.quick:
        args.sessions, args.turns, args.repeats = 8, 2, 1
    out_dir = args.out_dir or (BENCH / "work" / f"{NAME}_quick" if args.quick else BENCH / "results")

    source = source_state()  # the commit measured, taken before anything runs
    load_start = os.getloadavg()[0]
    result = asyncio.run(run(args))
    import openai
    import torch
    import uvicorn

    result = {
        "source": source,
        "settings": {
            "sessions": args.sessions,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "tools": args.tools,
            "sides": args.sides,
            "threads": args.threads,
            "max_model_len": args.max_model_len,
            "quick": args.quick,
            "sampling": "temperature 1.0, seed 1000 * session + turn",
            "model": "tiny Qwen3 (build_tiny_qwen3 defaults), QWEN3_TOOLS_TEMPLATE, qwen3 chat parser",
        },
        "loadavg_1m_before_after": [load_start, os.getloadavg()[0]],
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": {"torch": torch.__version__, "openai": openai.__version__, "uvicorn": uvicorn.__version__},
        **result,
    }
    result["summary"] = summarize(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = f"{NAME}.{args.suffix}" if args.suffix else NAME
    (out_dir / f"{base}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out_dir / f"{base}.md", result)
    print((out_dir / f"{base}.md").read_text())
    print(f"wrote {out_dir / base}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
