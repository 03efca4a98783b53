"""LoongSage vs TRL GRPOTrainer on CPU: same model, prompts, settings; wall time and learning.

One run trains the recipe's warm start twice, one side after the other:

(a) LoongSage, through the real launcher (``loongsage train <recipe> key=value ...``) in a subprocess,
    read back from ``runs/<name>/metrics.jsonl``;
(b) TRL's ``GRPOTrainer`` on CPU (``use_cpu=True``, ``bf16=False``, plain HF ``generate``) in a
    subprocess (``bench/_trl_side.py``).

Every training setting is read from the composed recipe (``recipes/tiny/grpo_arith_cpu.yaml`` plus
overrides), so the benchmark follows the recipe as it is tuned; flags only add overrides, which go
to both sides. Both sides start from the same HF folder and see the same prompts in the same order
(the launcher's data mixer is replayed here with its seed), P prompts x G samples per optimizer
step, the same exact-match reward, temperature, max new tokens, AdamW settings, clip range,
token-mean loss and group z-score advantages, no KL and no reference model.

Measured per side: wall time per step (steady state excludes the first ``--warmup-steps`` steps;
start-up, evaluation and saving are outside the step time on both sides), trajectories per second,
the reward of every step, greedy held-out accuracy every ``--eval-every`` steps (each side's own
evaluation) and, for the start model and both final models, greedy accuracy from one shared helper
(:func:`_trl_side.greedy_accuracy`, HF ``generate``) so the end-point comparison does not depend on
either framework's decoding.

    uv run --group bench python bench/cpu_vs_trl.py                 # the recipe as is
    uv run --group bench python bench/cpu_vs_trl.py --steps 30      # shorter
    uv run --group bench python bench/cpu_vs_trl.py --quick         # smoke test (tiny, short warm start)

Outputs: ``bench/results/cpu_vs_trl.{json,md,png}`` (``--quick`` writes to
``bench/work/cpu_vs_trl_quick/`` instead, so a smoke test never replaces real results). Working
files (launcher run directory, TRL output, logs) go under ``bench/work/``.
"""

from __future__ import annotations

import argparse
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

RUN_NAME = "cpu_vs_trl"


# ----------------------------------------------------------------------------- settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="tiny/grpo_arith_cpu", help="recipe name under recipes/ or a YAML path")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's run.total_steps)")
    p.add_argument("--prompts", type=int, help="prompts per step (default: the recipe's prompts_per_step)")
    p.add_argument("--samples", type=int, help="samples per prompt (default: the recipe's samples_per_prompt)")
    p.add_argument("--max-new-tokens", type=int, help="max new tokens (default: the recipe's sampling)")
    p.add_argument("--lr", type=float, help="learning rate (default: the recipe's trainer.optimizer.lr)")
    p.add_argument(
        "--eval-every",
        type=int,
        help="greedy eval every N steps, 0 = start and end only (default: the recipe's evaluation.every_steps)",
    )
    p.add_argument("--eval-prompts", type=int, help="held-out prompts (default: evaluation.max_prompts)")
    p.add_argument(
        "--warm-start-steps",
        type=int,
        help="override model.builder.params.steps (SFT steps of the warm start; for development)",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other recipe override; applied to both sides (repeatable)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=3, help="first steps left out of the steady-state step time (default 3)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 3 steps, 4 prompts x 4 samples, 64 eval prompts, 40-step warm start",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rebuild the summary, markdown and plot from <out-dir>/cpu_vs_trl.json",
    )
    p.add_argument("--trl-first", action="store_true", help="run the TRL side first (default: LoongSage first)")
    p.add_argument("--out-dir", type=Path, help="where the json/md/png go (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in (
            ("steps", 3),
            ("prompts", 4),
            ("samples", 4),
            ("eval_every", 0),
            ("eval_prompts", 64),
            ("warm_start_steps", 40),
        ):
            if getattr(args, key) is None:
                setattr(args, key, value)
        args.warmup_steps = min(args.warmup_steps, 1)
    if args.out_dir is None:
        args.out_dir = BENCH / "work" / "cpu_vs_trl_quick" if args.quick else BENCH / "results"
    return args


