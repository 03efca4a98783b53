"""A GRPO train step with each prompt computed once (``share_prompts``) against the plain forward.

The plain forward is what TRL's ``GRPOTrainer`` and verl compute: every row, prompt included, through
the model (TRL's ``_get_per_token_logps`` is the model's forward over prompt + completion). Both
sides here are the torch trainer on the same batch, the same model and the same micro-batch token
budget; only ``share_prompts`` differs. Each side's step (forward, backward, optimizer) is timed
after one warm-up step, ``--repeats`` times, alternating sides; the table gives the medians, their
ratio, and what each side computed in padded tokens (from the plans, exact).

Workloads, on a Qwen3-shaped model on the CPU (hidden 128, 8 layers, vocabulary 2,048: its LM head
is 14% of the matmul FLOPs, Qwen3-1.7B's 18%):

* ``math``: 4 prompts x 8 samples, 128-token prompts, responses of 64-256 tokens (a reasoning
  task's spread);
* ``long_prompt``: 4 prompts x 8 samples, 512-token prompts (a long task statement, or a multi-turn
  history), responses of 32-128 tokens;
* ``gpu_bench_shape``: 2 prompts x 8 samples of ``bench/gpu_rl_step``'s 128 + exactly 256 tokens;
* ``distinct``: 32 prompts x 1 sample (nothing to share): the option must cost nothing.

    python bench/shared_prompts.py [--repeats 5] [--threads 2]

Results: ``bench/results/shared_prompts.json`` and ``.md``. On the GPU, the same option is measured
inside the whole RL step by ``bench/gpu_rl_step.py --share-prompts``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _source import source_state  # noqa: E402

WORKLOADS = {  # prompts, samples, prompt tokens, response tokens (low, high)
    "math": (4, 8, 128, (64, 256)),
    "long_prompt": (4, 8, 512, (32, 128)),
    "gpu_bench_shape": (2, 8, 128, (256, 256)),
    "distinct": (32, 1, 128, (64, 256)),
}
BUDGET = 16_384  # micro-batch tokens (the plain forward's rows x longest; the two passes' computed tokens)
VOCAB = 2048


def computed_tokens(b, share: bool) -> int:
    """Padded tokens through the model body in a step, as the trainer plans and runs it."""
    from loongsage.core.trainer.micro_batching import PASS_OVERHEAD_TOKENS, planned_micro_batches
    from loongsage.core.trainer.shared_prompts import shared_groups

    total = 0
    for _, mb in planned_micro_batches(b, BUDGET, group_by_length=True, share_prompts=share):
        groups = shared_groups(mb, PASS_OVERHEAD_TOKENS) if share else None
        total += groups.tokens() if groups is not None else mb.input_ids.numel()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    if args.repeats < 3:
        sys.exit(f"--repeats {args.repeats}: at least 3")
    source = source_state()  # the commit measured, first
    torch.set_num_threads(args.threads)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from loongsage.algos.policy_losses import PPOClip
    from loongsage.core.loss import LossPlan
    from loongsage.core.tinytask.shapes import grouped_train_batch
    from loongsage.core.trainer.torch_trainer import TorchTrainer

    model_dir = Path(tempfile.mkdtemp(prefix="bench-shared-prompts-"))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    plan = LossPlan(policy_loss=PPOClip(clip_low=0.2, clip_high=0.28), aggregation="token-mean")
    results = {}
    for name in args.workloads:
        prepared, _ = plan.prepare(grouped_train_batch(*WORKLOADS[name], vocab=VOCAB, seed=1))
        sides = {}
        for share in (False, True):
            trainer = TorchTrainer(str(model_dir), share_prompts=share)
            trainer.setup_optimizer(lr=1e-30, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1e9)
            sides[share] = trainer
        times: dict[bool, list[float]] = {False: [], True: []}
        losses: dict[bool, float] = {}
        for rep in range(args.repeats + 1):  # the first step of each side warms it
            for share, trainer in sides.items():
                start = time.perf_counter()
                metrics = trainer.train_step(prepared, plan.closure(), BUDGET)
                if rep:
                    times[share].append(time.perf_counter() - start)
                losses[share] = metrics.totals["train/loss"]
        plain_s, shared_s = (statistics.median(times[s]) for s in (False, True))
        tokens = int(prepared.attention_mask.sum())
        results[name] = {
            "workload": dict(zip(("prompts", "samples", "prompt_tokens", "response_tokens"), WORKLOADS[name])),
            "tokens": tokens,
            "plain_s": times[False],
            "shared_s": times[True],
            "plain_median_s": plain_s,
            "shared_median_s": shared_s,
            "speedup": plain_s / shared_s,
            "plain_computed_tokens": computed_tokens(prepared, False),
            "shared_computed_tokens": computed_tokens(prepared, True),
            "loss_difference": abs(losses[True] - losses[False]),
        }
        print(name, f"{results[name]['speedup']:.2f}x", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"source": source, "settings": vars(args) | {"budget": BUDGET, "vocab": VOCAB}, "results": results}
    (out / "shared_prompts.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"commit `{source['commit'][:10]}`; CPU, {args.threads} threads; Qwen3-shaped model (hidden 128, 8 layers, "
        f"vocabulary {VOCAB}), float32; one GRPO step (PPO-clip, token-mean) per timing, micro-batches of "
        f"{BUDGET} tokens; median of {args.repeats} after one warm-up step per side, sides alternating. "
        "Plain: every row through the model, prompt included (what TRL's GRPOTrainer and verl compute).",
        "",
        "| workload | rows x (prompt + response) | plain s | share_prompts s | plain / shared | "
        "tokens computed, plain | shared | loss difference |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        w = r["workload"]
        lo, hi = w["response_tokens"]
        shape = f"{w['prompts']}x{w['samples']} x ({w['prompt_tokens']} + {lo if lo == hi else f'{lo}-{hi}'})"
        lines.append(
            f"| {name} | {shape} | {r['plain_median_s']:.3f} | {r['shared_median_s']:.3f} | {r['speedup']:.2f}x | "
            f"{r['plain_computed_tokens']} | {r['shared_computed_tokens']} | {r['loss_difference']:.1e} |"
        )
    (out / "shared_prompts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
