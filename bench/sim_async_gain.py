"""Asynchronous against synchronous rollout at 8 to 1,000 simulated engines, long-tailed lengths,
through the real rollout service (``loongsage.core.sim.rollout``), and the service's host CPU time.

The recipe: two sources (``arith`` and ``sort``, 3:1, 8 samples a prompt, half a prompt per engine
per step), lengths log-normal with median 256 and 99th percentile 2,560 tokens, engines with the
native engine's H200 latency model, a trainer step of ``--train-s`` simulated seconds. For each
engine count, ``--steps`` steps run under ``sync`` and under ``no_window`` (staleness 1). Reported:
simulated seconds per step of each and their ratio (the async gain: deterministic, the same in
every repeat), and the host CPU seconds the rollout side spent per step (median of ``--repeats``).

    python bench/sim_async_gain.py [--engines 8 64 512 1000] [--steps 6] [--train-s 4] [--repeats 3]

Writes ``bench/results/sim_async_gain.json`` (or ``--out``) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _sim_recipe import two_sources
from _source import source_state

from loongsage.core.config import load_config
from loongsage.core.sim.engine import LengthModel
from loongsage.core.sim.rollout import scaffold_model, simulate_steps

RESULTS = Path(__file__).resolve().parent / "results" / "sim_async_gain.json"
SCHEDULERS = {"sync": "{name: sync}", "no_window": "{name: no_window, params: {max_staleness: 1}}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 64, 512, 1000])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--train-s", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 timed runs per side")
    source = source_state()
    work = Path(tempfile.mkdtemp(prefix="sim-async-gain-"))
    model = scaffold_model(work / "model")
    lengths = LengthModel(median=256, p99=2560)
    rows = []
    for engines in args.engines:
        arith, sort = max(1, round(engines * 3 / 8)), max(1, round(engines / 8))
        row = {"engines": engines, "groups_per_step": arith + sort, "trajectories_per_step": 8 * (arith + sort)}
        for name, scheduler in SCHEDULERS.items():
            folder = work / f"{name}-{engines}"
            folder.mkdir()
            recipe = two_sources("sim_async_gain", model=model, arith=arith, sort=sort, scheduler=scheduler)
            (folder / "sim.yaml").write_text(recipe)
            cfg, registry = load_config("sim", config_dir=str(folder))
            simulated, cpu = set(), []
            for _ in range(args.repeats):
                start = time.process_time()
                run = simulate_steps(
                    cfg, registry, model, engines=engines, steps=args.steps, train_s=args.train_s, lengths=lengths
                )
                cpu.append((time.process_time() - start) / args.steps)
                simulated.add(round(run.seconds, 6))
            assert len(simulated) == 1, f"a simulated run changed between repeats: {simulated}"
            row[name] = {
                "simulated_s_per_step": simulated.pop() / args.steps,
                "host_cpu_s_per_step": statistics.median(cpu),
                "host_cpu_min_max": [min(cpu), max(cpu)],
            }
        row["async_gain"] = row["sync"]["simulated_s_per_step"] / row["no_window"]["simulated_s_per_step"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"steps": args.steps, "train_s": args.train_s, "lengths": {"median": 256, "p99": 2560}}
    args.out.write_text(json.dumps({"source": source, "settings": settings, "rows": rows}, indent=1))
    lines = [
        f"commit {source['commit'][:10]}; {args.steps} steps, trainer step {args.train_s:g} simulated s, lengths "
        "log-normal (median 256, p99 2,560 tokens), half a prompt of 8 samples per engine per step; host CPU: "
        f"median of {args.repeats} runs",
        "",
        "| engines | trajectories / step | sync s / step | no_window s / step | async gain | host CPU s / step "
        "(sync, no_window) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, a = r["sync"], r["no_window"]
        lines.append(
            f"| {r['engines']} | {r['trajectories_per_step']:,} | {s['simulated_s_per_step']:.2f} | "
            f"{a['simulated_s_per_step']:.2f} | {r['async_gain']:.2f}x | {s['host_cpu_s_per_step']:.3f}, "
            f"{a['host_cpu_s_per_step']:.3f} |"
        )
    text = "\n".join(lines)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