def training_overrides(args: argparse.Namespace) -> list[str]:
    """Overrides that change what is trained: they go to the launcher and define the TRL side."""
    out = []
    for flag, key in (
        ("steps", "run.total_steps"),
        ("prompts", "data_sources.0.prompts_per_step"),
        ("samples", "data_sources.0.samples_per_prompt"),
        ("max_new_tokens", "data_sources.0.sampling.max_new_tokens"),
        ("lr", "trainer.optimizer.lr"),
        ("eval_every", "evaluation.every_steps"),
        ("eval_prompts", "evaluation.max_prompts"),
        ("warm_start_steps", "model.builder.params.steps"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={value}")
    return out + list(args.extra)


def bench_overrides(run_root: Path) -> list[str]:
    """Launcher-only overrides: where outputs go and what is logged; nothing that changes training."""
    return [
        f"run.name={RUN_NAME}",
        f"run.output_dir={run_root / 'runs'}",
        f"run.log_dir={run_root / 'log'}",
        "evaluation.pass_k=0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=true",
        "tracking.backends=[jsonl]",
        "tracking.progress=false",
    ]


def resolve_recipe(name: str) -> tuple[str, list[str]]:
    """The recipe argument and ``--config-dir`` for the launcher (run from a work dir)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        return str(path.resolve()), []
    return name, ["--config-dir", str(REPO / "recipes")]


def unsupported(msg: str) -> SystemExit:
    return SystemExit(f"cpu_vs_trl: the TRL side cannot reproduce this recipe: {msg}")


def grpo_loss(cfg: Any, registry: Any, unsupported: Any) -> tuple[Any, Any]:
    """The advantage estimator and policy loss of a config TRL's GRPOTrainer can mirror (GRPO,
    PPO-clip without dual clip, token-mean, no KL); ``unsupported(msg)`` makes the refusal."""
    alg = cfg.algorithm
    if alg.advantage.get("name") != "grpo":
        raise unsupported(f"advantage {alg.advantage} (grpo expected)")
    adv = registry.create("advantage", alg.advantage, "algorithm.advantage")
    if alg.policy_loss.get("name") != "ppo_clip":
        raise unsupported(f"policy_loss {alg.policy_loss} (ppo_clip expected)")
    loss = registry.create("policy_loss", alg.policy_loss, "algorithm.policy_loss")
    if getattr(loss, "clip_c", None) is not None:
        raise unsupported("dual clip (clip_c)")
    if alg.aggregation != "token-mean":
        raise unsupported(f"aggregation {alg.aggregation} (token-mean expected; TRL loss_type='dapo')")
    if alg.kl is not None or alg.kl_coef:
        raise unsupported("a KL term (the comparison runs with beta=0 and no reference model)")
    return adv, loss


def extract_settings(cfg: Any, registry: Any) -> dict[str, Any]:
    """Every setting both sides share, from the validated config; refuse what TRL cannot mirror."""
    if len(cfg.data_sources) != 1:
        raise unsupported(f"{len(cfg.data_sources)} data sources (one expected)")
    src = cfg.data_sources[0]
    sampling = cfg.sampling_for(src)
    agent = registry.create("agent", src.agent, "data_sources[0].agent")
    if src.agent.get("name") != "single_turn" or getattr(agent, "prompt_template", None) != "chat":
        raise unsupported(f"agent {src.agent} (single_turn with prompt_template: chat expected)")
    if src.reward.get("name") != "exact_match":
        raise unsupported(f"reward {src.reward} (exact_match expected)")
    reward = registry.create("reward", src.reward, "data_sources[0].reward")
    if sampling.stop_token_ids:
        raise unsupported("sampling.stop_token_ids (TRL stops at eos only)")
    if src.eval_reader is None:
        raise unsupported("no eval_reader (held-out accuracy needs one)")
    alg = cfg.algorithm
    adv, loss = grpo_loss(cfg, registry, unsupported)
    if alg.corrections or alg.filters:
        raise unsupported("corrections/filters")
    tr = cfg.trainer
    if tr.mini_batches_per_step != 1 or tr.world_size != 1 or cfg.rollout.num_engines != 1:
        raise unsupported("mini_batches_per_step, world_size and num_engines must be 1")
    if cfg.model.dtype != "float32":
        raise unsupported(f"model.dtype={cfg.model.dtype} (float32 expected on CPU)")
    opt = tr.optimizer
    return {
        "recipe_steps": cfg.run.total_steps,
        "steps": cfg.run.total_steps,
        "seed": cfg.run.seed,
        "prompts": src.prompts_per_step,
        "samples": src.samples_per_prompt,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
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
        "reward_params": {"strip": reward.strip, "extract": reward.extract},
        "eval_every": cfg.evaluation.every_steps,
        "eval_prompts": cfg.evaluation.max_prompts,
        "model_builder": cfg.model.builder,
        "model_path_config": cfg.model.path,
        "train_reader": src.reader,
        "eval_reader": src.eval_reader,
    }


def ours_recomputes_old_logprobs(cfg: Any, registry: Any) -> bool | None:
    """Whether the framework spends a forward pass on old log-probs for this config (None: unknown)."""
    try:
        from loongsage.core.loss import build_loss_plan

        return bool(build_loss_plan(cfg, registry).recompute_old_logprobs(cfg.trainer.mini_batches_per_step))
    except Exception:  # the framework's internals moved: report unknown rather than guess
        return None


def record_json(record: Any) -> dict[str, Any]:
    return {"prompt": record.prompt, "label": str(record.label), "index": record.index}


def training_records(cfg: Any, registry: Any, steps: int) -> list[dict[str, Any]]:
    """The prompts the launcher will train on, in order: its mixer replayed with the same seed."""
    from loongsage.core.data import Mixer, SourceCursor

    src = cfg.data_sources[0]
    # same construction as the controller's: one cursor per source, seed = run.seed * 7919 + source index
    cursor = SourceCursor(
        src.name,
        registry.create("data_source", src.reader, "data_sources[0].reader"),
        seed=cfg.run.seed * 7919 + 0,
        on_bad_row=src.on_bad_row,
    )
    mixer = Mixer([cursor], {src.name: src.prompts_per_step})
    return [record_json(r) for _ in range(steps) for r in mixer.plan()[src.name]]


def eval_records(cfg: Any, registry: Any) -> list[dict[str, Any]]:
    reader = registry.create("data_source", cfg.data_sources[0].eval_reader, "data_sources[0].eval_reader")
    return [record_json(reader[i]) for i in range(min(len(reader), cfg.evaluation.max_prompts))]


def model_stop_ids(model_path: str) -> list[int]:
    """The eos ids the model folder declares (config and generation config): the engine's stop ids."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = Path(model_path) / name
        value = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        for v in [] if value is None else [value] if isinstance(value, int) else value:
            if v not in ids:
                ids.append(v)
    return ids


# ----------------------------------------------------------------------------- running the sides
def run_logged(cmd: list[str], cwd: Path, log_path: Path, env: dict[str, str]) -> float:
    """Run ``cmd``, stdout+stderr to ``log_path``; return wall seconds; raise with the log tail on failure."""
    print(f"$ (cd {cwd} && {' '.join(cmd)})", flush=True)
    start = time.perf_counter()
    with log_path.open("w") as fh:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"cpu_vs_trl: command failed (rc={rc}), log {log_path}:\n{tail}")
    return wall


