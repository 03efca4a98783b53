"""Asynchronous vs synchronous rollout on CPU, and TRL's GRPOTrainer on the same mixed workload.

One bench run trains the recipe's warm start (default ``tiny/mixed_async_cpu``: two sources,
``arith`` with 1-3 token answers and ``sort`` with 4-21) many times, one run after another, never
two at once:

* through the real launcher (``loongsage train <recipe> key=value ...`` in a subprocess, read back
  from ``runs/<name>/metrics.jsonl``), once per rollout scheduler: ``sync`` and the asynchronous
  ``one_step_off``, ``no_window``, ``window_gated``, ``windowed_fifo`` (``max_staleness`` η from
  ``--max-staleness``, default 1), selected by the override ``rollout.scheduler={name: ..., params: ...}``;
* TRL's ``GRPOTrainer`` on CPU (``bench/_trl_side.py``) on the same start model and the same prompts
  in the same order: every step's records of both sources as the launcher's mixer draws them (the
  mixer is replayed here with the run's seed), P_arith + P_sort prompts x G samples per optimizer
  step, one reward function that scores each completion with its own source's reward (the
  framework's ``exact_match`` / ``digit_sort`` plugins). TRL has one sampling configuration and one
  ``max_completion_length`` for the whole batch: it gets the larger of the sources' max new tokens
  and the sampling settings of that (longest) source; the launcher gives every source its own.

Each configuration runs ``--repeats`` times, interleaved (sync, one_step_off, ..., TRL, then again);
repeat ``k`` uses run seed ``run.seed + k`` on every side (so the spread across repeats includes seed
noise, and all configurations of one repeat see the same prompts). Per run: the steady-state step
time leaves out the first ``--warmup-steps`` steps and every step that follows an evaluation (an
asynchronous rollout keeps generating while the evaluation runs, so that step would start with a
full buffer), on every side alike; trajectories/s = trajectories / seconds summed over those steps.
Across repeats: median and min-max; ratios vs ``sync`` and vs TRL (paired per repeat, and of the
medians). Learning: per source, the training reward of every step
(``rollout_per_ds/<source>/reward_mean``) and greedy held-out accuracy every ``--eval-every`` steps
(``eval/<source>/accuracy``; TRL: the shared HF-``generate`` helper of ``_trl_side.py`` with each
source's max new tokens and reward).

    uv run --group bench python bench/async_vs_sync.py             # 3 repeats x 6 configurations
    uv run --group bench python bench/async_vs_sync.py --quick     # smoke test, under bench/work/

Outputs: ``bench/results/async_vs_sync.{json,md,png}`` (``--quick`` writes to
``bench/work/async_vs_sync_quick/`` instead). Working files go under ``bench/work/``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402
from cpu_vs_trl import grpo_loss  # noqa: E402

NAME = "async_vs_sync"
SCHEDULERS = ("sync", "one_step_off", "no_window", "window_gated", "windowed_fifo")
TRL = "trl"


# ----------------------------------------------------------------------------- settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="tiny/mixed_async_cpu", help="recipe name under recipes/ or a YAML path")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved (default 3)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out greedy eval every N steps (default 10)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per source (default: evaluation.max_prompts)")
    p.add_argument("--max-staleness", type=int, default=1, help="η of no_window / window_gated / windowed_fifo")
    p.add_argument(
        "--schedulers",
        default=",".join(SCHEDULERS),
        help=f"comma-separated schedulers to run (default {','.join(SCHEDULERS)}); sync is the baseline",
    )
    p.add_argument("--no-trl", action="store_true", help="leave TRL out")
    p.add_argument("--same-seed", action="store_true", help="every repeat with the recipe's run.seed")
    p.add_argument(
        "--first-repeat",
        type=int,
        default=0,
        help="number of the first repeat (seed run.seed + it): repeats can run as separate benches, "
        "say one per pair of cores (taskset), and be joined with --merge",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="train nothing: join the runs of bench results of the same commit and settings (separate "
        "repeats) into <out-dir>/async_vs_sync.{json,md,png}",
    )
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the steady state (default 3)")
    p.add_argument(
        "--max-load",
        type=float,
        help="before each run, wait while the 1-minute load average is above this (default: 2 x cores; "
        "0 = never wait), at most --max-wait-s",
    )
    p.add_argument("--max-wait-s", type=float, default=20.0, help="longest wait for the load to drop (default 20)")
    p.add_argument("--warm-start-steps", type=int, help="override model.builder.params.steps (development)")
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other recipe override; applied to every side (repeatable)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 4 steps, 1 repeat, eval every 2 steps on 16 prompts, 40-step warm start",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rebuild the markdown and plot from <out-dir>/async_vs_sync.json",
    )
    p.add_argument("--out-dir", type=Path, help="where the json/md/png go (default bench/results)")
    p.add_argument(
        "--export-commit",
        metavar="REV",
        help="measure a clean export of commit REV (git archive under bench/work/src/), not the working "
        "tree: the bench re-runs itself from there with that tree's packages first on PYTHONPATH",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.eval_every = min(args.steps, 4), 1, 2
        args.eval_prompts = args.eval_prompts or 16
        args.warm_start_steps = args.warm_start_steps or 40
        args.warmup_steps = min(args.warmup_steps, 1)
    args.schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    unknown = [s for s in args.schedulers if s not in SCHEDULERS]
    if unknown or "sync" not in args.schedulers:
        p.error(f"--schedulers: {unknown or 'sync missing'} (allowed {', '.join(SCHEDULERS)}; sync is required)")
    if args.out_dir is None:
        args.out_dir = BENCH / "work" / f"{NAME}_quick" if args.quick else BENCH / "results"
    return args


def configurations(args: argparse.Namespace) -> list[str]:
    return [*args.schedulers, *([] if args.no_trl else [TRL])]


def scheduler_override(name: str, eta: int) -> str:
    """The launcher override that selects a scheduler (η only where the scheduler takes it)."""
    if name in ("sync", "one_step_off"):  # η fixed by the scheduler: 0 and 1
        return f"rollout.scheduler={{name: {name}}}"  # another name: the recipe's params do not carry over
    return f"rollout.scheduler={{name: {name}, params: {{max_staleness: {eta}}}}}"


def training_overrides(args: argparse.Namespace, seed: int | None) -> list[str]:
    """Overrides that change what is trained (every side); the scheduler is added per configuration."""
    out = [f"run.total_steps={args.steps}", f"evaluation.every_steps={args.eval_every}"]
    if args.eval_prompts is not None:
        out.append(f"evaluation.max_prompts={args.eval_prompts}")
    if args.warm_start_steps is not None:
        out.append(f"model.builder.params.steps={args.warm_start_steps}")
    if seed is not None:
        out.append(f"run.seed={seed}")
    return out + list(args.extra)


def bench_overrides(run_root: Path, run_name: str) -> list[str]:
    """Launcher-only overrides: where outputs go and what is logged; nothing that changes training."""
    return [
        f"run.name={run_name}",
        f"run.output_dir={run_root / 'runs'}",
        f"run.log_dir={run_root / 'log'}",
        "evaluation.pass_k=0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "tracking.backends=[jsonl]",
        "tracking.progress=false",
    ]


def unsupported(msg: str) -> SystemExit:
    return SystemExit(f"{NAME}: the TRL side cannot reproduce this recipe: {msg}")


def extract_settings(cfg: Any, registry: Any) -> dict[str, Any]:
    """Per-source and shared settings from the validated config; refuse what TRL cannot mirror."""
    sources = []
    for i, src in enumerate(cfg.data_sources):
        agent = registry.create("agent", src.agent, f"data_sources[{i}].agent")
        if src.agent.get("name") != "single_turn" or getattr(agent, "prompt_template", None) != "chat":
            raise unsupported(f"{src.name}: agent {src.agent} (single_turn with prompt_template: chat expected)")
        sampling = cfg.sampling_for(src)
        if sampling.stop_token_ids:
            raise unsupported(f"{src.name}: sampling.stop_token_ids (TRL stops at eos only)")
        if src.eval_reader is None:
            raise unsupported(f"{src.name}: no eval_reader (held-out accuracy needs one)")
        registry.create("reward", src.reward, f"data_sources[{i}].reward")  # validates the spec
        sources.append(
            {
                "name": src.name,
                "prompts": src.prompts_per_step,
                "samples": src.samples_per_prompt,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "min_p": sampling.min_p,
                "max_new_tokens": sampling.max_new_tokens,
                "reward": {"name": src.reward["name"], "params": dict(src.reward.get("params") or {})},
                "reader": src.reader,
                "eval_reader": src.eval_reader,
            }
        )
    if len({s["samples"] for s in sources}) != 1:
        raise unsupported("samples_per_prompt differs between sources (TRL has one num_generations)")
    alg = cfg.algorithm
    adv, loss = grpo_loss(cfg, registry, unsupported)
    if alg.filters:
        raise unsupported("filters")
    # decoupled PPO's behaviour weight: about 1 on-policy, it matters for stale samples; TRL has none, so
    # it runs plain GRPO while the launcher keeps the recipe's correction (and pays its extra forward pass)
    ours_only = [dict(c) for c in alg.corrections]
    if any(c.get("name") != "decoupled" for c in ours_only):
        raise unsupported(f"corrections {ours_only} (only 'decoupled', kept on the launcher side, is handled)")
    tr = cfg.trainer
    if tr.mini_batches_per_step != 1 or tr.world_size != 1 or cfg.rollout.num_engines != 1:
        raise unsupported("mini_batches_per_step, world_size and num_engines must be 1")
    if cfg.model.dtype != "float32":
        raise unsupported(f"model.dtype={cfg.model.dtype} (float32 expected on CPU)")
    if cfg.placement.colocate:
        raise SystemExit(
            f"{NAME}: asynchronous schedulers need placement.colocate=false (pass --set placement.colocate=false)"
        )
    # TRL: one sampling configuration for the batch: the longest source's, with its max length
    longest = max(sources, key=lambda s: s["max_new_tokens"])
    opt = tr.optimizer
    return {
        "sources": sources,
        "ours_only_corrections": ours_only,
        "prompts_per_step": sum(s["prompts"] for s in sources),
        "samples": sources[0]["samples"],
        "trajectories_per_step": sum(s["prompts"] * s["samples"] for s in sources),
        "trl_sampling_from": longest["name"],
        "lr": opt.lr,
        "warmup_steps": opt.warmup_steps,
        "betas": list(opt.betas),
        "adam_eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
        "clip_low": loss.clip_low,
        "clip_high": loss.clip_high,
        "std_normalize": adv.std_normalize,
        "advantage_eps": adv.eps,
        "eval_every": cfg.evaluation.every_steps,
        "eval_prompts": cfg.evaluation.max_prompts,
        "model_builder": cfg.model.builder,
        "micro_batch_tokens": tr.micro_batch_tokens,
        "placement": {
            "colocate": cfg.placement.colocate,
            "cpus_per_actor": cfg.placement.cpus_per_actor,
            "torch_threads": cfg.placement.torch_threads,
        },
    }


def trl_settings(settings: dict[str, Any], steps: int, seed: int) -> dict[str, Any]:
    """The flat settings ``_trl_side.py`` reads, plus ``sources`` (reward and eval length per source)."""
    longest = next(s for s in settings["sources"] if s["name"] == settings["trl_sampling_from"])
    return {
        "steps": steps,
        "seed": seed,
        "prompts": settings["prompts_per_step"],
        "samples": settings["samples"],
        "max_new_tokens": longest["max_new_tokens"],
        "temperature": longest["temperature"],
        "top_p": longest["top_p"],
        "top_k": longest["top_k"],
        "min_p": longest["min_p"],
        **{
            k: settings[k]
            for k in (
                "lr",
                "warmup_steps",
                "betas",
                "adam_eps",
                "weight_decay",
                "grad_clip",
                "clip_low",
                "clip_high",
                "std_normalize",
                "eval_every",
            )
        },
        "sources": {
            s["name"]: {"reward": s["reward"], "max_new_tokens": s["max_new_tokens"]} for s in settings["sources"]
        },
    }


def record_json(record: Any, source: str) -> dict[str, Any]:
    return {"prompt": record.prompt, "label": str(record.label), "index": int(record.index), "source": source}


def training_records(cfg: Any, registry: Any, steps: int) -> list[dict[str, Any]]:
    """The launcher's synchronous data order, replayed: per step, each source's quota in config order."""
    from loongsage.core.data import Mixer, SourceCursor

    # same construction as the controller's: one cursor per source, seed = run.seed * 7919 + source index
    cursors = [
        SourceCursor(
            s.name,
            registry.create("data_source", s.reader, f"data_sources[{i}].reader"),
            seed=cfg.run.seed * 7919 + i,
            on_bad_row=s.on_bad_row,
        )
        for i, s in enumerate(cfg.data_sources)
    ]
    mixer = Mixer(cursors, {s.name: s.prompts_per_step for s in cfg.data_sources})
    out = []
    for _ in range(steps):
        plan = mixer.plan()
        out += [record_json(r, name) for name in plan for r in plan[name]]
    return out


def eval_records(cfg: Any, registry: Any) -> list[dict[str, Any]]:
    out = []
    for i, src in enumerate(cfg.data_sources):
        reader = registry.create("data_source", src.eval_reader, f"data_sources[{i}].eval_reader")
        out += [record_json(reader[k], src.name) for k in range(min(len(reader), cfg.evaluation.max_prompts))]
    return out


# ----------------------------------------------------------------------------- running
class RunFailed(Exception):
    """A side's process exited with an error (the message holds the log's tail)."""


def run_logged(cmd: list[str], cwd: Path, log_path: Path, env: dict[str, str]) -> float:
    """Run ``cmd``, stdout+stderr to ``log_path``; return wall seconds; raise with the log tail on failure."""
    print(f"$ (cd {cwd} && {' '.join(cmd)})", flush=True)
    start = time.perf_counter()
    with log_path.open("w") as fh:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RunFailed(f"{NAME}: command failed (rc={rc}), log {log_path}:\n{tail}")
    return wall


def plugins_outside(tree: Path) -> list[str]:
    """Installed plugin entry points whose module does not come from ``tree`` (on a shared environment a
    package added after the measured commit is loaded from wherever it is installed)."""
    import importlib.util

    from loongsage.core import hookspecs

    out = []
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
        module = ep.value.split(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        if origin is None or not Path(origin).resolve().is_relative_to(tree.resolve()):
            out.append(f"{ep.name} = {ep.value} ({origin})")
    return out


def launcher_command() -> list[str]:
    script = Path(sys.executable).parent / "loongsage"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "loongsage.core.cli"]


def resolve_recipe(name: str) -> tuple[str, list[str]]:
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        return str(path.resolve()), []
    return name, ["--config-dir", str(REPO / "recipes")]


def run_ours(
    args: argparse.Namespace,
    root: Path,
    env: dict[str, str],
    model_path: str,
    scheduler: str,
    seed: int | None,
    sources: list[str],
) -> dict[str, Any]:
    from loongsage.core.tracking import read_metrics

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    recipe, config_dir = resolve_recipe(args.recipe)
    run_name = f"{NAME}_{scheduler}"
    cmd = [
        *launcher_command(),
        "train",
        *config_dir,
        recipe,
        *training_overrides(args, seed),
        scheduler_override(scheduler, args.max_staleness),
        *bench_overrides(root, run_name),
    ]
    load = [os.getloadavg()[0]]
    wall = run_logged(cmd, root, root / "launcher.log", env)
    load.append(os.getloadavg()[0])
    run_dir = root / "runs" / run_name
    used = json.loads((run_dir / "run_info.json").read_text())["model_path"]
    if Path(used).resolve() != Path(model_path).resolve():
        raise SystemExit(f"{NAME}: the launcher trained {used}, not the prepared {model_path}")
    steps, evals = [], []
    for r in read_metrics(run_dir):
        per = {s: r[f"eval/{s}/accuracy"] for s in sources if f"eval/{s}/accuracy" in r}
        if per:
            evals.append(
                {
                    "step": r["step"],
                    "per_source": {
                        s: {"accuracy": per[s], "response_length": r.get(f"eval/{s}/response_length")} for s in per
                    },
                }
            )
        if "timing/step_s" in r:
            steps.append(
                {
                    "step": r["step"],
                    "step_s": r["timing/step_s"],
                    "rollout_s": r["timing/rollout_s"],
                    "train_s": r["timing/train_s"],
                    "sync_s": r["timing/sync_s"],
                    "trajectories": r.get("rollout/trajectories"),
                    "reward_mean": r["rollout/reward_mean"],
                    "reward_mean_by_source": {s: r.get(f"rollout_per_ds/{s}/reward_mean") for s in sources},
                    "response_length_by_source": {
                        s: r.get(f"rollout_per_ds/{s}/response_length_mean") for s in sources
                    },
                    **{
                        k.split("/", 1)[1]: r[k]
                        for k in (
                            "rollout/staleness_mean",
                            "rollout/staleness_max",
                            "rollout/partial_frac",
                            "rollout/stale_dropped",
                            "rollout/resumed_samples",
                        )
                        if k in r
                    },
                }
            )
    if len(steps) != args.steps:
        raise SystemExit(f"{NAME}: expected {args.steps} steps in {run_dir}, found {len(steps)}")
    return {
        "command": cmd,
        "wall_s": wall,
        "loadavg_1m_before_after": load,
        "steps": steps,
        "evals": evals,
        "run_dir": str(run_dir),
    }


def run_trl(
    root: Path,
    env: dict[str, str],
    model_path: str,
    settings: dict[str, Any],
    train: list[dict[str, Any]],
    held_out: list[dict[str, Any]],
) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    spec = {
        "model_path": model_path,
        "work_dir": str(root),
        "settings": settings,
        "train_records": train,
        "eval_records": held_out,
    }
    (root / "spec.json").write_text(json.dumps(spec) + "\n")
    cmd = [sys.executable, str(BENCH / "_trl_side.py"), str(root / "spec.json"), str(root / "result.json")]
    load = [os.getloadavg()[0]]
    wall = run_logged(cmd, REPO, root / "trl.log", env)
    load.append(os.getloadavg()[0])
    result = json.loads((root / "result.json").read_text())
    if len(result["steps"]) != settings["steps"] or result["reward_calls"] != settings["steps"]:
        raise SystemExit(
            f"{NAME}: TRL ran {len(result['steps'])} steps / {result['reward_calls']} reward calls, "
            f"expected {settings['steps']} (one generation batch per optimizer step)"
        )
    for s in result["steps"]:
        s["trajectories"] = float(settings["prompts"] * settings["samples"])
    shutil.rmtree(root / "final", ignore_errors=True)  # the trained weights are not needed here
    return {"command": cmd, "wall_s": wall, "loadavg_1m_before_after": load, **result}


def wait_for_load(max_load: float, max_wait_s: float) -> float:
    """Wait while other work keeps the 1-minute load average above ``max_load``; the seconds waited."""
    start = time.perf_counter()
    while max_load > 0 and os.getloadavg()[0] > max_load and time.perf_counter() - start < max_wait_s:
        time.sleep(5.0)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- summary
def steady_steps(run: dict[str, Any], warmup: int, eval_every: int) -> list[dict[str, Any]]:
    """Steps after the warm-up, leaving out each step that follows an evaluation (same rule every side)."""

    def after_eval(step: int) -> bool:
        return bool(eval_every) and step - 1 > 0 and (step - 1) % eval_every == 0

    kept = [s for s in run["steps"] if s["step"] > warmup and not after_eval(s["step"])]
    return kept or run["steps"]


def run_summary(run: dict[str, Any], warmup: int, eval_every: int) -> dict[str, Any]:
    steady = steady_steps(run, warmup, eval_every)
    times = [s["step_s"] for s in steady]
    traj = sum(s["trajectories"] for s in steady)
    out = {
        "steady_steps": len(steady),
        "trajectories_per_s": traj / sum(times),
        "step_s_median": statistics.median(times),
        "step_s_mean": statistics.fmean(times),
        # the least contended tenth of the steps: on a shared machine, an estimate of the uncontended cost
        "step_s_p10": quantile(times, 0.10),
        "trajectories_per_s_p10": traj / len(times) / quantile(times, 0.10),
        # robust to a few steps stalled by other work: trajectories per step over the median step time
        "trajectories_per_s_median_step": traj / len(times) / statistics.median(times),
        "rollout_s_mean": statistics.fmean(s["rollout_s"] for s in steady),
        "wall_s": run["wall_s"],
        "trajectories_per_s_wall": sum(s["trajectories"] for s in run["steps"]) / run["wall_s"],
    }
    if "train_s" in steady[0]:
        out["train_s_mean"] = statistics.fmean(s["train_s"] for s in steady)
        out["sync_s_mean"] = statistics.fmean(s["sync_s"] for s in steady)
    for key in ("staleness_mean", "partial_frac"):
        if key in steady[0]:
            out[key] = statistics.fmean(s[key] for s in steady)
    out["stale_dropped"] = sum(s.get("stale_dropped", 0.0) for s in run["steps"])
    return out


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (no interpolation), so it is always a measured step."""
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


