"""The gateway at scale over simulated engines: 100 to 2,000 sessions at once, against the same turns
sent straight to the engine router, in the same run (``loongsage.agentflow.sim``).

Each session is a scripted agent of ``--turns`` (3) turns through the official ``openai`` client,
in a process of its own, with its tool running ``--think-s`` (10) seconds on average between turns
(uniform in half to one and a half times that); the agents start over ``--ramp-s`` (10) seconds, so
that every session of the count is in its conversation at once. The gateway (uvicorn on loopback,
the qwen3 parser) sits on the real ``EngineRouter`` over 8 ``TextSimEngine`` engines in real time
(the H200 latency model ten times faster: a reply of 16 tokens costs milliseconds). Each count's
round runs in a fresh process, as the test does (a process that served a larger round before
reuses its memory, and its resident size would not grow). Sides, in every round:

* ``gateway``: the run of ``loongsage.agentflow.sim.scale.run_gateway``;
* ``direct``: the peer, the same turns as token ids straight to a router over the same engines
  (same prompt lengths, seeds and budgets, same pacing): no HTTP, no gateway;
* at the largest count, ``keep_alive_5s`` and ``keep_alive_75s``: agents with short tools (1.5-4.5 s
  between turns, 100 started a second), whose connections sit idle about as long as clients and
  servers keep them, against the gateway with uvicorn's default keep-alive of 5 s (the setting
  before ``loongsage.agentflow.gateway.server.KEEP_ALIVE_S``) and with 75 s: the turns that failed.

Reported per side and count (median of the repeats, min-max): the latency the gateway adds to a
turn as the agent sees it (agent's latency less the engine call's), paired with the direct side's
latency for the same turn, and the gateway's own share (its app's time from the request's body in
to the answer out, less the engine call's), median and 99th percentile; resident memory per open
session; turns per second (set by the pacing) and CPU per turn of the gateway's process (gateway,
router and simulated engines) against the direct side's (router and engines), and the agents'
process's; turns that failed.

Also: the CPU cost of opening a session with 1,000 to 8,000 open, in the trajectory store as it is
and with the scan of every open session it made before (``ScanStore``, the peer).

    python bench/gateway_scale.py [--sessions 100 500 1000 2000] [--repeats 3] [--turns 3]
                                  [--think-s 10] [--ramp-s 10] [--out PATH]

Writes ``bench/results/gateway_scale.json`` (or ``--out``) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _source import source_state

from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.gateway import server
from loongsage.agentflow.sim.fleet import Script
from loongsage.agentflow.sim.scale import Scenario, percentile, run_direct, run_gateway
from loongsage.agentflow.trajectories.store import TrajectoryStore

RESULTS = Path(__file__).resolve().parent / "results" / "gateway_scale.json"
SHORT_TOOLS_THINK_S, SHORT_TOOLS_SESSIONS_PER_S = 3.0, 100.0  # the keep-alive sides' agents


class ScanStore(TrajectoryStore):
    """The store with the scan its ``open`` made before: every open session's key, per open."""

    def open(self, trajectory: str, attempt: int = 0, **kw: Any) -> Any:
        for key in [k for k in self._sessions if k[0] == trajectory]:
            self._sessions.pop(key).closed = True
        return super().open(trajectory, attempt, **kw)


def open_cost_us(store_cls: type[TrajectoryStore], already_open: int, more: int = 1000) -> float:
    """CPU microseconds per ``open`` of ``more`` sessions with ``already_open`` open."""
    store = store_cls()
    for i in range(already_open):
        store.open(f"t{i}", api_key=None)
    cpu = time.process_time()
    for i in range(more):
        store.open(f"u{i}", api_key=None)
    return (time.process_time() - cpu) / more * 1e6


# Latency targets of the gateway, seconds (checked per repeat, in the markdown): its own time per turn
# beside the engine's at the median, and at the 99th percentile, which full garbage collections set
# (they walk every open session's tokens, about 0.1 s each on two cores) and which stretches with
# the time the gateway's loop waits for a CPU that other work holds (the target grows by as much per
# second waited); the latency it adds as the agent sees it, at the median.
OWN_P50_TARGET_S, OWN_P99_TARGET_S, ADDED_P50_TARGET_S = 0.025, 0.5, 0.25


