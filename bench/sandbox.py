"""A sandbox backend vs a plain subprocess: lifecycles per second and exec latency, one run.

``--backend local`` (the default) or ``--backend docker --docker-url unix:///...`` (any Docker
Engine API; Podman's service here). With ``docker`` a third side, ``raw``, does the same through the
``docker`` client directly (a container made, started and removed with the same options; one
``exec_run``): what the engine itself costs, so ``sandbox/raw`` is the backend's own overhead.

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

WORKLOADS = {
    "exec true": "true",
    "exec python -c pass": "/usr/bin/python3 -c pass",
    "lifecycle": "true",
    "create+delete": None,
}


async def plain_exec(cmd: str, cwd: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
    )
    await proc.communicate()
    assert proc.returncode == 0


class Sides:
    def __init__(self, root: Path, backend: str, docker_url: str | None):
        from loongsage.core.contracts import SandboxOwner

        self.owner = SandboxOwner("bench", "t")
        if backend == "docker":
            from loongsage.sandbox.docker_backend import DockerSandbox

            self.backend = DockerSandbox(base_url=docker_url)
            self.names = ("sandbox", "plain", "raw")
        else:
            from loongsage.sandbox.local import LocalSandbox

            self.backend = LocalSandbox(root=str(root / "sandboxes"))
            self.names = ("sandbox", "plain")
        self.scratch = root / "plain"
        self.scratch.mkdir()
        self.sandbox_id: str | None = None
        self.raw_container = None

    async def setup(self) -> None:
        self.sandbox_id = await self.backend.create(self.owner, time.time() + 3600)
        if "raw" in self.names:
            self.raw_container = await asyncio.to_thread(self._raw_create)

    def _raw_create(self):
        """A container as the backend makes one, through the client alone (no set-up exec)."""
        from docker.types import Ulimit

        from loongsage.sandbox.docker_image import host_mounts

        lim = self.backend.limits  # a container's limits cost nothing per call; some hosts need them set
        ulimits = [
            Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
            Ulimit(name="nproc", soft=lim.processes, hard=lim.processes),
        ]
        container = self.backend.client.containers.create(
            ulimits=ulimits,
            pids_limit=lim.processes,
            mem_limit=lim.memory_mb << 20,
            image=self.backend.image,
            command=["/bin/sh", "-c", "sleep infinity"],
            network_mode="none",
            read_only=True,
            volumes=host_mounts(),
            tmpfs={"/work": "size=16m", "/tmp": "size=16m"},
            labels={"loongsage.bench": "1"},
            **({"runtime": self.backend.runtime} if self.backend.runtime else {}),
        )
        container.start()
        return container

    def _raw(self, cmd: str | None, lifecycle: bool) -> None:
        container = self._raw_create() if lifecycle else self.raw_container
        if cmd is not None:
            code, _ = container.exec_run(["/bin/sh", "-c", cmd], workdir="/work", user="1000:1000", demux=True)
            assert code == 0, code
        if lifecycle:
            container.remove(force=True)

    async def close(self) -> None:
        await self.backend.close()
        if self.raw_container is not None:
            await asyncio.to_thread(self.raw_container.remove, force=True)

    async def op(self, side: str, workload: str) -> None:
        cmd = WORKLOADS[workload]
        if side == "raw":
            await asyncio.to_thread(self._raw, cmd, not workload.startswith("exec"))
            return
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
        return {
            "side": side,
            "workload": workload,
            "ops": ops,
            "wall_s": wall,
            "ops_per_s": ops / wall,
            "latency_s": latencies,
            "cpu_s_this_process": time.process_time() - cpu0,
            "loadavg_1m": os.getloadavg()[0],
        }


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "min": ordered[0],
        "max": ordered[-1],
    }


async def run(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        sides = Sides(Path(tmp), args.backend, args.docker_url)
        await sides.setup()
        rounds = []
        try:
            for workload in WORKLOADS:
                for side in sides.names:  # warm-up, the same number of operations on each side
                    rounds.append({**await sides.round(side, workload, args.warmup), "warmup": True})
            for repeat in range(args.repeats):
                for workload in WORKLOADS:
                    for side in sides.names if repeat % 2 == 0 else reversed(sides.names):
                        r = await sides.round(side, workload, args.ops)
                        rounds.append({**r, "warmup": False, "repeat": repeat})
                        print(
                            f"repeat {repeat} {workload:22s} {side:8s} {r['ops_per_s']:8.1f} ops/s, "
                            f"median {1000 * statistics.median(r['latency_s']):.1f} ms, load {r['loadavg_1m']:.1f}",
                            flush=True,
                        )
        finally:
            await sides.close()
    return {"rounds": rounds, "sides": list(sides.names)}


def summarize(rounds: list[dict[str, Any]], sides: list[str]) -> dict[str, Any]:
    timed = [r for r in rounds if not r["warmup"]]
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        per = {
            side: sorted(
                [r for r in timed if r["workload"] == workload and r["side"] == side], key=lambda r: r["repeat"]
            )
            for side in sides
        }
        entry = {
            side: {
                "ops_per_s": stats([r["ops_per_s"] for r in rs]),
                "latency_s": stats([x for r in rs for x in r["latency_s"]]),
            }
            for side, rs in per.items()
        }
        for peer in sides[1:]:
            suffix = "" if peer == "plain" else f"_vs_{peer}"
            entry[f"latency_ratio_of_medians{suffix}"] = (
                entry["sandbox"]["latency_s"]["median"] / entry[peer]["latency_s"]["median"]
            )
            entry[f"latency_ratio_per_repeat{suffix}"] = [
                statistics.median(s["latency_s"]) / statistics.median(p["latency_s"])
                for s, p in zip(per["sandbox"], per[peer])
            ]
            entry[f"added_ms_median{suffix}"] = 1000 * (
                entry["sandbox"]["latency_s"]["median"] - entry[peer]["latency_s"]["median"]
            )
        out[workload] = entry
    return out


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    src, st = result["source"], result["settings"]
    lines = [
        f"commit `{src['commit'][:10]}` (uncommitted files: {src['uncommitted_files']}); {st['ops']} operations "
        f"per round, {st['repeats']} interleaved repeats after {st['warmup']} warm-up operations per side and "
        f"workload; sequential; {result['machine']['cpus']} cores; load (1 min) "
        f"{result['loadavg_1m_before_after'][0]:.1f} before, {result['loadavg_1m_before_after'][1]:.1f} after",
        "",
        "| workload | sandbox ops/s (min-max) | plain ops/s (min-max) | sandbox latency median (p90) ms | "
        "plain latency median (p90) ms | added ms | latency ratio sandbox/plain (per repeat) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    for workload, e in result["summary"].items():
        s, p = e["sandbox"], e["plain"]
        lines.append(
            f"| {workload} | {s['ops_per_s']['median']:.1f} "
            f"({s['ops_per_s']['min']:.1f}-{s['ops_per_s']['max']:.1f}) | "
            f"{p['ops_per_s']['median']:.1f} ({p['ops_per_s']['min']:.1f}-{p['ops_per_s']['max']:.1f}) | "
            f"{ms(s['latency_s']['median'])} ({ms(s['latency_s']['p90'])}) | "
            f"{ms(p['latency_s']['median'])} ({ms(p['latency_s']['p90'])}) | {e['added_ms_median']:.1f} | "
            f"{e['latency_ratio_of_medians']:.2f}x ({', '.join(f'{x:.2f}' for x in e['latency_ratio_per_repeat'])}) |"
        )
    if "raw" in result["sides"]:
        lines += [
            "",
            "| workload | raw client ops/s | raw latency median (p90) ms | sandbox/raw latency (per repeat) |",
            "|---|---:|---:|---|",
        ]
        for workload, e in result["summary"].items():
            r = e["raw"]
            lines.append(
                f"| {workload} | {r['ops_per_s']['median']:.1f} | {ms(r['latency_s']['median'])} "
                f"({ms(r['latency_s']['p90'])}) | {e['latency_ratio_of_medians_vs_raw']:.2f}x "
                f"({', '.join(f'{x:.2f}' for x in e['latency_ratio_per_repeat_vs_raw'])}) |"
            )
    lines += [
        "",
        f"backend `{result['settings']['backend']}`. `plain`: `asyncio.create_subprocess_exec('/bin/sh', "
        "'-c', cmd)` with the same pipes; for the lifecycles a temporary directory made and removed. `raw` "
        "(docker): the `docker` client alone, the same container options, `exec_run`.",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    ap.add_argument("--backend", choices=("local", "docker"), default="local")
    ap.add_argument("--docker-url", default=None, help="the Docker Engine API (default: DOCKER_HOST)")
    args = ap.parse_args()
    if args.ops < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--ops and --repeats must be at least 1, --warmup at least 0")
    source = source_state()  # the commit measured, taken before anything runs
    load_start = os.getloadavg()[0]
    out = asyncio.run(run(args))
    result = {
        "source": source,
        "settings": vars(args),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "loadavg_1m_before_after": [load_start, os.getloadavg()[0]],
        "sides": out["sides"],
        "summary": summarize(out["rounds"], out["sides"]),
        "rounds": out["rounds"],
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "sandbox" if args.backend == "local" else f"sandbox.{args.backend}"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out_dir / f"{name}.md", result)
    print((out_dir / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