# per-run throughput estimators: summed steady time, median step, least contended (p10) step
MEASURES = ("trajectories_per_s", "trajectories_per_s_median_step", "trajectories_per_s_p10")
MEASURE_NAMES = {
    "trajectories_per_s": "summed",
    "trajectories_per_s_median_step": "median step",
    "trajectories_per_s_p10": "p10 step",
}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def reward_windows(steps: int, eval_every: int) -> list[tuple[int, int]]:
    width = eval_every or steps
    return [(lo, min(lo + width - 1, steps)) for lo in range(1, steps + 1, width)]


def learning_summary(runs: list[dict[str, Any]], sources: list[str], steps: int, eval_every: int) -> dict[str, Any]:
    """Per source: eval accuracy at each eval step and the mean training reward per window, across repeats."""
    out: dict[str, Any] = {}
    for src in sources:
        evals: dict[int, list[float]] = {}
        for run in runs:
            for e in run["evals"]:
                if src in e["per_source"]:
                    evals.setdefault(int(e["step"]), []).append(e["per_source"][src]["accuracy"])
        windows = {}
        for lo, hi in reward_windows(steps, eval_every):
            per_run = []
            for run in runs:
                vals = [s["reward_mean_by_source"].get(src) for s in run["steps"] if lo <= s["step"] <= hi]
                vals = [v for v in vals if v is not None]
                if vals:
                    per_run.append(statistics.fmean(vals))
            if per_run:
                windows[f"{lo}-{hi}"] = {"mean": statistics.fmean(per_run), "min": min(per_run), "max": max(per_run)}
        out[src] = {
            "eval_accuracy": {
                str(k): {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "values": v}
                for k, v in sorted(evals.items())
            },
            "reward_by_window": windows,
        }
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    configs, warmup, eval_every = result["configurations"], result["warmup_steps"], result["eval_every"]
    sources = [s["name"] for s in result["settings"]["sources"]]
    per_config: dict[str, Any] = {}
    for c in configs:
        runs = [r for r in result["runs"] if r["configuration"] == c]
        if not runs:
            continue
        sums = [run_summary(r, warmup, eval_every) for r in runs]
        entry = {
            "repeats": len(runs),
            "per_repeat": sums,
            "trajectories_per_s": spread([s["trajectories_per_s"] for s in sums]),
            "step_s_median": spread([s["step_s_median"] for s in sums]),
            "trajectories_per_s_p10": spread([s["trajectories_per_s_p10"] for s in sums]),
            "trajectories_per_s_median_step": spread([s["trajectories_per_s_median_step"] for s in sums]),
            "wall_s": spread([s["wall_s"] for s in sums]),
            "learning": learning_summary(runs, sources, result["steps"], eval_every),
        }
        for key in ("staleness_mean", "partial_frac", "rollout_s_mean", "train_s_mean", "sync_s_mean"):
            if all(key in s for s in sums):
                entry[key] = statistics.fmean(s[key] for s in sums)
        entry["stale_dropped"] = sum(s["stale_dropped"] for s in sums)
        per_config[c] = entry

    def paired(c: str, base: str) -> dict[str, Any] | None:
        if c not in per_config or base not in per_config:
            return None
        a = {r["repeat"]: run_summary(r, warmup, eval_every) for r in result["runs"] if r["configuration"] == c}
        b = {r["repeat"]: run_summary(r, warmup, eval_every) for r in result["runs"] if r["configuration"] == base}
        ks = sorted(set(a) & set(b))
        out: dict[str, Any] = {
            "step_s_of_medians": ratio(
                per_config[c]["step_s_median"]["median"], per_config[base]["step_s_median"]["median"]
            )
        }
        for key in MEASURES:
            pairs = [a[k][key] / b[k][key] for k in ks]
            out[f"{key}_of_medians"] = ratio(per_config[c][key]["median"], per_config[base][key]["median"])
            out[f"{key}_paired"] = spread(pairs) if pairs else None
        return out

    for c in per_config:
        per_config[c]["vs_sync"] = paired(c, "sync")
        per_config[c]["vs_trl"] = paired(c, TRL)
    return per_config