def launcher_command() -> list[str]:
    script = Path(sys.executable).parent / "loongsage"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "loongsage.core.cli"]


def run_ours(
    args: argparse.Namespace, work: Path, env: dict[str, str], model_path: str, settings: dict[str, Any]
) -> dict[str, Any]:
    from loongsage.core.tracking import read_metrics

    root = work / "ours"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    recipe, config_dir = resolve_recipe(args.recipe)
    cmd = [*launcher_command(), "train", *config_dir, recipe, *training_overrides(args), *bench_overrides(root)]
    load = [os.getloadavg()[0]]
    wall = run_logged(cmd, root, root / "launcher.log", env)
    load.append(os.getloadavg()[0])
    run_dir = root / "runs" / RUN_NAME
    used = json.loads((run_dir / "run_info.json").read_text())["model_path"]
    if Path(used).resolve() != Path(model_path).resolve():
        raise SystemExit(f"cpu_vs_trl: the launcher trained {used}, not the prepared {model_path}")
    rows = read_metrics(run_dir)
    steps, evals = [], []
    for r in rows:
        acc = next((v for k, v in r.items() if k.startswith("eval/") and k.endswith("/accuracy")), None)
        if acc is not None:
            evals.append(
                {
                    "step": r["step"],
                    "accuracy": acc,
                    "response_length": next((v for k, v in r.items() if k.endswith("/response_length")), None),
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
                    "reward_mean": r["rollout/reward_mean"],
                    "response_length_mean": r.get("rollout/response_length_mean"),
                    "trajectories": r.get("rollout/trajectories"),
                }
            )
    if len(steps) != settings["steps"]:
        raise SystemExit(f"cpu_vs_trl: expected {settings['steps']} steps in {run_dir}, found {len(steps)}")
    return {
        "command": cmd,
        "wall_s": wall,
        "loadavg_1m_before_after": load,
        "steps": steps,
        "evals": evals,
        "final_model": str(run_dir / "final"),
        "run_dir": str(run_dir),
        "old_logprobs_recomputed": settings.get("ours_recomputes_old_logprobs"),
    }


