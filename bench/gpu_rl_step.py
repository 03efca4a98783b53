"""One GRPO step on one GPU: LoongSage through its launcher against TRL's ``GRPOTrainer``, same work.

Workload (both sides): a Qwen3-1.7B-shaped model with random bf16 weights (the ``random_init``
builder; the same folder for both), 16 prompts x 8 samples per step, prompts of exactly 128 tokens,
exactly 256 sampled tokens per sample (temperature 1, no filter; the model has no end-of-sequence
token), micro-batches of 32 rows, one optimizer step per step, no KL term, no gradient
checkpointing, a constant reward. On a card under 100 GB our side runs micro-batches of 6,144 tokens
(16 rows; :func:`fitting_overrides`): the recipe's 12,288 do not fit there beside the engine's memory.
The table's header names every override of our recipe.

* ``ours``: ``loongsage train gpu/grpo_qwen3_1p7b_random_h200`` in a subprocess (Ray, the native
  engine with CUDA graphs, the torch trainer, the ``ipc`` weight push, colocated on the card). Step
  times and their breakdown (rollout / train / sync) come from the run's ``metrics.jsonl``.
  With ``--engine sglang``, the same recipe with ``rollout.engine.name=sglang`` and nothing else
  changed (results ``gpu_rl_step_sglang``).
* ``trl``: ``bench/_trl_gpu_step.py`` in a subprocess (HF ``generate`` inside ``GRPOTrainer``),
  timed per optimizer step by a callback.

Both sides run ``--steps`` steps; the first ``--warmup`` of each are dropped (compilation, graph
capture, allocator) and the medians of the rest are compared. Each side's peak GPU memory is the
card's used memory (every process on it: our engine and trainer actors, or TRL's one process),
sampled every 0.1 s while the side runs. Our step's timeline (rollout, batch building and transfers,
the trainer's own compute, the weight push) is written as a Chrome trace,
``bench/results/<name>.trace.json`` (open it in ``chrome://tracing`` or Perfetto). The train phase's MFU divides its
matmul FLOPs (6 x parameters in matmuls x tokens, the LM head included) by the bf16 matmul rate
measured on the same card in the same run.

``--share-prompts`` runs our torch trainer with ``share_prompts`` (each group's prompt computed once
for its 8 rows: 128 of every 384 tokens, 7 times in 8; results ``<name>_shared``). The same samples
and the same gradient: the MFU then counts the FLOPs the trainer computed (the prompt tokens it did
not compute again, ``train/shared_prompt_tokens``, taken out), and the table gives the train phase's
rate in the rows' tokens (prompts and responses) besides.

``--profile-step N`` runs our side with ``run.profile_steps=[N]``: each of our actors (the trainer
rank, the engine, the reward worker) records a ``torch.profiler`` trace of step N, its ops and CUDA
kernels, copied to ``<out-dir>/<name>.step<N>.<role>.<rank>.trace.json.gz``. That step carries the
profiler's overhead, so it is left out of the medians and the timeline. With ``--engine sglang`` the
engine's trace holds only its client: the kernels run in SGLang's server process.

    python bench/gpu_rl_step.py [--steps 7] [--warmup 2] [--engine native|sglang] [--trainer torch|megatron]
                                [--share-prompts] [--profile-step N] [--plugins ...]

Needs one CUDA GPU, Ray, TRL (``trl``, ``datasets``) and the loongsage packages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402

RECIPE = "gpu/grpo_qwen3_1p7b_random_h200"
PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, MICRO_ROWS = 16, 8, 128, 256, 32


def matmul_tflops() -> float:
    """The card's dense bf16 matmul rate (8192^3, best of a few)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * 8192**3 / best / 1e12


def matmul_params(model_path: str) -> int:
    """Parameters that enter a matmul per token: every weight but the embedding lookup, the LM head
    counted even when tied to it."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    attn = c.hidden_size * c.head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attn + mlp) + c.vocab_size * c.hidden_size


@contextmanager
def card_memory_peak(into: dict, key: str = "peak_card_gb"):
    """The card's peak used memory (all processes) while the block runs, sampled every 0.1 s."""
    done, peak = threading.Event(), [0]

    def sample() -> None:
        while not done.wait(0.1):
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], total - free)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        into[key] = peak[0] / 1e9


