"""The rollout side against a slow engine, failing engines and a resume, in simulated time
(``loongsage.core.sim``): the real router and rollout service over simulated engines.

* ``slow_router``: 16 long-tailed requests per engine (log-normal, median 256 tokens, p99 2,560)
  through the real ``EngineRouter``, all at once, as a synchronous step sends them; the step ends
  with the last answer. All engines fast; engine 0 ten times slower with the router as it is
  (a straggler's requests also sent to idle engines, the first answer kept); and the same slow
  engine without that (``straggler_ratio=None``: the earlier router, least-loaded by count alone).
* ``slow_service``: the same three through the real rollout service, ``sync``, two sources
  (``arith`` and ``sort``, 3:1, 8 samples a prompt, half a prompt per engine per step).
* ``faults``: 1,000 engines, ``arith`` 150 and ``sort`` 50 prompts a step, 5% of the engines killed
  or silenced at random steps (while they hold requests, in a step's first 3 simulated s),
  health timeout 10 s; ``sync`` and ``windowed_fifo``: simulated seconds per batch and per weight
  update against the same run without faults, engines replaced, requests sent again.
* ``resume``: the faulty run checkpointed after step 2 (the controller's sequence, the real
  checkpoint writer and reader) and resumed over fresh engines: batches equal to the uninterrupted
  run's, in prompts (group ids and records) and in every sample (tokens, versions, rewards).

Every scenario is repeated with ``--repeats`` seeds (request seeds, the run's seed, the fault plan).

    python bench/sim_faults.py [--repeats 3] [--out PATH]

Writes ``bench/results/sim_faults.json`` (or ``--out``) and a markdown summary beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from _sim_recipe import two_sources
from _source import source_state

from loongsage.core.config import load_config
from loongsage.core.rollout.router import EngineRouter
from loongsage.core.sim.clock import run_simulated
from loongsage.core.sim.engine import LengthModel, SimEngine, SimHandle
from loongsage.core.sim.faults import random_faults
from loongsage.core.sim.rollout import scaffold_model, simulate_steps
from loongsage.core.types import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "sim_faults.json"
LENGTHS = LengthModel(median=256, p99=2560)
SLOWDOWN = 10.0
SCHEDULERS = {"sync": "{name: sync}", "windowed_fifo": "{name: windowed_fifo, params: {max_staleness: 2}}"}
SLOW_CASES = {  # name: (engine 0's slowdown, the router's straggler_ratio)
    "all_fast": (1.0, 4.0),
    "slow_hedged": (SLOWDOWN, 4.0),
    "slow_unhedged": (SLOWDOWN, None),
}


def slow_router(engines: int, seed: int, slowdown: float, ratio: float | None) -> dict[str, float]:
    async def main():
        handles = [SimHandle(SimEngine(lengths=LENGTHS, slowdown=slowdown if i == 0 else 1.0)) for i in range(engines)]
        router = EngineRouter(handles, straggler_ratio=ratio)
        first = seed * 10_000_000
        sampling = [SamplingParams(temperature=1.0, max_new_tokens=4096, seed=first + i) for i in range(16 * engines)]
        results = await asyncio.gather(*(router.generate([1] * 128, s) for s in sampling))
        assert all(len(r) == 1 for r in results)
        return router, sum(h.engine.generated_tokens for h in handles), sum(len(r[0].output_ids) for r in results)

    (router, generated, answered), seconds = run_simulated(main())
    return {
        "sim_s": seconds,
        "requests_hedged": router.requests_hedged,
        "hedges_won": router.hedges_won,
        "tokens_wasted_frac": generated / answered - 1,  # decoded by the copies that lost
    }


class Recipes:
    """Recipe folders and their loaded configs, one per (engines, scheduler, seed)."""

    def __init__(self, work: Path):
        self.work, self.model = work, scaffold_model(work / "model")

    def load(self, arith: int, sort: int, scheduler: str, seed: int):
        folder = self.work / f"{arith}-{sort}-{scheduler}-{seed}"
        folder.mkdir(exist_ok=True)
        text = two_sources(
            "sim_faults",
            model=self.model,
            arith=arith,
            sort=sort,
            scheduler=SCHEDULERS[scheduler],
            seed=seed,
            sort_max_new_tokens=2048,
            rollout={"engine_health_timeout_s": 10, "max_engine_restarts": 1000},
        )
        (folder / "sim.yaml").write_text(text)
        cfg, registry = load_config("sim", config_dir=str(folder))
        return cfg, registry, folder


def slow_service(recipes: Recipes, engines: int, steps: int, seed: int, slowdown: float, ratio: float | None):
    cfg, registry, _ = recipes.load(max(1, round(engines * 3 / 8)), max(1, round(engines / 8)), "sync", seed)
    run = simulate_steps(
        cfg,
        registry,
        recipes.model,
        engines=engines,
        steps=steps,
        train_s=4.0,
        lengths=LENGTHS,
        slowdown={0: slowdown},
        straggler_ratio=ratio,
    )
    return {
        "first_batch_s": run.step_seconds[0],  # the straggler is known from its first answer on
        "later_batches_s_mean": statistics.mean(run.step_seconds[1:]),
        "requests_hedged": run.router.requests_hedged,
    }


def _prompts(batch) -> list:
    return sorted((g[0].group_id, g[0].source, g[0].metadata["record_index"]) for g in batch[0])


def _samples(batch) -> list:
    return sorted((t.group_id, t.sample_index, t.response_ids, t.versions, t.reward) for g in batch[0] for t in g)


def faults_and_resume(recipes: Recipes, scheduler: str, seed: int, steps: int, checkpoint_at: int) -> dict:
    engines = 1000
    cfg, registry, folder = recipes.load(150, 50, scheduler, seed)
    common = dict(engines=engines, steps=steps, train_s=4.0, lengths=LENGTHS)
    clean = simulate_steps(cfg, registry, recipes.model, **common)
    plan = random_faults(engines, 0.05, range(steps), within_s=3.0, seed=seed)
    cpu = time.process_time()
    faulty = simulate_steps(
        cfg, registry, recipes.model, faults=plan, checkpoint_at=checkpoint_at, run_dir=folder / "run", **common
    )
    cpu = time.process_time() - cpu
    resumed = simulate_steps(cfg, registry, recipes.model, faults=plan, resume=True, run_dir=folder / "run", **common)
    after = faulty.batches[checkpoint_at:]
    ids = [g[0].group_id for groups, _ in faulty.batches for g in groups]
    differing = sum(
        x != y for a, b in zip(after, resumed.batches) for x, y in zip(_samples(a), _samples(b), strict=True)
    )
    return {
        "clean_batch_s_mean": statistics.mean(clean.step_seconds),
        "faulty_batch_s_mean": statistics.mean(faulty.step_seconds),
        "faulty_batch_s_max": max(faulty.step_seconds),
        "clean_update_s_max": max(clean.update_seconds),
        "faulty_update_s_max": max(faulty.update_seconds),
        "faulty_run_s": faulty.seconds,
        "clean_run_s": clean.seconds,
        "struck": {kind: sum(k == kind for *_, k in faulty.struck) for kind in ("kill", "silence")},
        "engines_replaced": faulty.router.engine_restarts,
        "replacements_generating": sum(h.calls > 0 for h in faulty.replacements),
        "requests_redispatched": faulty.router.requests_redispatched,
        "requests_hedged": [clean.router.requests_hedged, faulty.router.requests_hedged],  # equal engines: none
        "groups_trained_once": len(ids) == len(set(ids)) == steps * 200,
        "host_cpu_s_faulty_run": cpu,
        "resume": {
            "checkpoint_after_step": checkpoint_at,
            "batches_compared": len(after),
            "same_prompts": [_prompts(a) == _prompts(b) for a, b in zip(after, resumed.batches)],
            "same_samples": [_samples(a) == _samples(b) for a, b in zip(after, resumed.batches)],
            "samples_differing": differing,
            "samples_compared": sum(len(_samples(a)) for a in after),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 seeds per scenario")
    source = source_state()
    logging.getLogger("loongsage").setLevel(logging.ERROR)  # each lost engine logs two warnings
    seeds = list(range(1, args.repeats + 1))
    work = Path(tempfile.mkdtemp(prefix="sim-faults-"))
    recipes = Recipes(work)
    out: dict = {"source": source, "settings": {"slowdown": SLOWDOWN, "seeds": seeds, "lengths": [256, 2560]}}
    out["slow_router"] = {
        str(engines): {name: [slow_router(engines, s, *case) for s in seeds] for name, case in SLOW_CASES.items()}
        for engines in (64, 1000)
    }
    print(json.dumps(out["slow_router"])[:2000], flush=True)
    with contextlib.chdir(work):  # the controller's run folders go there
        out["slow_service"] = {
            name: [slow_service(recipes, 64, 6, s, *case) for s in seeds] for name, case in SLOW_CASES.items()
        }
        print(json.dumps(out["slow_service"]), flush=True)
        out["faults"] = {name: [faults_and_resume(recipes, name, s, 5, 2) for s in seeds] for name in SCHEDULERS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    text = report(out)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    """Median (min-max) over the seeds."""
    med = fmt.format(statistics.median(values))
    return med if min(values) == max(values) else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(out: dict) -> str:
    seeds = out["settings"]["seeds"]
    lines = [
        f"commit {out['source']['commit'][:10]} ({out['source']['uncommitted_files']} files uncommitted); "
        f"seeds {seeds}: median (min-max); simulated seconds",
        "",
        "One engine ten times slower, a synchronous step (16 long-tailed requests per engine at once, "
        "through the router; the step ends with the last answer):",
        "",
        "| engines | all fast, s | slow, router as it is, s | stretch | copies sent (won) | tokens decoded in vain "
        "| slow, earlier router, s | stretch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for engines, cases in out["slow_router"].items():
        fast = [r["sim_s"] for r in cases["all_fast"]]
        hedged = [r["sim_s"] for r in cases["slow_hedged"]]
        unhedged = [r["sim_s"] for r in cases["slow_unhedged"]]
        copies = [r["requests_hedged"] for r in cases["slow_hedged"]]
        won = [r["hedges_won"] for r in cases["slow_hedged"]]
        waste = [100 * r["tokens_wasted_frac"] for r in cases["slow_hedged"]]
        lines.append(
            f"| {int(engines):,} | {_span(fast)} | {_span(hedged)} | {_span([h / f for h, f in zip(hedged, fast)])}x | "
            f"{_span(copies, '{:.0f}')} ({_span(won, '{:.0f}')}) | {_span(waste, '{:.1f}')}% | {_span(unhedged)} | "
            f"{_span([u / f for u, f in zip(unhedged, fast)])}x |"
        )
    svc = out["slow_service"]
    lines += [
        "",
        "The same through the rollout service, `sync`, 64 engines, 32 prompts of 8 samples a step (one request "
        "of 8 samples per engine: the slow engine answers once a step), 6 steps; seconds to a batch:",
        "",
        "| batches | all fast | slow, router as it is | stretch | slow, earlier router | stretch |",
        "|---|---|---|---|---|---|",
    ]
    for key, what in (("first_batch_s", "the first"), ("later_batches_s_mean", "the next 5 (mean)")):
        fast = [r[key] for r in svc["all_fast"]]
        hedged = [r[key] for r in svc["slow_hedged"]]
        unhedged = [r[key] for r in svc["slow_unhedged"]]
        lines.append(
            f"| {what} | {_span(fast)} | {_span(hedged)} | {_span([h / f for h, f in zip(hedged, fast)])}x | "
            f"{_span(unhedged)} | {_span([u / f for u, f in zip(unhedged, fast)])}x |"
        )
    lines += [
        "",
        "5% of 1,000 engines killed or silenced at random steps (5 steps, 200 prompts of 8 samples a step, "
        "health timeout 10 s, trainer step 4 s), checkpointed after step 2 and resumed over fresh engines:",
        "",
        "| scheduler | batch s, clean | batch s, faults | slowest batch s, faults | slowest update s, faults | "
        "killed, silenced | replaced (generating after) | requests sent again | groups trained once | "
        "resumed: same prompts | same samples |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in out["faults"].items():
        res = [r["resume"] for r in runs]
        lines.append(
            f"| `{name}` | {_span([r['clean_batch_s_mean'] for r in runs])} | "
            f"{_span([r['faulty_batch_s_mean'] for r in runs])} | {_span([r['faulty_batch_s_max'] for r in runs])} | "
            f"{_span([r['faulty_update_s_max'] for r in runs])} | "
            f"{_span([r['struck']['kill'] for r in runs], '{:.0f}')}, "
            f"{_span([r['struck']['silence'] for r in runs], '{:.0f}')} | "
            f"{_span([r['engines_replaced'] for r in runs], '{:.0f}')} "
            f"({_span([r['replacements_generating'] for r in runs], '{:.0f}')}) | "
            f"{_span([r['requests_redispatched'] for r in runs], '{:.0f}')} | "
            f"{all(r['groups_trained_once'] for r in runs)} | "
            f"{sum(all(x['same_prompts']) for x in res)}/{len(res)} runs | "
            f"{sum(x['samples_compared'] - x['samples_differing'] for x in res):,} of "
            f"{sum(x['samples_compared'] for x in res):,} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