def within_targets(gateway: dict[str, Any]) -> bool:
    """Whether one round's gateway side met the latency targets."""
    own, added = gateway["own_s"], gateway["added_s"]
    return (
        own["p50"] <= OWN_P50_TARGET_S
        and own["p99"] <= OWN_P99_TARGET_S * (1 + gateway["loop_waited_for_cpu"])
        and added["p50"] <= ADDED_P50_TARGET_S
    )


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def gateway_figures(run: Any) -> dict[str, Any]:
    added, own, engine = run.added_latency_s(), run.gateway_own_s(), run.engine_s()
    turns = max(run.answered, 1)
    return {
        "turns": run.answered,
        "failed": len(run.errors),
        "first_errors": run.errors[:3],
        "wall_s": run.wall_s,
        "turns_per_s": run.answered / run.wall_s,
        "peak_conversations": run.peak_conversations(),
        "added_s": {"p50": percentile(added, 0.5), "p99": percentile(added, 0.99)} if added else None,
        "own_s": {"p50": percentile(own, 0.5), "p99": percentile(own, 0.99)} if own else None,
        "engine_s": {"p50": percentile(engine, 0.5), "p99": percentile(engine, 0.99)} if engine else None,
        "memory_per_session_kib": run.memory_per_session() / 1024,
        "cpu_ms_per_turn": 1000 * run.cpu_s / turns,
        "agents_cpu_ms_per_turn": 1000 * run.fleet_cpu_s / turns,
        "loop_lag_s": {"gateway_p99": percentile(run.loop_lag_s, 0.99), "agents": run.fleet_loop_lag_s},
        "loop_waited_for_cpu": run.loop_waited_for_cpu,
        "tables_open": run.tables_open,
        "tables_closed": run.tables_closed,
        "per_turn_latency_s": [[t["latency_s"] for t in session if "error" not in t] for session in run.turns],
    }


def direct_figures(run: Any) -> dict[str, Any]:
    latencies = [x for session in run.latency_s for x in session]
    turns = max(len(latencies), 1)
    return {
        "turns": len(latencies),
        "wall_s": run.wall_s,
        "turns_per_s": len(latencies) / run.wall_s,
        "latency_s": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)},
        "cpu_ms_per_turn": 1000 * run.cpu_s / turns,
        "per_turn_latency_s": run.latency_s,
    }


def paired_added(gateway: dict[str, Any], direct: dict[str, Any]) -> list[float]:
    """Per turn: the agent's latency through the gateway less the direct side's for the same turn."""
    return [
        g - d for gs, ds in zip(gateway["per_turn_latency_s"], direct["per_turn_latency_s"]) for g, d in zip(gs, ds)
    ]


