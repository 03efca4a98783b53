"""What a mode of the step costs: `gpu_rl_step`'s work, ours only, run twice on one GPU, with the mode and without.

``--mode`` picks it:

* ``batch_invariant`` (the default): ``batch_invariant`` on the native engine and the torch trainer
  (its layers uncompiled: the invariant forward is the engine's kernels, the backward the HF ops'
  gradients, written out and compiled);
* ``fp8``: the torch trainer's decoder GEMMs in FP8 (``fp8: hybrid``, row-wise scales), the engine
  in bf16;

against ``fast``: the recipe as it is (the peer: our fast path, same card, same run).

Each side runs ``--steps`` steps through the launcher (Ray, colocated, CUDA graphs) and drops the
first ``--warmup``; the medians of the rest are compared, with each step's
``train/is_approx_k3_kl``, the k3 KL between the engine's and the trainer's log-probs of the sampled
tokens: exactly 0 is what the batch-invariant mode is for. A side's run folder (a 1.7B model's
checkpoint with its optimizer state) is removed once it is measured. On a card under 100 GB both
sides run micro-batches of 6,144 tokens (the recipe's 12,288 do not fit beside the engine there).

    python bench/gpu_invariant_step.py [--mode batch_invariant|fp8] [--steps 6] [--warmup 2]

Writes ``bench/results/gpu_rl_step_invariant.json`` and ``.md`` (``gpu_rl_step_fp8`` for ``fp8``;
``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
from _source import source_state

BENCH = Path(__file__).resolve().parent
# mode -> (its overrides, its label, the name of its results)
MODES = {
    "batch_invariant": (
        [
            "rollout.engine.params.batch_invariant=true",
            "trainer.backend.params.batch_invariant=true",
            "trainer.backend.params.compile_layers=false",
        ],
        "batch-invariant",
        "gpu_rl_step_invariant",
    ),
    "fp8": (["trainer.backend.params.fp8=hybrid"], "FP8 trainer", "gpu_rl_step_fp8"),
}


def side(name: str, overrides: list[str], steps: int, warmup: int, cache: Path) -> dict:
    import gpu_rl_step

    work = Path(tempfile.mkdtemp(prefix=f"bench-invariant-{name}-"))
    env = dict(os.environ, LOONGSAGE_CACHE=str(cache), RAY_AUTH_MODE="disabled")
    args = types.SimpleNamespace(
        steps=steps,
        warmup=warmup,
        plugins=None,
        profile_step=0,
        engine="native",
        trainer="torch",
        share_prompts=False,
        set=overrides,
    )
    try:
        figures = gpu_rl_step.ours(args, work, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures.pop("timeline")
    figures.pop("profile")
    return {**figures, "set": overrides}


def markdown(result: dict) -> str:
    mode = result.get("mode", "batch_invariant")
    inv, fast, label = result[mode], result["fast"], MODES[mode][1]
    recipe = f"the recipe with `{' '.join(result['base'])}`" if result["base"] else "the recipe as it is"
    lines = [
        f"commit `{result['source']['commit'][:10]}`; {result['device']}; `gpu_rl_step`'s work, ours only "
        f"({recipe} on both sides); median of {result['measured']} steps after {result['warmup']} warm-up "
        f"steps" + (f"; {result['note']}" if result.get("note") else ""),
        "",
        f"| | {label} | fast | {label} / fast |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (
        ("step_s", "seconds per step"),
        ("rollout_s", "rollout s"),
        ("train_s", "train s"),
        ("trainer_compute_s", "of which the trainer's compute"),
        ("sync_s", "weight sync s"),
    ):
        lines.append(f"| {label} | {inv[key]:.3f} | {fast[key]:.3f} | {inv[key] / fast[key]:.2f}x |")
    lines += [
        f"| k3 KL in the step (median; max) | {inv['k3_median']:.2e}; {max(inv['k3_all']):.2e} | "
        f"{fast['k3_median']:.2e}; {max(fast['k3_all']):.2e} | |",
        f"| peak GPU memory, the card's | {inv['peak_card_gb']:.0f} GB | {fast['peak_card_gb']:.0f} GB | |",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=list(MODES), default="batch_invariant")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    if args.steps - args.warmup < 3:
        sys.exit("--steps - --warmup must leave at least 3 measured steps")
    source = source_state()  # the commit measured, first
    import gpu_rl_step

    base = gpu_rl_step.fitting_overrides()
    cache = Path(tempfile.mkdtemp(prefix="bench-invariant-cache-"))  # the model, built once for both sides
    result = {
        "source": source,
        "device": torch.cuda.get_device_name(0),
        "mode": args.mode,
        "base": base,
        "warmup": args.warmup,
        "measured": args.steps - args.warmup,
    }
    overrides, _, results = MODES[args.mode]
    for name, extra in ((args.mode, overrides), ("fast", [])):
        result[name] = side(name, base + extra, args.steps, args.warmup, cache)
        print(name, {k: result[name][k] for k in ("step_s", "rollout_s", "train_s", "k3_median")}, flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{results}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{results}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