# ----------------------------------------------------------------------------- reporting
def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def fmt_spread(d: dict[str, float] | None, digits: int = 3) -> str:
    if not d:
        return "-"
    if d.get("n", 2) == 1:
        return fmt(d["median"], digits)
    return f"{fmt(d['median'], digits)} ({fmt(d['min'], digits)}-{fmt(d['max'], digits)})"


def label(c: str, eta: int) -> str:
    if c == TRL:
        return "TRL GRPOTrainer"
    if c == "sync":
        return "sync"
    if c == "one_step_off":
        return "one_step_off (η=1)"
    return f"{c} (η={eta})"


def goal_lines(result: dict[str, Any]) -> list[str]:
    """The goals, judged on the three throughput estimates together: met only where all three are."""
    summ, eta = result["summary"], result["max_staleness"]
    asyncs = [c for c in result["configurations"] if c not in ("sync", TRL) and c in summ]

    def r(c: str, base: str, key: str) -> float:
        return summ[c][base].get(f"{key}_of_medians") or 0.0

    def verdict(c: str, base: str, goal: float) -> str:
        values = [r(c, base, k) for k in MEASURES]
        word = (
            "met"
            if all(v >= goal for v in values)
            else "not met"
            if all(v < goal for v in values)
            else "met on some estimates only"
        )
        return f"**{word}**: {label(c, eta)} at " + ", ".join(
            f"{v:.2f}x ({MEASURE_NAMES[k]})" for k, v in zip(MEASURES, values)
        )

    def best(cs: list[str], base: str) -> str:
        return max(cs, key=lambda c: statistics.median([r(c, base, k) for k in MEASURES]))

    lines = []
    if asyncs:
        lines.append(
            f"- Asynchronous >= 1.5x synchronous throughput: {verdict(best(asyncs, 'vs_sync'), 'vs_sync', 1.5)} "
            "(the best asynchronous scheduler; all are in the tables above)."
        )
    if TRL in summ:
        sides = [c for c in result["configurations"] if c != TRL and c in summ]
        lines.append(
            f"- >= 3x TRL's trajectories/s at an equal curve, throughput half: "
            f"{verdict(best(sides, 'vs_trl'), 'vs_trl', 3.0)}; sync at "
            + ", ".join(f"{r('sync', 'vs_trl', k):.2f}x" for k in MEASURES)
            + ". The curve half: see Learning."
        )
    if noise_note(result):
        lines.append(
            "- These verdicts come from a loaded machine (see Throughput): they hold for that load, "
            "not for a quiet machine."
        )
    return lines