def span(name: str, start_s: float, seconds: float, *, row: int) -> dict:
    """One complete event of a Chrome trace (microseconds)."""
    return {"name": name, "ph": "X", "ts": start_s * 1e6, "dur": seconds * 1e6, "pid": 0, "tid": row}


def timeline(rows: list[dict]) -> dict:
    """A Chrome trace of the measured steps laid end to end from their phase times: rollout, the
    train phase split into batch building + transfers and the trainer's own compute, the push."""
    events, t = [], 0.0
    for i, r in enumerate(rows):
        compute = r.get("timing/trainer_compute_s", 0.0)
        phases = [
            ("rollout", r["timing/rollout_s"]),
            ("batch + transfers", r["timing/train_s"] - compute),
            ("trainer compute", compute),
            ("weight push", r["timing/sync_s"]),
        ]
        events.append(span(f"step {i}", t, r["timing/step_s"], row=0))
        for name, dur in phases:
            events.append(span(name, t, dur, row=1))
            t += dur
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def run(cmd: list[str], log: Path, env: dict) -> None:
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        sys.exit(f"{cmd[:4]} failed (rc {rc}); see {log}:\n" + "".join(log.read_text().splitlines(True)[-20:]))


def fitting_overrides() -> list[str]:
    """What the H200 recipe needs to fit the card at hand: on one under 100 GB (an H100's 80) its
    micro-batches of 12,288 tokens do not fit beside the engine's memory, 6,144 do."""
    small = torch.cuda.get_device_properties(0).total_memory < 100e9
    return ["trainer.micro_batch_tokens=6144"] if small else []


