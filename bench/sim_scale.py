"""The engine router's host CPU time as engines grow, in simulated time (``loongsage.core.sim``).

For each engine count E, 16 x E requests of long-tailed length (log-normal, median 256 tokens,
99th percentile 2,560) go through the real ``EngineRouter`` to E simulated engines (the native
engine's H200 latency model); the whole run is timed in CPU seconds of this process, and divided by
the requests. Two routers in the same run, warmed alike, each repeated ``--repeats`` times:

* ``heap``: the router as it is (least-loaded pick from a lazy heap of loads);
* ``scan``: the same router with the least-loaded pick of earlier versions (a scan of every engine
  per request), the peer this measures against.

Linear cost keeps the CPU time per request flat as E grows. (One engine slower than the others:
``bench/sim_faults.py``.)

    python bench/sim_scale.py [--engines 8 64 512 1000] [--repeats 3] [--out PATH]

Writes ``bench/results/sim_scale.json`` (or ``--out``) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from _source import source_state

from loongsage.core.rollout.router import EngineRouter
from loongsage.core.sim.clock import run_simulated
from loongsage.core.sim.engine import LengthModel, SimEngine, SimHandle
from loongsage.core.types import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "sim_scale.json"
PER_ENGINE = 16


class ScanRouter(EngineRouter):
    """The router with the least-loaded pick of earlier versions: every engine scanned per request."""

    def pick(self, session: str | None = None) -> int | None:
        if session is not None and self._sticky.get(session) not in (None, *self.down):
            return self._sticky[session]
        live = [i for i in range(len(self.engines)) if i not in self.down]
        if not live:
            return None
        index = min(live, key=lambda i: self.in_flight[i])
        if session is not None:
            self._sticky[session] = index
        return index


def one_run(router_cls: type[EngineRouter], engines: int) -> dict[str, float]:
    lengths = LengthModel(median=256, p99=2560)

    async def main():
        handles = [SimHandle(SimEngine(lengths=lengths)) for _ in range(engines)]
        router = router_cls(handles, health_timeout_s=30.0)
        sampling = [SamplingParams(temperature=1.0, max_new_tokens=4096, seed=i) for i in range(PER_ENGINE * engines)]
        cpu = time.process_time()
        await asyncio.gather(*(router.generate([1] * 128, s) for s in sampling))
        return time.process_time() - cpu, sum(h.engine.generated_tokens for h in handles)

    (cpu, tokens), seconds = run_simulated(main())
    return {"cpu_s": cpu, "cpu_us_per_request": cpu / (PER_ENGINE * engines) * 1e6, "sim_s": seconds, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 64, 512, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 timed runs per side")
    source = source_state()
    sides = {"heap": EngineRouter, "scan": ScanRouter}
    for cls in sides.values():  # warm both alike (imports, allocator)
        one_run(cls, 64)
    rows = []
    for engines in args.engines:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for _ in range(args.repeats):  # interleaved, so a drift of the host hits both sides
            for name, cls in sides.items():
                runs[name].append(one_run(cls, engines))
        row = {"engines": engines, "requests": PER_ENGINE * engines}
        for name in sides:
            per = [r["cpu_us_per_request"] for r in runs[name]]
            row[name] = {
                "cpu_us_per_request": statistics.median(per),
                "min": min(per),
                "max": max(per),
                "sim_s": runs[name][0]["sim_s"],
                "simulated_tokens_per_s": runs[name][0]["tokens"] / runs[name][0]["sim_s"],
            }
        row["scan_over_heap"] = row["scan"]["cpu_us_per_request"] / row["heap"]["cpu_us_per_request"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"source": source, "rows": rows}, indent=1))
    lines = [
        f"commit {source['commit'][:10]}; {PER_ENGINE} requests per engine, log-normal lengths (median 256, "
        f"p99 2,560 tokens); host CPU microseconds per request, median of {args.repeats} interleaved runs "
        "(min-max)",
        "",
        "| engines | requests | router (heap pick) us/request | earlier router (scan pick) us/request | scan / heap |"
        " simulated tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, s = r["heap"], r["scan"]
        lines.append(
            f"| {r['engines']} | {r['requests']:,} | {h['cpu_us_per_request']:.0f} ({h['min']:.0f}-{h['max']:.0f}) | "
            f"{s['cpu_us_per_request']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | {r['scan_over_heap']:.2f}x | "
            f"{h['simulated_tokens_per_s']:,.0f} |"
        )
    text = "\n".join(lines)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
