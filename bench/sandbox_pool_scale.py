"""The sandbox pool at 100 to 1,000 leases: the scenario of ``tests/sandbox/test_pool_scale.py``
(``tests/sandbox/pool_churn.py``) timed.

All leases call ``acquire`` at once against a pool of ``--cap`` sandboxes of the real ``local``
backend (4 warm, reuse on); each runs ``echo`` of its name and ``sleep --command-s`` in a real jail,
then releases; a quarter are cancelled at a random stage. Reported per number of leases, median
over ``--repeats`` runs (sizes interleaved, so a drift of the host hits all alike) with min-max:

* wait for a lease (acquire called to acquire returned): p50 and p99;
* leases per second (all leases over the wall time until the last one ended);
* CPU milliseconds per lease: this process (pool, backend, event loop) and the jails' processes;
* the checks of the test: leases overtaken by a later one (0: first come, first served), leases
  that waited past the work queued ahead of them (Graham's bound + 0.25 s), the most sandbox
  directories on disk at once (against the cap), failures.

The cap sets the pace: the wall time is close to the leases' sandbox-time over the cap. What a
pool with work per waiter shows is CPU per lease growing with the number of leases (every release
then touches every waiter); flat is linear.

    python bench/sandbox_pool_scale.py [--leases 100 500 1000] [--repeats 3] [--cap 16]
        [--command-s 0.2] [--variant NAME] [--note TEXT]

Needs root and bubblewrap. Writes ``bench/results/sandbox_pool_scale[.<variant>].json`` and ``.md``.
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
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # the churn scenario lives with the test that asserts on it
from _source import source_state  # noqa: E402

SLACK_S = 0.25  # as in the test


def one_run(leases: int, cap: int, command_s: float, seed: int) -> dict[str, Any]:
    from tests.sandbox.conftest import SMALL
    from tests.sandbox.pool_churn import churn

    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        root = Path(tmp) / "sandboxes"
        result = asyncio.run(churn(root, SMALL, leases=leases, cap=cap, command_s=command_s, seed=seed))
    summary = result.summary()
    summary["over_wait_bound"] = len(result.wait_bound_excess(SLACK_S))
    summary["loadavg_1m"] = os.getloadavg()[0]
    return summary


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "wait_p50_s": spread([r["wait_s"]["p50"] for r in runs]),
        "wait_p99_s": spread([r["wait_s"]["p99"] for r in runs]),
        "leases_per_s": spread([r["leases_per_s"] for r in runs]),
        "cpu_ms_per_lease": spread([r["cpu_ms_per_lease"] for r in runs]),
        "children_cpu_ms_per_lease": spread([r["children_cpu_ms_per_lease"] for r in runs]),
        "lease_s_mean": spread([r["lease_s_mean"] for r in runs]),
        "overtaken_max": max(r["overtaken"] for r in runs),
        "over_wait_bound_max": max(r["over_wait_bound"] for r in runs),
        "max_dirs_on_disk": max(r["max_dirs_on_disk"] for r in runs),
        "failed_max": max(r["failed"] for r in runs),
    }


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    src, st = result["source"], result["settings"]
    lines = [
        f"commit `{src['commit'][:10]}` (uncommitted files: {src['uncommitted_files']}); "
        f"{result['machine']['cpus']} cores; cap {st['cap']} sandboxes (4 warm, reuse on), command "
        f"`echo; sleep {st['command_s']}`, a quarter of the leases cancelled; median of {st['repeats']} "
        f"interleaved runs (min-max); load (1 min) {result['loadavg_1m_before_after'][0]:.1f} before, "
        f"{result['loadavg_1m_before_after'][1]:.1f} after" + (f". {st['note']}" if st["note"] else ""),
        "",
        "| leases | wait p50 s | wait p99 s | leases/s | CPU ms/lease (pool process) | CPU ms/lease (jails) |"
        " overtaken | over the wait bound | most dirs on disk (cap) | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(s: dict[str, float], digits: int) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    for row in result["rows"]:
        a = row["aggregate"]
        lines.append(
            f"| {row['leases']} | {cell(a['wait_p50_s'], 2)} | {cell(a['wait_p99_s'], 2)} | "
            f"{cell(a['leases_per_s'], 1)} | {cell(a['cpu_ms_per_lease'], 2)} | "
            f"{cell(a['children_cpu_ms_per_lease'], 2)} | {a['overtaken_max']} | {a['over_wait_bound_max']} | "
            f"{a['max_dirs_on_disk']} ({st['cap']}) | {a['failed_max']} |"
        )
    lines += [
        "",
        "overtaken, over the wait bound, most dirs and failed: the worst of the runs. Wait bound: a "
        "lease gets room once the sandbox-time of the leases ahead of it, spread over the cap, is "
        f"spent (Graham's list-scheduling bound) + {SLACK_S} s.",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, nargs="+", default=[100, 500, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--command-s", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", default="", help="a suffix of the result files' names (a variant measured)")
    ap.add_argument("--note", default="", help="a sentence on what the variant is, for the table's header")
    ap.add_argument("--out-dir", type=Path, default=BENCH / "results")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error(f"--repeats={args.repeats}: at least 3 runs per size")
    if min(args.leases) < 1 or args.cap < 1 or not 0 < args.command_s < 60:
        ap.error("--leases and --cap must be positive, --command-s between 0 and 60 seconds")
    source = source_state()  # the commit measured, taken before anything runs
    load_start = os.getloadavg()[0]
    one_run(50, args.cap, args.command_s, args.seed)  # warm-up: imports, the first jails
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.leases}
    for repeat in range(args.repeats):
        for n in args.leases if repeat % 2 == 0 else reversed(args.leases):
            r = one_run(n, args.cap, args.command_s, args.seed + repeat)
            runs[n].append(r)
            print(
                f"repeat {repeat} leases {n:5d}: wait p50 {r['wait_s']['p50']:.2f} s p99 {r['wait_s']['p99']:.2f} s, "
                f"{r['leases_per_s']:.1f} leases/s, {r['cpu_ms_per_lease']:.2f} ms CPU/lease, "
                f"overtaken {r['overtaken']}, dirs {r['max_dirs_on_disk']}, load {r['loadavg_1m']:.1f}",
                flush=True,
            )
    result = {
        "source": source,
        "settings": vars(args) | {"out_dir": str(args.out_dir)},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "loadavg_1m_before_after": [load_start, os.getloadavg()[0]],
        "rows": [{"leases": n, "aggregate": aggregate(runs[n]), "runs": runs[n]} for n in args.leases],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "sandbox_pool_scale" + (f".{args.variant}" if args.variant else "")
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(args.out_dir / f"{name}.md", result)
    print((args.out_dir / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