def curve_lines(result: dict[str, Any]) -> list[str]:
    summ, eta = result["summary"], result["max_staleness"]
    sources = [s["name"] for s in result["settings"]["sources"]]
    configs = [c for c in result["configurations"] if c in summ]
    lines = []
    for src in sources:
        eval_steps = sorted({int(k) for c in configs for k in summ[c]["learning"][src]["eval_accuracy"]})
        windows = list(summ[configs[0]]["learning"][src]["reward_by_window"])
        lines += [
            f"`{src}`: greedy held-out accuracy at each evaluated step and mean training reward per window of "
            "steps; mean over repeats (min-max across repeats).",
            "",
            "| configuration | "
            + " | ".join(f"acc @{s}" for s in eval_steps)
            + " | "
            + " | ".join(f"reward {w}" for w in windows)
            + " |",
            "|---|" + "---|" * (len(eval_steps) + len(windows)),
        ]
        for c in configs:
            L = summ[c]["learning"][src]
            cells = []
            for s in eval_steps:
                e = L["eval_accuracy"].get(str(s))
                cells.append(
                    "-"
                    if e is None
                    else (
                        f"{e['mean']:.3f}"
                        if e["min"] == e["max"]
                        else f"{e['mean']:.3f} ({e['min']:.3f}-{e['max']:.3f})"
                    )
                )
            for w in windows:
                e = L["reward_by_window"].get(w)
                cells.append("-" if e is None else f"{e['mean']:.3f} ({e['min']:.3f}-{e['max']:.3f})")
            lines.append(f"| {label(c, eta)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def learning_verdict(result: dict[str, Any]) -> list[str]:
    """Each configuration's last evaluation and last reward window against sync's spread across repeats."""
    summ, eta = result["summary"], result["max_staleness"]
    if "sync" not in summ:
        return []
    sources = [s["name"] for s in result["settings"]["sources"]]
    lines = [
        "Against `sync`'s spread across repeats (its seeds' min-max), per source, last evaluation and last "
        "reward window:",
        "",
    ]
    for c in [c for c in result["configurations"] if c in summ and c != "sync"]:
        parts = []
        for src in sources:
            ref, cur = summ["sync"]["learning"][src], summ[c]["learning"][src]
            last_eval = max(ref["eval_accuracy"], key=int, default=None)
            last_win = list(ref["reward_by_window"])[-1] if ref["reward_by_window"] else None
            for kind, a, b in (
                ("acc", ref["eval_accuracy"].get(last_eval), cur["eval_accuracy"].get(last_eval)),
                ("reward", ref["reward_by_window"].get(last_win), cur["reward_by_window"].get(last_win)),
            ):
                if a is None or b is None:
                    continue
                where = (
                    "within"
                    if a["min"] - 1e-12 <= b["mean"] <= a["max"] + 1e-12
                    else "above"
                    if b["mean"] > a["max"]
                    else "below"
                )
                parts.append(
                    f"{src} {kind} {b['mean']:.3f} vs {a['mean']:.3f} [{a['min']:.3f}, {a['max']:.3f}] ({where})"
                )
        lines.append(f"- {label(c, eta)}: " + "; ".join(parts))
    return lines + [""]


def machine_note(result: dict[str, Any]) -> str:
    """Where the bench ran: the whole machine, or pinned (taskset) to some of its cores."""
    m, load = result["machine"], result["loadavg_1m_bench_before_after"]
    parts = result.get("merged_from")
    if parts:
        slices = "; ".join(
            f"repeat(s) {', '.join(str(k + 1) for k in p['repeats'])} on cores "
            f"{','.join(map(str, p.get('cores') or []))}"
            for p in parts
        )
        return (
            f"Machine: {m['cpus']} CPU cores, {len(parts)} benches at once, each pinned to "
            f"{m['affinity']} cores of its own ({slices}): every run had {m['affinity']} cores to itself. "
        )
    if m.get("affinity", m["cpus"]) < m["cpus"]:
        return (
            f"Machine: pinned to {m['affinity']} of {m['cpus']} CPU cores (1-minute load average of the "
            f"machine {load[0]:.1f} before / {load[1]:.1f} after the bench; per run in the JSON)."
        )
    return (
        f"Machine: {m['cpus']} CPU cores, shared with other work (1-minute load average {load[0]:.1f} before / "
        f"{load[1]:.1f} after the bench; per run in the JSON)."
    )


def noise_note(result: dict[str, Any]) -> list[str]:
    if (
        result.get("merged_from")
        or result["machine"].get("affinity", result["machine"]["cpus"]) < result["machine"]["cpus"]
    ):
        return []  # pinned to cores of its own: the machine's load is other slices' work
    cpus = result["machine"]["cpus"] or 1
    loads = [x for r in result["runs"] for x in r["loadavg_1m_before_after"]]
    if not loads or max(loads) <= cpus:
        return []
    by_config = {
        c: statistics.fmean(x for r in result["runs"] if r["configuration"] == c for x in r["loadavg_1m_before_after"])
        for c in result["configurations"]
        if any(r["configuration"] == c for r in result["runs"])
    }
    return [
        f"**Shared machine under load**: the 1-minute load average reached {max(loads):.1f} on {cpus} cores "
        f"(median {statistics.median(loads):.1f} over the runs' start and end; mean per configuration: "
        + ", ".join(f"{label(c, result['max_staleness'])} {v:.1f}" for c, v in by_config.items())
        + "). Other processes shared the cores, so absolute times measure contention as much as code, and "
        "the ratios are skewed too: the synchronous launcher's actors and TRL run two torch threads each, "
        "which slow down far more when the cores are oversubscribed than an asynchronous run's pinned "
        "one-thread actors do. Under such load the ratios vs sync and vs TRL overstate what the schedule "
        "gains on a quiet machine; the p10-step estimates are the closer ones to the uncontended "
        "cost, and a quiet machine is needed for firm numbers.",
        "",
    ]


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    summ, s, eta = result["summary"], result["settings"], result["max_staleness"]
    m, v = result["machine"], result["versions"]
    src_rows = [
        f"| `{x['name']}` | {x['prompts']} x {x['samples']} | temperature {x['temperature']}, top_p "
        f"{x['top_p']}, top_k {x['top_k']} | {x['max_new_tokens']} | `{x['reward']['name']}` |"
        for x in s["sources"]
    ]
    t = trl_settings(s, result["steps"], 0)
    gate = result.get("load_gate") or {"max_load_1m": 0.0, "max_wait_s": 0.0}
    lines = [
        "# Asynchronous vs synchronous rollout, and TRL, on CPU",
        "",
        f"Recipe `{result['recipe']}` through the launcher, {result['steps']} steps per run, "
        f"{result['repeats']} repeat(s) of every configuration interleaved "
        f"({', '.join(result['configurations'])}, then again); repeat k with run seed "
        f"{'the recipe seed' if result['same_seed'] else 'recipe seed + k'} on every side. "
        f"Model `{Path(result['model_path']).name}` ({result['num_parameters']:,} parameters). "
        + machine_note(result).rstrip()
        + f" torch {v['torch']}, transformers {v['transformers']}, TRL {v['trl']}, "
        f"Python {m['python']}. Framework source: commit {result['source']['commit'][:10]}"
        + (
            f" with {result['source']['uncommitted_files']} uncommitted file(s)"
            if result["source"].get("uncommitted_files")
            else ""
        )
        + f". Bench wall time {result['bench_wall_s'] / 60:.1f} min."
        + (
            " Plugins installed in the environment but not part of the measured tree (loaded from where they are "
            f"installed): {'; '.join(result['plugins_outside_tree'])}."
            if result.get("plugins_outside_tree")
            else ""
        ),
        "",
        "## Workload",
        "",
        "| source | prompts x samples per step | sampling (launcher) | max new tokens (launcher) | reward |",
        "|---|---|---|---|---|",
        *src_rows,
        "",
        f"Per step {s['trajectories_per_step']} trajectories. GRPO (group z-score), PPO clip "
        f"[{1 - s['clip_low']:g}, {1 + s['clip_high']:g}], token-mean over both sources, AdamW lr {s['lr']:g}, "
        "no KL, one optimizer step per batch, float32 on CPU. Launcher placement: trainer and engine in "
        "bundles of their own (`colocate: false`); the synchronous scheduler lets each phase use every core "
        "in turn, an asynchronous one pins the engine and the trainer to disjoint cores and overlaps them.",
        "",
        f"**TRL cannot give each source its own sampling or max length**: `GRPOTrainer` samples the whole batch "
        f"with one generation config, so it gets max_completion_length = {t['max_new_tokens']} (the larger max) "
        f"and the `{s['trl_sampling_from']}` source's sampling (temperature {t['temperature']}, top_p {t['top_p']}, "
        f"top_k {t['top_k']}) for both sources. It sees the same records in the same order ({s['prompts_per_step']} "
        f"prompts x {s['samples']} samples per step, `shuffle_dataset=False`), one reward function that scores each "
        "completion with its own source's reward plugin (`exact_match` / `digit_sort`), the same optimizer, clip "
        "range, `loss_type='dapo'` (token-mean), `scale_rewards='group'`, `beta=0`, no vLLM, "
        "`gradient_checkpointing=False`, both cores for every phase. TRL's held-out accuracy comes from the shared "
        "greedy HF-`generate` helper with each source's own max new tokens and reward."
        + (
            f" The recipe's correction {', '.join(c['name'] for c in s['ours_only_corrections'])} (decoupled PPO's "
            "per-token behaviour weight, about 1 on-policy, for stale samples) runs on every launcher "
            "configuration, synchronous included, and costs it an extra forward pass per step for the proximal "
            "log-probs; TRL has no such correction and runs plain GRPO."
            if s.get("ours_only_corrections")
            else ""
        ),
        "",
        "## Throughput",
        "",
        *noise_note(result),
        f"Steady state: steps {result['warmup_steps'] + 1}-{result['steps']} leaving out each step that follows an "
        f"evaluation (evaluation every {result['eval_every']} steps, {s['eval_prompts']} held-out prompts per "
        "source); step time = generation (or, asynchronously, waiting for the batch) + training + weight push. "
        "Three per-run estimates of steady trajectories/s: **summed** = trajectories / summed steady step time "
        "(every stall counts); **median step** = trajectories per step / median step time (robust to a few "
        "steps stalled by other work); **p10 step** = trajectories per step / 10th-percentile step time (the "
        "least contended steps, an estimate of the cost with the cores free; for an asynchronous run such a "
        "step may also profit from generation done during an earlier slow step, which favours it slightly). "
        "Tables: median over repeats (min-max).",
        "",
        "| configuration | trajectories/s, summed | trajectories/s, median step | trajectories/s, p10 step "
        "| s/step (median) | mean staleness | partial samples | stale groups dropped per run |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def rr(d: dict[str, Any] | None, key: str) -> str:
        if not d or d.get(f"{key}_of_medians") is None:
            return "-"
        p = d.get(f"{key}_paired")
        return f"{d[f'{key}_of_medians']:.2f}x" + (f" [{p['min']:.2f}-{p['max']:.2f}]" if p and p["n"] > 1 else "")

    configs = [c for c in result["configurations"] if c in summ]
    for c in configs:
        e = summ[c]
        lines.append(
            f"| {label(c, eta)} | "
            + " | ".join(fmt_spread(e.get(k), 1) for k in MEASURES)
            + f" | {fmt_spread(e['step_s_median'], 3)} | {fmt(e.get('staleness_mean'), 2)} | "
            f"{fmt(e.get('partial_frac'), 3)} | "
            f"{'-' if c in ('sync', TRL) else fmt(e['stale_dropped'] / e['repeats'], 1)} |"
        )
    lines += [
        "",
        "Ratios: of the medians over repeats, and in brackets the range of the per-repeat (paired, same seed, "
        "run back to back) ratios.",
        "",
        "| configuration | vs sync: summed | median step | p10 step | vs TRL: summed | median step | p10 step |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {label(c, eta)} | "
            + " | ".join(("1" if c == "sync" else rr(summ[c]["vs_sync"], k)) for k in MEASURES)
            + " | "
            + " | ".join(("1" if c == TRL else rr(summ[c]["vs_trl"], k)) for k in MEASURES)
            + " |"
            for c in configs
        ],
    ]
    lines += [
        "",
        "Mean staleness: policy versions between the trainer and a trained group's oldest token; partial "
        "samples: share of trajectories generated across more than one policy version (cut at a weight update "
        "and continued from their tokens); stale groups dropped: finished groups that lagged more than η "
        "versions when a batch was taken, thrown away and their prompts generated again.",
        "",
        "Where a step goes (mean over steady steps and repeats, seconds): "
        + "; ".join(
            f"{label(c, eta)}: wait/generate {summ[c]['rollout_s_mean']:.3f}"
            + (
                f", train {summ[c]['train_s_mean']:.3f}, push {summ[c]['sync_s_mean']:.3f}"
                if "train_s_mean" in summ[c]
                else ""
            )
            for c in result["configurations"]
            if c in summ
        )
        + ".",
        "",
        "## Goals",
        "",
        *goal_lines(result),
        "",
        "## Learning",
        "",
        *curve_lines(result),
        *learning_verdict(result),
        f"{result['repeats']} repeat(s) per configuration, so the ranges are a rough measure of seed noise; "
        "asynchronous runs also vary with timing (which groups land in which batch).",
        "",
        "## Every run",
        "",
        f"In run order. Before each run the bench waited while the 1-minute load average was above "
        f"{gate['max_load_1m']:g} (at most {gate['max_wait_s']:g} s).",
        "",
        "| repeat | configuration | seed | trajectories/s | s/step (median) | load before -> after | waited s | wall s "
        "| failed attempts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        rs = run_summary(run, result["warmup_steps"], result["eval_every"])
        lb, la = run["loadavg_1m_before_after"]
        lines.append(
            f"| {run['repeat'] + 1} | {label(run['configuration'], eta)} | {run['seed']} | "
            f"{rs['trajectories_per_s']:.1f} | {rs['step_s_median']:.3f} | {lb:.1f} -> {la:.1f} | "
            f"{run.get('waited_for_load_s', 0.0):.0f} | {run['wall_s']:.1f} | "
            f"{len(run.get('failed_attempts', []))} |"
        )
    lines.append("")
    path.write_text("\n".join(lines))


def write_plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ, eta = result["summary"], result["max_staleness"]
    sources = [s["name"] for s in result["settings"]["sources"]]
    configs = [c for c in result["configurations"] if c in summ]
    colors = dict(zip(configs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    fig, axes = plt.subplots(2, len(sources) + 1, figsize=(6 * (len(sources) + 1), 9))
    for j, src in enumerate(sources):
        for c in configs:
            runs = [r for r in result["runs"] if r["configuration"] == c]
            n = min(len(r["steps"]) for r in runs)
            y = [
                statistics.fmean(r["steps"][i]["reward_mean_by_source"].get(src) or 0.0 for r in runs) for i in range(n)
            ]
            smooth = [statistics.fmean(y[max(0, i - 4) : i + 1]) for i in range(n)]
            axes[0, j].plot(range(1, n + 1), smooth, color=colors[c], label=label(c, eta))
            ev = summ[c]["learning"][src]["eval_accuracy"]
            xs = sorted(int(k) for k in ev)
            axes[1, j].errorbar(
                xs,
                [ev[str(x)]["mean"] for x in xs],
                yerr=[
                    [ev[str(x)]["mean"] - ev[str(x)]["min"] for x in xs],
                    [ev[str(x)]["max"] - ev[str(x)]["mean"] for x in xs],
                ],
                marker="o",
                capsize=3,
                color=colors[c],
                label=label(c, eta),
            )
        axes[0, j].set(title=f"{src}: training reward (mean over repeats, rolling 5 steps)", xlabel="step")
        axes[1, j].set(title=f"{src}: greedy held-out accuracy (mean, min-max)", xlabel="step")
    width = 0.8 / len(MEASURES)
    for m, (key, hatch) in enumerate(zip(MEASURES, ("", "//", ".."))):
        tps = [summ[c][key] for c in configs]
        axes[0, -1].bar(
            [i + (m - 1) * width for i in range(len(configs))],
            [t["median"] for t in tps],
            width,
            color=[colors[c] for c in configs],
            hatch=hatch,
            edgecolor="k",
            linewidth=0.5,
            yerr=[[t["median"] - t["min"] for t in tps], [t["max"] - t["median"] for t in tps]],
            capsize=2,
            label=MEASURE_NAMES[key],
        )
    axes[0, -1].set_xticks(range(len(configs)), [label(c, eta) for c in configs], rotation=30, ha="right", fontsize=8)
    axes[0, -1].legend(fontsize=8, title="per run, from", title_fontsize=8)
    axes[0, -1].set(title="steady trajectories/s (median over repeats, min-max)")
    axes[1, -1].axis("off")
    for ax in axes.flat:
        if ax.has_data():
            ax.grid(alpha=0.3)
    axes[1, 0].legend(fontsize=8)
    fig.suptitle(f"{result['recipe']}: {result['steps']} steps x {result['repeats']} repeats per configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    result["summary"] = summarize(result)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_markdown(out / f"{NAME}.md", result)
    try:
        write_plot(out / f"{NAME}.png", result)
    except ImportError as exc:  # matplotlib is optional
        print(f"no plot: {exc}")
    print((out / f"{NAME}.md").read_text())
    print(f"wrote {out / (NAME + '.json')}, {out / (NAME + '.md')}, {out / (NAME + '.png')}")


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Fields that must agree for runs of separate benches to be compared as repeats of one.
_SAME = (
    "recipe",
    "quick",
    "steps",
    "max_staleness",
    "eval_every",
    "warmup_steps",
    "configurations",
    "training_overrides",
    "settings",
    "num_parameters",
    "eval_record_indices",
)


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from benches that ran separate repeats (``--first-repeat``) of the same commit and
    settings, say at once on disjoint cores: their runs joined, the machine and load of each kept."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("source", *_SAME):
            if part.get(key) != first.get(key):
                raise SystemExit(
                    f"{NAME} --merge: the results differ in {key!r}; only repeats of one commit and "
                    "one set of settings can be joined"
                )
    runs = sorted((r for part in parts for r in part["runs"]), key=lambda r: (r["repeat"], r["configuration"]))
    repeats = sorted({r["repeat"] for r in runs})
    if len(repeats) != len([r for part in parts for r in {x["repeat"] for x in part["runs"]}]):
        raise SystemExit(f"{NAME} --merge: a repeat number occurs in more than one result (use --first-repeat)")
    merged = {
        **first,
        "runs": runs,
        "repeats": len(repeats),
        "seeds": [s for part in parts for s in part["seeds"]],
        "merged_from": [
            {
                "machine": p["machine"],
                "repeats": sorted({r["repeat"] for r in p["runs"]}),
                "bench_wall_s": p.get("bench_wall_s"),
                "loadavg_1m_bench_before_after": p.get("loadavg_1m_bench_before_after"),
                "cores": p.get("cores"),
            }
            for p in parts
        ],
    }
    merged["bench_wall_s"] = max(p.get("bench_wall_s") or 0.0 for p in parts)
    merged.pop("summary", None)
    return merged


# ----------------------------------------------------------------------------- main
def run_exported(args: argparse.Namespace, argv: list[str]) -> int:
    """Export ``--export-commit`` with ``git archive`` and run this bench from the export: the
    measurement then sees exactly that commit, whatever else the working tree holds."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{args.export_commit}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = BENCH / "work" / "src" / sha[:12]
    if not (tree / "bench" / f"{NAME}.py").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    if not (tree / "bench" / f"{NAME}.py").is_file():
        raise SystemExit(f"{NAME}: commit {sha[:10]} has no bench/{NAME}.py")
    paths = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    env = {
        **os.environ,
        "LOONGSAGE_COMMIT": sha,
        "PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    rest, skip = [], False
    for a in argv:  # drop --export-commit and --out-dir (either spelling); the output folder is this checkout's
        if skip:
            skip = False
        elif a in ("--export-commit", "--out-dir"):
            skip = True
        elif not a.startswith(("--export-commit=", "--out-dir=")):
            rest.append(a)
    rest += ["--out-dir", str(args.out_dir.resolve())]
    print(f"{NAME}: measuring commit {sha[:10]} from {tree}", flush=True)
    return subprocess.run([sys.executable, str(tree / "bench" / f"{NAME}.py"), *rest], cwd=tree, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.export_commit:
        return run_exported(args, argv)
    if args.report_only:
        write_outputs(args.out_dir, json.loads((args.out_dir / f"{NAME}.json").read_text()))
        return 0
    if args.merge:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        write_outputs(args.out_dir, merge_results([json.loads(p.read_text()) for p in args.merge]))
        return 0
    import importlib.util

    source = source_state()  # the commit measured, taken before anything runs
    bench_start, load_start = time.perf_counter(), os.getloadavg()[0]
    if not args.no_trl and importlib.util.find_spec("trl") is None:
        raise SystemExit(
            f"{NAME}: TRL is not installed in this environment; run with "
            f"`uv run --group bench python bench/{NAME}.py ...` (or pass --no-trl)"
        )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    work = BENCH / "work" / (f"{NAME}_quick" if args.quick else NAME)
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from loongsage.core.config import load_config
    from loongsage.core.controller import resolve_model_path

    base_cfg, registry = load_config(args.recipe, training_overrides(args, None), config_dir=str(REPO / "recipes"))
    settings = extract_settings(base_cfg, registry)
    for sched in args.schedulers:  # every scheduler override validates before anything runs
        load_config(
            args.recipe,
            [*training_overrides(args, None), scheduler_override(sched, args.max_staleness)],
            config_dir=str(REPO / "recipes"),
        )
    sources = [x["name"] for x in settings["sources"]]
    base_seed = base_cfg.run.seed
    repeats = range(args.first_repeat, args.first_repeat + args.repeats)
    seeds = [base_seed if args.same_seed else base_seed + k for k in repeats]
    warmup = max(0, min(args.warmup_steps, args.steps - 1))
    max_load = 2.0 * len(os.sched_getaffinity(0)) if args.max_load is None else args.max_load
    print("settings:", json.dumps({k: v for k, v in settings.items() if k != "sources"}, default=str), flush=True)

    t = time.perf_counter()
    model_path = resolve_model_path(base_cfg, registry)  # what the launcher does; builds and caches once
    warm_start_s = time.perf_counter() - t
    print(f"model: {model_path} ({warm_start_s:.1f} s)", flush=True)
    held_out = eval_records(base_cfg, registry)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    result: dict[str, Any] = {
        "source": source,
        "recipe": args.recipe,
        "quick": args.quick,
        "steps": args.steps,
        "repeats": args.repeats,
        "seeds": seeds,
        "same_seed": args.same_seed,
        "max_staleness": args.max_staleness,
        "eval_every": args.eval_every,
        "warmup_steps": warmup,
        "load_gate": {"max_load_1m": max_load, "max_wait_s": args.max_wait_s},
        "configurations": configurations(args),
        "training_overrides": training_overrides(args, None),
        "settings": settings,
        "model_path": model_path,
        "num_parameters": n_params,
        "warm_start_s": warm_start_s,
        "cores": sorted(os.sched_getaffinity(0)),
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": version_of("transformers"),
            "trl": version_of("trl"),
            "ray": version_of("ray"),
        },
        "eval_record_indices": {s: [r["index"] for r in held_out if r["source"] == s] for s in sources},
        "plugins_outside_tree": plugins_outside(REPO),
        "runs": [],
    }
    trl_versions = None
    for k, seed in zip(repeats, seeds):
        cfg_k, _ = load_config(args.recipe, training_overrides(args, seed), config_dir=str(REPO / "recipes"))
        train = training_records(cfg_k, registry, args.steps) if not args.no_trl else []
        for c in result["configurations"]:
            root = work / f"r{k}" / c
            waited = wait_for_load(max_load, args.max_wait_s)
            print(
                f"--- repeat {k + 1} of {repeats.start + 1}-{repeats.stop} (seed {seed}): {c}"
                + (f" (waited {waited:.0f} s for the load to drop)" if waited >= 1 else ""),
                flush=True,
            )
            failures = []
            for attempt in range(2):  # a failed run (say, the shared environment changed under it) goes once more
                try:
                    if c == TRL:
                        run = run_trl(root, env, model_path, trl_settings(settings, args.steps, seed), train, held_out)
                        trl_versions = run.get("versions")
                    else:
                        run = run_ours(args, root, env, model_path, c, seed, sources)
                    break
                except RunFailed as exc:
                    failures.append(str(exc))
                    print(f"    failed (attempt {attempt + 1}):\n{exc}", flush=True)
                    if attempt:
                        raise SystemExit(str(exc)) from None
            run["failed_attempts"] = failures
            run.update({"configuration": c, "repeat": k, "seed": seed, "waited_for_load_s": waited})
            result["runs"].append(run)
            rs = run_summary(run, warmup, args.eval_every)
            print(
                f"    {rs['trajectories_per_s']:.1f} trajectories/s (steady), median step {rs['step_s_median']:.3f} s,"
                f" wall {run['wall_s']:.1f} s, load {run['loadavg_1m_before_after']}",
                flush=True,
            )
            (work / f"{NAME}.partial.json").write_text(json.dumps(result, default=str) + "\n")
    if trl_versions:
        result["versions"]["trl_side"] = trl_versions
    result["bench_wall_s"] = time.perf_counter() - bench_start
    result["loadavg_1m_bench_before_after"] = [load_start, os.getloadavg()[0]]
    write_outputs(args.out_dir, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
