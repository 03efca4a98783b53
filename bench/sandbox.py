"""The ``local`` sandbox vs a plain subprocess: lifecycles per second and exec latency, one run.

Workloads, each run sequentially (one operation at a time, so the figures are latencies):

* ``exec true`` / ``exec python -c pass``: one command in an existing sandbox (``sandbox``: a
  fresh bubblewrap jail per exec, limits, uid drop, output capture) vs the same command through
  ``asyncio.create_subprocess_exec("/bin/sh", "-c", cmd)`` with the same pipes (``plain``);
* ``lifecycle``: create a sandbox, run ``true`` in it, delete it (``sandbox``: uid claim, marker,
  tmpfs mount, jail, kill sweep, unmount, removal) vs make a temporary directory, run ``true`` there,
  remove it (``plain``);
* ``create+delete``: a sandbox made and removed with no exec vs a temporary directory made and
  removed.

Each side runs every workload once to warm up (``--warmup`` operations), then the sides take
turns ``--repeats`` times (``--ops`` operations per round). Reported per workload and side:
operations/s and latency (median, p90) over rounds, and the ratio sandbox/plain of median
latencies (per repeat too). The machine is shared: read ratios; the load is recorded.

    python bench/sandbox.py [--ops 100] [--warmup 20] [--repeats 3] [--out-dir bench/results]

Needs root and bubblewrap (the backend's own check says what is missing). Writes
``<out-dir>/sandbox.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402

WORKLOADS = {"exec true": "true", "exec python -c pass": "/usr/bin/python3 -c pass", "lifecycle": "true",
             "create+delete": None}


async def plain_exec(cmd: str, cwd: str) -> None:
    proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", cmd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=cwd)
    await proc.communicate()
    assert proc.returncode == 0


class Sides:
    def __init__(self, root: Path):
        from loongsage.core.contracts import SandboxOwner
        from loongsage.sandbox.local import LocalSandbox

        self.owner = SandboxOwner("bench", "t")
        self.backend = LocalSandbox(root=str(root / "sandboxes"))
        self.scratch = root / "plain"
        self.scratch.mkdir()
        self.sandbox_id: str | None = None

    async def setup(self) -> None:
        self.sandbox_id = await self.backend.create(self.owner, time.time() + 3600)

    async def op(self, side: str, workload: str) -> None:
        cmd = WORKLOADS[workload]
        if side == "sandbox":
            if workload.startswith("exec"):
                result = await self.backend.exec(self.sandbox_id, cmd, 30)
                assert result.exit_code == 0, result
                return
            sid = await self.backend.create(self.owner, time.time() + 60)
            if cmd is not None:
                assert (await self.backend.exec(sid, cmd, 30)).exit_code == 0
            await self.backend.delete(sid)
            return
        if workload.startswith("exec"):
            await plain_exec(cmd, str(self.scratch))
            return
        folder = tempfile.mkdtemp(dir=self.scratch)
        if cmd is not None:
            await plain_exec(cmd, folder)
        shutil.rmtree(folder)

    async def round(self, side: str, workload: str, ops: int) -> dict[str, Any]:
        latencies = []
        cpu0, start = time.process_time(), time.perf_counter()
        for _ in range(ops):
            t = time.perf_counter()
            await self.op(side, workload)
            latencies.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
        return {"side": side, "workload": workload, "ops": ops, "wall_s": wall, "ops_per_s": ops / wall,
                "latency_s": latencies, "cpu_s_this_process": time.process_time() - cpu0,
                "loadavg_1m": os.getloadavg()[0]}


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "min": ordered[0], "max": ordered[-1]}


async def run(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        sides = Sides(Path(tmp))
        await sides.setup()
        rounds = []
        try:
            for workload in WORKLOADS:
                for side in ("sandbox", "plain"):  # warm-up, the same number of operations on each side
                    rounds.append({**await sides.round(side, workload, args.warmup), "warmup": True})
            for repeat in range(args.repeats):
                for workload in WORKLOADS:
                    for side in ("sandbox", "plain") if repeat % 2 == 0 else ("plain", "sandbox"):
                        r = await sides.round(side, workload, args.ops)
                        rounds.append({**r, "warmup": False, "repeat": repeat})
                        print(f"repeat {repeat} {workload:22s} {side:8s} {r['ops_per_s']:8.1f} ops/s, "
                              f"median {1000 * statistics.median(r['latency_s']):.1f} ms, load {r['loadavg_1m']:.1f}",
                              flush=True)
        finally:
            await sides.backend.close()
    return {"rounds": rounds}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in rounds if not r["warmup"]]
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        per = {side: [r for r in timed if r["workload"] == workload and r["side"] == side] for side in ("sandbox", "plain")}
        entry = {side: {"ops_per_s": stats([r["ops_per_s"] for r in rs]),
                        "latency_s": stats([x for r in rs for x in r["latency_s"]])} for side, rs in per.items()}
        pairs = list(zip(sorted(per["sandbox"], key=lambda r: r["repeat"]), sorted(per["plain"], key=lambda r: r["repeat"])))
        entry["latency_ratio_of_medians"] = entry["sandbox"]["latency_s"]["median"] / entry["plain"]["latency_s"]["median"]
        entry["latency_ratio_per_repeat"] = [statistics.median(s["latency_s"]) / statistics.median(p["latency_s"])
                                             for s, p in pairs]
        entry["added_ms_median"] = 1000 * (entry["sandbox"]["latency_s"]["median"] - entry["plain"]["latency_s"]["median"])
        out[workload] = entry
    return out


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    src, st = result["source"], result["settings"]
    lines = [f"commit `{src['commit'][:10]}` (uncommitted files: {src['uncommitted_files']}); {st['ops']} operations "
             f"per round, {st['repeats']} interleaved repeats after {st['warmup']} warm-up operations per side and "
             f"workload; sequential; {result['machine']['cpus']} cores; load (1 min) "
             f"{result['loadavg_1m_before_after'][0]:.1f} before, {result['loadavg_1m_before_after'][1]:.1f} after", "",
             "| workload | sandbox ops/s (min-max) | plain ops/s (min-max) | sandbox latency median (p90) ms | "
             "plain latency median (p90) ms | added ms | latency ratio sandbox/plain (per repeat) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    for workload, e in result["summary"].items():
        s, p = e["sandbox"], e["plain"]
        lines.append(f"| {workload} | {s['ops_per_s']['median']:.1f} ({s['ops_per_s']['min']:.1f}-{s['ops_per_s']['max']:.1f}) | "
                     f"{p['ops_per_s']['median']:.1f} ({p['ops_per_s']['min']:.1f}-{p['ops_per_s']['max']:.1f}) | "
                     f"{ms(s['latency_s']['median'])} ({ms(s['latency_s']['p90'])}) | "
                     f"{ms(p['latency_s']['median'])} ({ms(p['latency_s']['p90'])}) | {e['added_ms_median']:.1f} | "
                     f"{e['latency_ratio_of_medians']:.2f}x ({', '.join(f'{x:.2f}' for x in e['latency_ratio_per_repeat'])}) |")
    lines += ["", "`plain`: `asyncio.create_subprocess_exec('/bin/sh', '-c', cmd)` with the same pipes; for the "
              "lifecycles a temporary directory made and removed.", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    if args.ops < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--ops and --repeats must be at least 1, --warmup at least 0")
    source = source_state()  # the commit measured, taken before anything runs
    load_start = os.getloadavg()[0]
    out = asyncio.run(run(args))
    result = {"source": source, "settings": vars(args),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": len(os.sched_getaffinity(0))},
              "loadavg_1m_before_after": [load_start, os.getloadavg()[0]],
              "summary": summarize(out["rounds"]), "rounds": out["rounds"]}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sandbox.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out_dir / "sandbox.md", result)
    print((out_dir / "sandbox.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