def run_trl(
    args: argparse.Namespace,
    work: Path,
    env: dict[str, str],
    model_path: str,
    settings: dict[str, Any],
    train: list[dict[str, Any]],
    held_out: list[dict[str, Any]],
) -> dict[str, Any]:
    root = work / "trl"
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
            f"cpu_vs_trl: TRL ran {len(result['steps'])} steps / {result['reward_calls']} reward "
            f"calls, expected {settings['steps']} (one generation batch per optimizer step)"
        )
    return {"command": cmd, "wall_s": wall, "loadavg_1m_before_after": load, **result}


def helper_eval(model_dir: str, held_out: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, float]:
    import torch
    from _trl_side import greedy_accuracy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return greedy_accuracy(
        model, tokenizer, held_out, max_new_tokens=settings["max_new_tokens"], reward_params=settings["reward_params"]
    )


# ----------------------------------------------------------------------------- summary
def summarize(side: dict[str, Any], settings: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = side["steps"]
    n_traj = settings["prompts"] * settings["samples"]
    times = [s["step_s"] for s in steps]
    steady = times[warmup:] or times
    rollout = [s["rollout_s"] for s in steps][warmup:] or [s["rollout_s"] for s in steps]
    rewards = [s["reward_mean"] for s in steps]
    k = min(10, len(rewards))
    mean_steady = statistics.fmean(steady)
    evals = side["evals"]
    return {
        "steps": len(steps),
        "wall_total_s": side["wall_s"],
        "step_time_sum_s": sum(times),
        "outside_steps_s": side["wall_s"] - sum(times),
        "step_s_first": times[0],
        "step_s_mean_all": statistics.fmean(times),
        "step_s_mean_steady": mean_steady,
        "step_s_median_steady": statistics.median(steady),
        "step_s_p10_steady": quantile(steady, 0.10),
        "step_s_p90_steady": quantile(steady, 0.90),
        "step_s_min_steady": min(steady),
        "trajectories_per_s_median_steady": n_traj / statistics.median(steady),
        "trajectories_per_s_p10_steady": n_traj / quantile(steady, 0.10),
        "rollout_s_mean_steady": statistics.fmean(rollout),
        "rollout_share_steady": statistics.fmean(rollout) / mean_steady,
        "steps_per_s_steady": 1.0 / mean_steady,
        "trajectories_per_s_steady": n_traj / mean_steady,
        "trajectories_per_s_all_steps": n_traj * len(times) / sum(times),
        "trajectories_per_s_wall": n_traj * len(times) / side["wall_s"],
        "reward_mean_all": statistics.fmean(rewards),
        "reward_mean_first": statistics.fmean(rewards[:k]),
        "reward_mean_last": statistics.fmean(rewards[-k:]),
        "reward_window": k,
        "own_eval_accuracy_start": evals[0]["accuracy"] if evals else None,
        "own_eval_accuracy_end": evals[-1]["accuracy"] if evals else None,
        "own_eval_accuracy_best": max(e["accuracy"] for e in evals) if evals else None,
    }


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (no interpolation), so it is always a measured step."""
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def settings_rows(s: dict[str, Any], ours: dict[str, Any], trl: dict[str, Any]) -> list[tuple[str, str, str]]:
    p = trl.get("parity", {})
    gc = p.get("generation_config", {})
    sched = "constant" if not s["warmup_steps"] else f"linear warm-up {s['warmup_steps']} steps, then constant"
    return [
        ("start model", "same HF folder (warm start of the recipe's builder)", "same"),
        ("optimizer steps", str(s["steps"]), f"{s['steps']} (max_steps)"),
        (
            "prompts x samples per step",
            f"{s['prompts']} x {s['samples']}",
            f"num_generations={s['samples']}, per_device_train_batch_size={s['prompts'] * s['samples']}, "
            "gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1",
        ),
        ("prompts", "launcher's mixer (seed run.seed*7919)", "same records, same order (shuffle_dataset=False)"),
        (
            "prompt rendering",
            "chat template, add_generation_prompt",
            f"conversational prompts (same template); token ids identical: {p.get('prompt_ids_match_chat_template')}",
        ),
        (
            "sampling",
            f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, "
            f"max_new_tokens {s['max_new_tokens']}",
            f"temperature {gc.get('temperature')}, top_p {gc.get('top_p')}, top_k {gc.get('top_k')}, "
            f"max_new_tokens {gc.get('max_new_tokens')} (HF generate)",
        ),
        (
            "stop ids",
            f"{s.get('stop_ids')} (model config + generation config eos)",
            f"{p.get('stop_ids')} (tokenizer + model eos)",
        ),
        ("reward", f"exact_match{s['reward_params']}", "same function on the decoded completion"),
        (
            "advantage",
            f"group z-score, unbiased std, eps {s['advantage_eps']:g}" if s["std_normalize"] else "group mean-centred",
            "scale_rewards=" + ("'group' (eps 1e-4)" if s["std_normalize"] else "'none'"),
        ),
        (
            "policy loss",
            f"PPO clip [{1 - s['clip_low']:g}, {1 + s['clip_high']:g}], token-mean",
            f"epsilon={s['clip_low']:g}, epsilon_high={s['clip_high']:g}, loss_type='dapo'",
        ),
        ("KL / reference model", "none", "beta=0.0"),
        (
            "optimizer",
            f"AdamW lr {s['lr']:g}, betas {tuple(s['betas'])}, eps {s['adam_eps']:g}, "
            f"wd {s['weight_decay']:g}, grad clip {s['grad_clip']:g}, {sched}",
            f"{p.get('optimizer', 'AdamW')} (adamw_torch), same values, lr_scheduler_type={p.get('lr_scheduler')!r}",
        ),
        ("precision / device", "float32, CPU", "float32 (bf16=False), CPU (use_cpu=True), no vLLM"),
        (
            "old log-probs",
            {
                True: "recomputed by an extra forward pass (ratio = 1 on-policy)",
                False: "taken from the training forward (ratio = 1), no extra pass",
                None: "unknown",
            }[ours.get("old_logprobs_recomputed")],
            "taken as the detached current log-probs (ratio = 1), no extra pass",
        ),
        (
            "activation checkpointing",
            "off",
            f"gradient_checkpointing={p.get('gradient_checkpointing')} (TRL's default True, set False to match)",
        ),
        ("torch threads", "every core (placement.torch_threads=0)", str(trl.get("torch_threads"))),
        (
            "held-out eval",
            f"{s['eval_prompts']} test prompts, greedy, "
            + (f"every {s['eval_every']} steps" if s["eval_every"] else "at start and end"),
            "same prompts, greedy HF generate (shared helper)",
        ),
    ]


def noise_note(result: dict[str, Any]) -> list[str]:
    """A warning when other work loaded the machine: step times then measure contention as much as code."""
    cpus = result["machine"]["cpus"] or 1
    peak = max(result["ours"]["loadavg_1m_before_after"] + result["trl"]["loadavg_1m_before_after"])
    if peak <= cpus:
        return []
    return [
        f"**Noisy machine**: the 1-minute load average reached {peak:.1f} on {cpus} cores while the sides ran, "
        "so other processes slowed many steps (compare the p10 and p90 rows). The mean and median move "
        "with that contention; the p10 and min rows estimate the uncontended cost. Re-run on a quiet "
        "machine before quoting absolute numbers.",
        "",
    ]


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    s, ours, trl = result["settings"], result["ours"], result["trl"]
    so, st = result["summary"]["ours"], result["summary"]["trl"]
    acc = result["greedy_accuracy_shared_helper"]
    lines = [
        "# LoongSage vs TRL GRPOTrainer on CPU",
        "",
        f"Recipe `{result['recipe']}` with overrides `{' '.join(result['training_overrides']) or '(none)'}`; "
        f"model `{Path(result['model_path']).name}` ({result['num_parameters']:,} parameters). "
        f"Machine: {result['machine']['cpus']} CPU cores, shared (1-minute load average before/after: "
        f"ours {ours['loadavg_1m_before_after'][0]:.1f}/{ours['loadavg_1m_before_after'][1]:.1f}, "
        f"TRL {trl['loadavg_1m_before_after'][0]:.1f}/{trl['loadavg_1m_before_after'][1]:.1f}). "
        f"torch {result['machine']['torch']}, transformers {trl['versions']['transformers']}, "
        f"TRL {trl['versions']['trl']}. The sides ran one after the other ({result['order']}), never at the same time. "
        + (
            f"Framework source: commit {result['source']['commit'][:10]}"
            + (
                f" with {result['source']['uncommitted_files']} uncommitted file(s)"
                if result["source"]["uncommitted_files"]
                else ""
            )
            + "."
            if result.get("source")
            else ""
        ),
        "",
        "## Settings (identical on both sides unless stated)",
        "",
        "| setting | LoongSage (launcher) | TRL GRPOTrainer |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in settings_rows(s, ours, trl)],
        "",
        "## Results",
        "",
        *noise_note(result),
        f"Steady state leaves out the first {result['warmup_steps']} step(s). Step time = generation + reward + "
        "advantages + loss/backward + optimizer step (+ weight push for LoongSage); start-up, evaluation and "
        "saving are outside it on both sides. Ratio column = LoongSage / TRL.",
        "",
        "| metric | LoongSage | TRL | ratio |",
        "|---|---|---|---|",
    ]

    def row(name: str, a: Any, b: Any, digits: int = 3, r: bool = True) -> None:
        lines.append(f"| {name} | {fmt(a, digits)} | {fmt(b, digits)} | {fmt(ratio(a, b), 2) if r else ''} |")

    row("steady-state s/step (mean)", so["step_s_mean_steady"], st["step_s_mean_steady"])
    row("steady-state s/step (median)", so["step_s_median_steady"], st["step_s_median_steady"])
    row("steady-state s/step (p10, least contended)", so["step_s_p10_steady"], st["step_s_p10_steady"])
    row("steady-state s/step (p90)", so["step_s_p90_steady"], st["step_s_p90_steady"])
    row("steady-state s/step (min)", so["step_s_min_steady"], st["step_s_min_steady"])
    row("steps/s (steady, from mean)", so["steps_per_s_steady"], st["steps_per_s_steady"])
    row("trajectories/s (steady, from mean)", so["trajectories_per_s_steady"], st["trajectories_per_s_steady"], 1)
    row(
        "trajectories/s (steady, from median)",
        so["trajectories_per_s_median_steady"],
        st["trajectories_per_s_median_steady"],
        1,
    )
    row(
        "trajectories/s (steady, from p10)", so["trajectories_per_s_p10_steady"], st["trajectories_per_s_p10_steady"], 1
    )
    row("trajectories/s (all steps)", so["trajectories_per_s_all_steps"], st["trajectories_per_s_all_steps"], 1)
    row("generation share of a step", so["rollout_share_steady"], st["rollout_share_steady"], 2, r=False)
    row("first step s", so["step_s_first"], st["step_s_first"], 2)
    row("sum of step times s", so["step_time_sum_s"], st["step_time_sum_s"], 1)
    row("total wall s (process start to exit)", so["wall_total_s"], st["wall_total_s"], 1)
    row("wall outside steps s (start-up, eval, save)", so["outside_steps_s"], st["outside_steps_s"], 1)
    row("trajectories/s over total wall", so["trajectories_per_s_wall"], st["trajectories_per_s_wall"], 1)
    row(f"mean reward, first {so['reward_window']} steps", so["reward_mean_first"], st["reward_mean_first"], r=False)
    row(
        f"mean reward, last {so['reward_window']} steps (final)",
        so["reward_mean_last"],
        st["reward_mean_last"],
        r=False,
    )
    row("mean reward, all steps", so["reward_mean_all"], st["reward_mean_all"], r=False)
    row("greedy accuracy, start (shared helper)", acc["start"]["accuracy"], acc["start"]["accuracy"], r=False)
    row("greedy accuracy, end (shared helper)", acc["ours_final"]["accuracy"], acc["trl_final"]["accuracy"], r=False)
    row("greedy accuracy, start (own eval)", so["own_eval_accuracy_start"], st["own_eval_accuracy_start"], r=False)
    row("greedy accuracy, end (own eval)", so["own_eval_accuracy_end"], st["own_eval_accuracy_end"], r=False)
    row("greedy accuracy, best (own eval)", so["own_eval_accuracy_best"], st["own_eval_accuracy_best"], r=False)
    lines += [
        "",
        "Own eval: LoongSage's evaluator (its native engine, greedy) and, for TRL, the shared HF-generate helper "
        "on the in-training model. Shared helper: the same greedy HF `generate` code on the start model and on "
        "both final models. Rewards and accuracies come from one seed per side; sampling noise between seeds is "
        "not measured here.",
        "",
        "Start-up, one-off: warm start build or cache hit "
        f"{result['warm_start_s']:.1f} s (before both sides); TRL import {trl['timing']['import_s']:.1f} s, "
        f"TRL model load + trainer init {trl['timing']['init_s']:.1f} s.",
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [("LoongSage", result["ours"], "tab:blue"), ("TRL GRPOTrainer", result["trl"], "tab:orange")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    window = max(1, min(10, result["settings"]["steps"] // 10))
    for name, side, color in sides:
        x = [s["step"] for s in side["steps"]]
        y = [s["reward_mean"] for s in side["steps"]]
        axes[0].plot(x, y, color=color, alpha=0.25, linewidth=1)
        smooth = [statistics.fmean(y[max(0, i - window + 1) : i + 1]) for i in range(len(y))]
        axes[0].plot(x, smooth, color=color, label=f"{name} (mean of last {window})")
        ev = side["evals"]
        axes[1].plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", color=color, label=name)
        axes[2].plot(x, [s["step_s"] for s in side["steps"]], color=color, label=name)
    acc = result["greedy_accuracy_shared_helper"]
    last = result["settings"]["steps"]
    axes[1].plot([0], [acc["start"]["accuracy"]], "k*", markersize=11, label="start, shared helper")
    axes[1].plot(
        [last],
        [acc["ours_final"]["accuracy"]],
        "*",
        color="tab:blue",
        markersize=13,
        markeredgecolor="k",
        label="end, shared helper",
    )
    axes[1].plot([last], [acc["trl_final"]["accuracy"]], "*", color="tab:orange", markersize=13, markeredgecolor="k")
    axes[0].set(title="training reward (exact match) per step", xlabel="step", ylabel="mean reward")
    axes[1].set(
        title=f"greedy held-out accuracy ({len(result['eval_record_indices'])} prompts)",
        xlabel="step",
        ylabel="accuracy",
    )
    axes[2].set(title="wall time per step (log scale)", xlabel="step", ylabel="seconds", yscale="log")
    s = result["settings"]
    fig.suptitle(
        f"{result['recipe']}: {s['prompts']} prompts x {s['samples']} samples, "
        f"{s['max_new_tokens']} new tokens, lr {s['lr']:g}, {s['steps']} steps (same settings both sides)"
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_summary(result: dict[str, Any]) -> None:
    settings, warmup, ours, trl = result["settings"], result["warmup_steps"], result["ours"], result["trl"]
    summary = {"ours": summarize(ours, settings, warmup), "trl": summarize(trl, settings, warmup)}
    so, st = summary["ours"], summary["trl"]
    summary["ratios_ours_over_trl"] = {
        "trajectories_per_s_steady": ratio(so["trajectories_per_s_steady"], st["trajectories_per_s_steady"]),
        "step_s_mean_steady": ratio(so["step_s_mean_steady"], st["step_s_mean_steady"]),
        "step_s_median_steady": ratio(so["step_s_median_steady"], st["step_s_median_steady"]),
        "step_s_p10_steady": ratio(so["step_s_p10_steady"], st["step_s_p10_steady"]),
        "trajectories_per_s_median_steady": ratio(
            so["trajectories_per_s_median_steady"], st["trajectories_per_s_median_steady"]
        ),
        "trajectories_per_s_p10_steady": ratio(
            so["trajectories_per_s_p10_steady"], st["trajectories_per_s_p10_steady"]
        ),
        "step_time_sum_s": ratio(so["step_time_sum_s"], st["step_time_sum_s"]),
        "wall_total_s": ratio(so["wall_total_s"], st["wall_total_s"]),
    }
    result["summary"] = summary


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    add_summary(result)
    (out / "cpu_vs_trl.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_markdown(out / "cpu_vs_trl.md", result)
    write_plot(out / "cpu_vs_trl.png", result)
    print((out / "cpu_vs_trl.md").read_text())
    print(f"wrote {out / 'cpu_vs_trl.json'}, {out / 'cpu_vs_trl.md'}, {out / 'cpu_vs_trl.png'}")


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_outputs(args.out_dir, json.loads((args.out_dir / "cpu_vs_trl.json").read_text()))
        return 0
    import importlib.util

    source = source_state()  # the commit measured, taken before anything runs
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(
            "cpu_vs_trl: TRL is not installed in this environment; run with "
            "`uv run --group bench python bench/cpu_vs_trl.py ...`"
        )
    os.environ.setdefault("LOONGSAGE_CACHE", str(BENCH / "work" / "cache"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    work = BENCH / "work" / ("cpu_vs_trl_quick" if args.quick else "cpu_vs_trl")
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from loongsage.core.config import load_config
    from loongsage.core.controller import resolve_model_path

    overrides = training_overrides(args)
    cfg, registry = load_config(args.recipe, overrides, config_dir=str(REPO / "recipes"))
    settings = extract_settings(cfg, registry)
    warmup = max(0, min(args.warmup_steps, settings["steps"] - 1))
    print("settings:", json.dumps({k: v for k, v in settings.items() if not k.endswith("_reader")}), flush=True)

    t = time.perf_counter()
    model_path = resolve_model_path(cfg, registry)  # what the launcher does; builds and caches once
    warm_start_s = time.perf_counter() - t
    print(f"model: {model_path} ({warm_start_s:.1f} s)", flush=True)

    settings["stop_ids"] = model_stop_ids(model_path)
    settings["ours_recomputes_old_logprobs"] = ours_recomputes_old_logprobs(cfg, registry)
    train = training_records(cfg, registry, settings["steps"])
    held_out = eval_records(cfg, registry)
    start_acc = helper_eval(model_path, held_out, settings)
    print(f"start greedy accuracy (shared helper): {start_acc['accuracy']:.3f}", flush=True)

    sides: dict[str, dict[str, Any]] = {}
    for name in ("trl", "ours") if args.trl_first else ("ours", "trl"):
        if name == "ours":
            sides[name] = run_ours(args, work, env, model_path, settings)
        else:
            sides[name] = run_trl(args, work, env, model_path, settings, train, held_out)
        print(f"{name}: {sides[name]['wall_s']:.1f} s wall", flush=True)
    ours, trl = sides["ours"], sides["trl"]

    acc = {
        "start": start_acc,
        "ours_final": helper_eval(ours["final_model"], held_out, settings),
        "trl_final": helper_eval(trl["final_model"], held_out, settings),
    }
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    result = {
        "source": source,
        "recipe": args.recipe,
        "quick": args.quick,
        "order": "trl, ours" if args.trl_first else "ours, trl",
        "training_overrides": overrides,
        "settings": settings,
        "warmup_steps": warmup,
        "model_path": model_path,
        "num_parameters": n_params,
        "warm_start_s": warm_start_s,
        "warm_start_params": json.loads((Path(model_path) / "loongsage_warmstart.json").read_text()).get("params")
        if (Path(model_path) / "loongsage_warmstart.json").is_file()
        else None,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "train_record_indices": [r["index"] for r in train],
        "eval_record_indices": [r["index"] for r in held_out],
        "greedy_accuracy_shared_helper": acc,
        "ours": ours,
        "trl": trl,
    }
    write_outputs(args.out_dir, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