def ours(args, work: Path, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "loongsage.core.cli",
        "train",
        RECIPE,
        f"run.total_steps={args.steps}",
        f"run.output_dir={work / 'runs'}",
        f"run.log_dir={work / 'log'}",
        "tracking.progress=false",
    ]
    if args.plugins:
        cmd.append(f"plugins=[{args.plugins}]")
    if args.profile_step:
        cmd.append(f"run.profile_steps=[{args.profile_step}]")
    if args.engine != "native":
        # a new engine name on the command line starts from empty params: the recipe's go with it
        import yaml

        recipe = yaml.safe_load((BENCH.parent / "recipes" / f"{RECIPE}.yaml").read_text())
        params = ", ".join(f"{k}: {v}" for k, v in (recipe["rollout"]["engine"].get("params") or {}).items())
        cmd.append(f"rollout.engine={{name: {args.engine}, params: {{{params}}}}}")
    if args.trainer != "torch":  # the torch trainer's params (compile_layers) are not another's
        cmd.append(f"trainer.backend={{name: {args.trainer}, params: {{device: cuda}}}}")
    if args.share_prompts:
        cmd.append("trainer.backend.params.share_prompts=true")
    cmd += args.set  # last: they refine the engine and trainer chosen above
    start = time.perf_counter()
    memory: dict = {}
    with card_memory_peak(memory):
        run(cmd, work / "ours.log", env)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in next((work / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    # the profiled step's times carry the profiler's overhead
    keep = [r for r in rows[args.warmup :] if r["step"] != args.profile_step]
    phases = ("step", "rollout", "train", "sync", "trainer_compute")
    pick = {k: [r.get(f"timing/{k}_s", 0.0) for r in keep] for k in phases}
    return {
        "wall_s": wall,
        "steps": len(rows),
        **{f"{k}_s_all": v for k, v in pick.items()},
        **{f"{k}_s": statistics.median(v) for k, v in pick.items()},
        "response_length_mean": statistics.mean(r["rollout/response_length_mean"] for r in keep),
        "shared_prompt_tokens": statistics.median(r.get("train/shared_prompt_tokens", 0.0) for r in keep),
        # the engine's and the trainer's log-probs of the sampled tokens, apart (train/is_approx_k3_kl)
        "k3_all": (k3 := [r["train/is_approx_k3_kl"] for r in keep if "train/is_approx_k3_kl" in r]),
        "k3_median": statistics.median(k3) if k3 else None,
        **memory,
        "timeline": timeline(keep),
        "profile": sorted((work / "runs").glob(f"*/profile/step{args.profile_step}.*.trace.json.gz")),
    }


def trl(args, work: Path, env: dict, model_path: str, prompts: list[str]) -> dict:
    spec = {
        "model": model_path,
        "prompts": prompts,
        "prompt_tokens": PROMPT_TOKENS,
        "prompts_per_step": PROMPTS,
        "samples_per_prompt": SAMPLES,
        "new_tokens": NEW_TOKENS,
        "micro_batch_rows": MICRO_ROWS,
        "steps": args.steps,
    }
    (work / "trl_spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    memory: dict = {}
    with card_memory_peak(memory):
        run(
            [sys.executable, str(BENCH / "_trl_gpu_step.py"), str(work / "trl_spec.json"), str(work / "trl.json")],
            work / "trl.log",
            env,
        )
    out = json.loads((work / "trl.json").read_text())
    keep = out["step_s"][args.warmup :]
    return {
        "wall_s": time.perf_counter() - start,
        "steps": len(out["step_s"]),
        "step_s_all": keep,
        "step_s": statistics.median(keep),
        "peak_gb": out["peak_gb"],
        "completion_mean_length": out["completion_mean_length"],
        **memory,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plugins", default="", help="plugin modules to load where entry points are not installed")
    ap.add_argument(
        "--engine",
        default="native",
        help="our rollout engine: the recipe's (native) or another by name (sglang), nothing else changed",
    )
    ap.add_argument(
        "--trainer",
        default="torch",
        help="our trainer backend: the recipe's (torch, compiled) or another by name (megatron: Transformer "
        "Engine's layers where they import, else sdpa), with its default params on the GPU",
    )
    ap.add_argument(
        "--share-prompts",
        action="store_true",
        help="our torch trainer computes each group's prompt once (share_prompts); the MFU counts what it computed",
    )
    ap.add_argument(
        "--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="more overrides of our recipe"
    )
    ap.add_argument(
        "--profile-step",
        type=int,
        default=0,
        metavar="N",
        help="a torch.profiler trace of our step N from each actor, copied to the out dir (0: none); "
        "the step is left out of the medians",
    )
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    name = "gpu_rl_step" + ("" if args.engine == "native" else f"_{args.engine}")
    name += "" if args.trainer == "torch" else f"_{args.trainer}"
    name += "_shared" if args.share_prompts else ""
    if args.share_prompts and args.trainer != "torch":
        sys.exit(f"--share-prompts: the torch trainer's option; not with --trainer {args.trainer}")
    if not 0 <= args.profile_step <= args.steps:
        sys.exit(f"--profile-step {args.profile_step}: must be a step from 1 to --steps {args.steps} (0: none)")
    if args.steps - args.warmup - (args.profile_step > args.warmup) < 3:
        sys.exit("--steps - --warmup must leave at least 3 measured steps (the profiled step is not measured)")
    source = source_state()  # the commit measured, first
    if not any(o.startswith("trainer.micro_batch_tokens=") for o in args.set):
        args.set = fitting_overrides() + args.set
    from loongsage.core.tinytask.shapes import RandomDigits, RandomInitModel

    work = Path(tempfile.mkdtemp(prefix="bench-gpu-rl-step-"))
    env = dict(os.environ, LOONGSAGE_CACHE=str(work / "cache"), RAY_AUTH_MODE="disabled")
    os.environ["LOONGSAGE_CACHE"] = env["LOONGSAGE_CACHE"]
    model_path = str(RandomInitModel(preset="qwen3-1.7b", dtype="bfloat16").build())  # the recipe's builder params
    peak = matmul_tflops()
    torch.cuda.empty_cache()
    digits = RandomDigits(length=PROMPT_TOKENS)
    prompts = [digits[i].prompt for i in range(PROMPTS * args.steps)]
    side_ours = ours(args, work, env)
    side_trl = trl(args, work, env, model_path, prompts)
    tokens = PROMPTS * SAMPLES * (PROMPT_TOKENS + NEW_TOKENS)
    # the FLOPs the trainer computed: a prompt it computed once for its rows counts once
    train_flops = 6 * matmul_params(model_path) * (tokens - side_ours["shared_prompt_tokens"])
    side_ours["row_tokens_per_s"] = tokens / side_ours["train_s"]
    side_ours["train_mfu"] = train_flops / side_ours["train_s"] / (peak * 1e12)
    if side_ours["trainer_compute_s"]:
        side_ours["trainer_compute_mfu"] = train_flops / side_ours["trainer_compute_s"] / (peak * 1e12)
    side_ours["rollout_tokens_per_s"] = PROMPTS * SAMPLES * NEW_TOKENS / side_ours["rollout_s"]
    n = PROMPTS * SAMPLES
    for side in (side_ours, side_trl):
        side["trajectories_per_s"] = n / side["step_s"]
    result = {
        "source": source,
        "settings": vars(args)
        | {
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "micro_batch_rows": MICRO_ROWS,
        },
        "device": torch.cuda.get_device_name(0),
        "matmul_tflops": peak,
        "ours": side_ours,
        "trl": side_trl,
        "speedup": side_trl["step_s"] / side_ours["step_s"],
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.trace.json").write_text(json.dumps(side_ours.pop("timeline")) + "\n")
    side_ours["profile_traces"] = []
    for trace in side_ours.pop("profile"):  # step<N>.<role>.<rank>.trace.json.gz, prefixed with the result's name
        shutil.copyfile(trace, out / f"{name}.{trace.name}")
        side_ours["profile_traces"].append(f"{name}.{trace.name}")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    o, t = side_ours, side_trl
    profiled = f" (our profiled step {args.profile_step} left out)" if args.profile_step > args.warmup else ""
    overrides = f"; our recipe with `{' '.join(args.set)}`" if args.set else ""  # e.g. smaller micro-batches
    lines = [
        f"commit `{source['commit'][:10]}`; {result['device']}; rollout engine `{args.engine}`; "
        f"trainer `{args.trainer}`; "
        f"Qwen3-1.7B shape, random bf16 weights; "
        f"{PROMPTS} prompts x {SAMPLES} samples, {PROMPT_TOKENS} + exactly {NEW_TOKENS} tokens, micro-batch "
        f"{MICRO_ROWS} rows, one optimizer step per step; median of {args.steps - args.warmup} steps after "
        f"{args.warmup} warm-up steps on each side{profiled}{overrides}; bf16 matmul rate measured here "
        f"{peak:.0f} TFLOP/s",
        "",
        "| | LoongSage | TRL GRPOTrainer | TRL / LoongSage |",
        "|---|---:|---:|---:|",
        f"| seconds per step | {o['step_s']:.2f} | {t['step_s']:.2f} | {result['speedup']:.2f}x |",
        f"| the measured steps, min-max s | {min(o['step_s_all']):.2f}-{max(o['step_s_all']):.2f} | "
        f"{min(t['step_s_all']):.2f}-{max(t['step_s_all']):.2f} | |",
        f"| trajectories / s | {o['trajectories_per_s']:.1f} | {t['trajectories_per_s']:.1f} | |",
        f"| rollout s ({o['rollout_tokens_per_s']:.0f} sampled tokens/s) | {o['rollout_s']:.2f} | | |",
        f"| train s (MFU {o['train_mfu']:.0%}; {o['row_tokens_per_s']:.0f} tokens of the rows / s) | "
        f"{o['train_s']:.2f} | | |",
        f"| prompt tokens not computed again (share_prompts) | {o['shared_prompt_tokens']:.0f} | | |",
        f"| of which the trainer's compute (MFU {o.get('trainer_compute_mfu', 0):.0%}) | "
        f"{o['trainer_compute_s']:.2f} | | |",
        f"| of which batch building + transfers | {o['train_s'] - o['trainer_compute_s']:.2f} | | |",
        f"| weight sync s | {o['sync_s']:.3f} | | |",
        *(
            [f"| k3 KL, engine vs trainer log-probs (median) | {o['k3_median']:.2e} | | |"]
            if o.get("k3_median") is not None
            else []
        ),
        f"| peak GPU memory, the card's (all processes) | {o['peak_card_gb']:.0f} GB | {t['peak_card_gb']:.0f} GB | |",
        f"| TRL's own peak allocated | | {t['peak_gb']:.0f} GB | |",
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