def round_in_process(count: int, args: argparse.Namespace, sides: list[str]) -> dict[str, Any]:
    """One round in a fresh process: its memory, heap and collector start as the test's do, not
    as an earlier, larger round left them."""
    argv = [sys.executable, __file__, "--round", str(count), "--turns", str(args.turns), "--sides", ",".join(sides)]
    argv += ["--think-s", str(args.think_s), "--ramp-s", str(args.ramp_s)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"round of {count} sessions failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run_round(count: int, args: argparse.Namespace, sides: list[str]) -> dict[str, Any]:
    from loongsage.core.tinytask.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3_TOOLS_TEMPLATE
    return asyncio.run(one_round(tokenizer, count, args, sides))


async def one_round(tokenizer: Any, count: int, args: argparse.Namespace, sides: list[str]) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {}
    scenario = Scenario(sessions=count, script=Script(turns=args.turns, think_s=args.think_s, ramp_s=args.ramp_s))
    run = await run_gateway(tokenizer, scenario)
    out["gateway"] = gateway_figures(run)
    out["direct"] = direct_figures(await run_direct(tokenizer, scenario, run))
    del run
    short = Script(turns=args.turns, think_s=SHORT_TOOLS_THINK_S, ramp_s=count / SHORT_TOOLS_SESSIONS_PER_S)
    for side, keep_alive in (("keep_alive_5s", 5), ("keep_alive_75s", 75)):
        if side in sides:
            server.KEEP_ALIVE_S, kept = keep_alive, server.KEEP_ALIVE_S
            try:
                out[side] = gateway_figures(await run_gateway(tokenizer, replace(scenario, script=short)))
            finally:
                server.KEEP_ALIVE_S = kept
    paired = paired_added(out["gateway"], out["direct"])
    out["gateway"]["paired_added_s"] = {"p50": percentile(paired, 0.5), "p99": percentile(paired, 0.99)}
    for side in out.values():  # the figures above came from the per-turn lists, not kept
        side.pop("per_turn_latency_s", None)
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_count: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_count.setdefault(row["sessions"], []).append(row["sides"])
    summary = {}
    for count, rounds in sorted(by_count.items()):
        g = [r["gateway"] for r in rounds]
        d = [r["direct"] for r in rounds]
        entry = {
            "added_p50_ms": spread([1000 * x["added_s"]["p50"] for x in g]),
            "added_p99_ms": spread([1000 * x["added_s"]["p99"] for x in g]),
            "own_p50_ms": spread([1000 * x["own_s"]["p50"] for x in g]),
            "own_p99_ms": spread([1000 * x["own_s"]["p99"] for x in g]),
            "paired_added_p50_ms": spread([1000 * x["paired_added_s"]["p50"] for x in g]),
            "memory_per_session_kib": spread([x["memory_per_session_kib"] for x in g]),
            "turns_per_s": spread([x["turns_per_s"] for x in g]),
            "cpu_ms_per_turn": spread([x["cpu_ms_per_turn"] for x in g]),
            "direct_cpu_ms_per_turn": spread([x["cpu_ms_per_turn"] for x in d]),
            "cpu_ratio_per_repeat": [x["cpu_ms_per_turn"] / y["cpu_ms_per_turn"] for x, y in zip(g, d)],
            "agents_cpu_ms_per_turn": spread([x["agents_cpu_ms_per_turn"] for x in g]),
            "direct_latency_p50_ms": spread([1000 * x["latency_s"]["p50"] for x in d]),
            "peak_conversations": spread([x["peak_conversations"] for x in g]),
            "failed_turns": [x["failed"] for x in g],
            "within_latency_targets": [within_targets(x) for x in g],
            "loop_waited_for_cpu": [x["loop_waited_for_cpu"] for x in g],
            "closed_trajectory_ids": [x["tables_closed"]["closed_trajectory_ids"] for x in g],
        }
        entry["gateway_cpu_ms_per_turn_over_direct"] = (
            entry["cpu_ms_per_turn"]["median"] - entry["direct_cpu_ms_per_turn"]["median"]
        )
        for side in ("keep_alive_5s", "keep_alive_75s"):
            runs = [r[side] for r in rounds if side in r]
            if runs:
                entry[side] = {
                    "failed_turns": [x["failed"] for x in runs],
                    "first_errors": next((x["first_errors"] for x in runs if x["first_errors"]), []),
                    "added_p99_ms": spread([1000 * x["added_s"]["p99"] for x in runs]),
                }
        summary[count] = entry
    return summary


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    src, st, summary = result["source"], result["settings"], result["summary"]
    r = lambda s, f=".1f": f"{s['median']:{f}} ({s['min']:{f}}-{s['max']:{f}})"  # noqa: E731
    lines = [
        f"commit `{src['commit'][:10]}` (uncommitted files: {src['uncommitted_files']}); {st['turns']} turns a "
        f"session, a tool of {st['think_s'] / 2:g}-{1.5 * st['think_s']:g} s between turns, the agents started over "
        f"{st['ramp_s']:g} s; 8 simulated "
        f"engines (H200 model / 10, replies median 16, p99 48 tokens); official openai client (generic post) in "
        f"a process of its own; {st['repeats']} interleaved repeats, median (min-max); "
        f"{result['machine']['affinity']} cores, load (1 min) {result['load_before_after'][0]:.1f} before, "
        f"{result['load_before_after'][1]:.1f} after",
        "",
        "| sessions | conversations at once | added per turn, agent's view: p50 / p99 ms | gateway's own: p50 / p99 ms"
        " | added, paired with direct: p50 ms | memory per session KiB | turns/s | CPU ms per turn: gateway process"
        " / direct (router + engines) / agents' process | failed turns |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for count, e in summary.items():
        lines.append(
            f"| {int(count):,} | {e['peak_conversations']['median']:,.0f} | {r(e['added_p50_ms'])} / "
            f"{r(e['added_p99_ms'], '.0f')} | {r(e['own_p50_ms'])} / {r(e['own_p99_ms'])} | "
            f"{r(e['paired_added_p50_ms'])} | {r(e['memory_per_session_kib'])} | {r(e['turns_per_s'], '.0f')} | "
            f"{r(e['cpu_ms_per_turn'], '.2f')} / {r(e['direct_cpu_ms_per_turn'], '.2f')} / "
            f"{r(e['agents_cpu_ms_per_turn'], '.2f')} | {sum(e['failed_turns'])} |"
        )
    lines += [
        "",
        f"Latency targets, per repeat (the gateway's own p50 <= {1000 * OWN_P50_TARGET_S:g} ms and p99 <= "
        f"{OWN_P99_TARGET_S:g} s per second its loop ran, plus as much per second it waited for a CPU; added p50 "
        f"<= {1000 * ADDED_P50_TARGET_S:g} ms):",
        "",
    ]
    for count, e in summary.items():
        waited = ", ".join(f"{x:.2f}" for x in e["loop_waited_for_cpu"])
        met = ", ".join("met" if x else "not met" for x in e["within_latency_targets"])
        lines.append(f"- {int(count):,} sessions: {met} (the loop waited for a CPU {waited} s per s)")
    lines += ["", "CPU per turn, gateway process over direct (ratio per repeat):", ""]
    for count, e in summary.items():
        ratios = ", ".join(f"{x:.2f}x" for x in e["cpu_ratio_per_repeat"])
        lines.append(
            f"- {int(count):,} sessions: +{e['gateway_cpu_ms_per_turn_over_direct']:.2f} ms a turn ({ratios}); "
            f"closed trajectory ids kept: {e['closed_trajectory_ids']}"
        )
    for count, e in summary.items():
        if "keep_alive_5s" in e:
            k5, k75 = e["keep_alive_5s"], e["keep_alive_75s"]
            lines += [
                "",
                f"Agents with short tools (1.5-4.5 s between turns, {SHORT_TOOLS_SESSIONS_PER_S:.0f} started a "
                f"second), {int(count):,} sessions, {int(count) * st['turns']:,} turns a run: failed turns with "
                f"uvicorn's default keep-alive of 5 s (the earlier setting) {k5['failed_turns']}, with 75 s "
                f"{k75['failed_turns']}; first: {k5['first_errors'][:1]}",
            ]
    lines += [
        "",
        "Opening a session, CPU us per open (median of 3), by sessions already open:",
        "",
        "| open | store as it is | earlier scan of every open session | scan / now |",
        "|---|---|---|---|",
    ]
    for row in result["open_cost"]:
        lines.append(
            f"| {row['open']:,} | {row['now_us']:.1f} | {row['scan_us']:.1f} | {row['scan_us'] / row['now_us']:.1f}x |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 500, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--think-s", type=float, default=10.0, help="mean seconds of a tool between turns")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="the agents start over this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--round", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sides", default="gateway,direct", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.round is not None:  # one round, in this fresh process: its figures as one JSON line
        print(json.dumps(run_round(args.round, args, args.sides.split(","))))
        return
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 runs per side")
    if min(args.sessions) < 1 or args.turns < 1 or args.think_s < 0 or args.ramp_s < 0:
        parser.error("--sessions and --turns must be >= 1, --think-s and --ramp-s >= 0")
    source = source_state()  # the commit measured, before anything runs
    load_before = os.getloadavg()[0]

    largest = max(args.sessions)
    rows = []
    for repeat in range(args.repeats):
        for count in args.sessions:
            sides = ["gateway", "direct"] + (["keep_alive_5s", "keep_alive_75s"] if count == largest else [])
            out = round_in_process(count, args, sides)
            rows.append({"repeat": repeat, "sessions": count, "sides": out})
            g = out["gateway"]
            print(
                f"repeat {repeat + 1} sessions {count}: added p50 {1000 * g['added_s']['p50']:.1f} ms p99 "
                f"{1000 * g['added_s']['p99']:.0f} ms, own p50 {1000 * g['own_s']['p50']:.1f} ms, "
                f"{g['memory_per_session_kib']:.1f} KiB/session, cpu {g['cpu_ms_per_turn']:.2f} ms/turn "
                f"(direct {out['direct']['cpu_ms_per_turn']:.2f}), failed {g['failed']}"
                + (
                    f", short tools: failed at keep-alive 5 s {out['keep_alive_5s']['failed']}, at 75 s "
                    f"{out['keep_alive_75s']['failed']}"
                    if "keep_alive_5s" in out
                    else ""
                ),
                flush=True,
            )
    open_cost = []
    for already in (1000, 2000, 4000, 8000):
        now = statistics.median(open_cost_us(TrajectoryStore, already) for _ in range(3))
        scan = statistics.median(open_cost_us(ScanStore, already) for _ in range(3))
        open_cost.append({"open": already, "now_us": now, "scan_us": scan})
    import openai
    import uvicorn

    result = {
        "source": source,
        "settings": {
            "sessions": args.sessions,
            "repeats": args.repeats,
            "turns": args.turns,
            "think_s": args.think_s,
            "ramp_s": args.ramp_s,
            "short_tools": {"think_s": SHORT_TOOLS_THINK_S, "sessions_per_s": SHORT_TOOLS_SESSIONS_PER_S},
            "engines": 8,
            "keep_alive_s": server.KEEP_ALIVE_S,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": {"openai": openai.__version__, "uvicorn": uvicorn.__version__},
        "load_before_after": [load_before, os.getloadavg()[0]],
        "rows": rows,
        "open_cost": open_cost,
    }
    result["summary"] = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(args.out.with_suffix(".md"), result)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
