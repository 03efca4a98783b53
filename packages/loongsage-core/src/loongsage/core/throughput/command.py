"""``loongsage plan <recipe> [key=value ...] [--gpus N] [--gpu h200|h100|a100] [--lengths MEDIAN,P99]``.

The recipe is loaded and validated as ``loongsage train`` loads it (overrides included); what it
does not say comes from the flags. A mistake is one line (a :class:`ConfigError`: the launcher
prints it and exits 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loongsage.core.sim.engine import LengthModel
from loongsage.core.throughput import constants as C
from loongsage.core.types import ConfigError

USAGE = "loongsage plan <recipe> [key=value ...] [--gpus N] [--gpu h200|h100|a100] [--lengths MEDIAN,P99]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "recipe", nargs="?", help="recipe name (e.g. gpu/grpo_qwen3_1p7b_random_h200) or path to a YAML file"
    )
    p.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, as for train")
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="cards to plan for (default: the recipe's)")
    p.add_argument("--gpu", default="h200", choices=sorted(C.ACCELERATORS), help="the card (default h200)")
    p.add_argument(
        "--lengths",
        default=None,
        metavar="MEDIAN,P99",
        help="response lengths, log-normal by median and 99th percentile (default: every sample runs to "
        "max_new_tokens, exact for random_init models)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=None, metavar="N", help="tokens a prompt (default: the reader's length)"
    )
    p.add_argument("--config-dir", default=None, help="extra directory searched first for recipes")


def parse_lengths(text: str | None) -> LengthModel | None:
    """``MEDIAN,P99`` as a LengthModel, or None."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        median, p99 = (float(x) for x in parts)
    except ValueError:
        median = p99 = -1.0
    if len(parts) != 2 or not 1 <= median <= p99:
        raise ConfigError(
            f"plan: --lengths {text!r}: expected MEDIAN,P99 in tokens with 1 <= MEDIAN <= P99, e.g. --lengths 256,2560"
        )
    return LengthModel(median=median, p99=p99)


def run(args: argparse.Namespace) -> int:
    from loongsage.core.config import load_config
    from loongsage.core.throughput.placement import plan
    from loongsage.core.throughput.report import render
    from loongsage.core.throughput.workload import workload

    if args.recipe is None:
        raise ConfigError(f"plan: no recipe given; usage: {USAGE}; `loongsage recipes` lists the recipes")
    if "=" in args.recipe and not Path(args.recipe).is_file():
        raise ConfigError(f"plan: the recipe comes first, got the override {args.recipe!r}; usage: {USAGE}")
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"plan: --gpus {args.gpus}: at least 1 card")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ConfigError(f"plan: --prompt-tokens {args.prompt_tokens}: at least 1 token")
    lengths = parse_lengths(args.lengths)
    cfg, registry = load_config(args.recipe, args.overrides, config_dir=args.config_dir)
    work = workload(cfg, lengths=lengths, prompt_tokens=args.prompt_tokens, registry=registry)
    gpus = args.gpus if args.gpus is not None else int(work.recipe_gpus)
    if gpus < 1:
        raise ConfigError(
            "plan: the recipe runs on the CPU (placement.gpus_per_actor=0) and the model prices GPUs; "
            "pass --gpus N to plan it on N cards"
        )
    accel = C.ACCELERATORS[args.gpu]
    result = plan(work, accel, gpus)
    if result.chosen is None:
        least = min(result.considered, key=lambda p: p.memory.card)
        m = least.memory
        raise ConfigError(
            f"plan: the model ({work.shape.total_params / 1e9:.3g}B parameters, {work.dtype}) fits no placement on "
            f"{gpus} x {accel.name}: the leanest ({least.placement.describe()}) needs {m.card / 1e9:.1f} GB on a card "
            f"of {m.limit / 1e9:.1f} GB usable (trainer state {m.trainer_state / 1e9:.1f}, activations "
            f"{m.activations / 1e9:.1f}, engine {m.engine / 1e9:.1f}); more cards (--gpus), a larger card (--gpu), "
            "or less on each card (trainer.micro_batch_tokens, gradient_checkpointing, placement.offload_trainer)"
        )
    print(render(args.recipe, work, accel, result))
    return 0
