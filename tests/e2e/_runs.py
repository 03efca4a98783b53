"""Launcher arguments of the audited tiny GRPO runs that the asynchronous, kill-and-resume and
engine-recovery tests compare against: the same words give the same run, made once (the ``launched``
fixture), whichever of those tests needs it first."""

from __future__ import annotations

STEPS = 5
SYNC = "{name: sync}"
WINDOWED = "{name: windowed_fifo, params: {max_staleness: 2}}"
# CI-sized: 4 prompts x 4 samples, evaluation of 4 prompts only at the start and end, no progress
# bar, no HF export at the end
SMALL = (
    "data_sources.0.prompts_per_step=4",
    "data_sources.0.samples_per_prompt=4",
    "evaluation.every_steps=0",
    "evaluation.max_prompts=4",
    "evaluation.pass_k=0",
    "tracking.progress=false",
    "checkpoint.export_hf=false",
)
# and generation on cores of its own (colocate=false), every step checkpointed and its trained groups
# audited (batches.jsonl)
AUDITED = (
    *SMALL,
    "colocate=false",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=0",
    "tracking.batches=true",
)


def audited(name: str, scheduler: str, steps: int = STEPS, *extra: str) -> list[str]:
    """``loongsage train`` arguments of an audited run of ``steps`` steps under ``scheduler``."""
    return [
        "train",
        "tiny/grpo_arith_cpu",
        f"run.name={name}",
        f"rollout.scheduler={scheduler}",
        f"run.total_steps={steps}",
        *AUDITED,
        *extra,
    ]


def grpo_loop(colocate: str, name: str, steps: int) -> list[str]:
    """``loongsage train`` arguments of the shortened tiny GRPO recipe that the loop and exact-resume
    tests share: 4 prompts x 4 samples, evaluation (with pass@2) and a checkpoint every second step;
    colocated, the engines give their memory (their KV cache, on CPU) to the trainer while it trains,
    and the trainer its own to the engines while they generate (on CPU nothing moves)."""
    release = ["placement.release_engine_memory=true", "placement.offload_trainer=true"] if colocate == "true" else []
    return [
        "train",
        "tiny/grpo_arith_cpu",
        f"run.name={name}",
        f"run.total_steps={steps}",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.every_steps=2",
        "evaluation.max_prompts=16",
        "evaluation.pass_k=2",
        "checkpoint.every_steps=2",
        "tracking.progress=false",
        f"colocate={colocate}",
        *release,
    ]
