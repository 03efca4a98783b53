"""How each calibrated constant of :mod:`.constants` follows from a benchmark's result file.

Pure functions over the parsed JSON (``bench/results/...``) and metrics rows, so that
``bench/plan_vs_measured.py`` can print the derivation and ``tests/core/test_throughput.py`` can
check that the constants still agree with the files. Every function names the file it reads.
"""

from __future__ import annotations

import statistics
from typing import Any

from loongsage.core.throughput.hardware import prefill_cost, roofline_cost
from loongsage.core.throughput.lengths import Lengths
from loongsage.core.throughput.phases import Batch, Source, train_flops
from loongsage.core.throughput.shape import ModelShape, shape_from_hf


def qwen3_1p7b() -> ModelShape:
    """The shape every H200 speed benchmark measured (``random_init`` preset ``qwen3-1.7b``)."""
    from loongsage.core.tinytask.shapes import PRESETS

    return shape_from_hf(PRESETS["qwen3-1.7b"])


def rl_step_batch(prompts: int = 16, samples: int = 8, prompt_tokens: int = 128, new_tokens: int = 256) -> Batch:
    """``bench/gpu_rl_step.py``'s work: 16 prompts x 8 samples, 128 + exactly 256 tokens."""
    return Batch((Source(prompts, samples, prompt_tokens, Lengths(new_tokens)),))


def in_step_trainer_mfu(compute_s: float, peak: float) -> float:
    """MFU of a GRPO step's trainer compute (``gpu_rl_step.json``: ``trainer_compute_s``, or
    ``train_s`` less the seams where the compute alone was not reported)."""
    shape = qwen3_1p7b()
    return train_flops(shape.matmul_params, shape.attention_width, rl_step_batch(), 3) / (compute_s * peak)


def bench_trainer_mfu(train_mfu: dict[str, Any], side: str, peak: float) -> float:
    """A side of ``train_mfu.json`` rescaled from that run's measured matmul rate to ``peak``."""
    return float(train_mfu["sides"][side]["mfu"]) * float(train_mfu["matmul_tflops"]) * 1e12 / peak


def seams_s(gpu_rl_step: dict[str, Any]) -> float:
    """``gpu_rl_step.json``: the train phase less the trainer's own compute."""
    ours = gpu_rl_step["ours"]
    return float(ours["train_s"]) - float(ours["trainer_compute_s"])


def decode_efficiency(
    engine_gpu: dict[str, Any], side: str, accel: Any, prefill_mfu: float
) -> tuple[float, dict[int, float]]:
    """``engine_gpu.json``: the share of the decode roofline a side (``engine_fused_tok_s``,
    ``engine_torch_graphs_tok_s``, ``sglang_tok_s``) reaches once the prefill of its prompts (one
    per row, no shared prefix) at ``prefill_mfu`` is taken out; one value over all batch sizes
    (summed times) and each batch's own."""
    shape = qwen3_1p7b()
    roof, prefill = roofline_cost(shape, "bfloat16", accel), prefill_cost(shape, "bfloat16", accel, prefill_mfu)
    roofs, decodes, per_batch = 0.0, 0.0, {}
    for row in engine_gpu["rows"]:
        rows, prompt, new = int(row["batch"]), int(row["prompt"]), int(row["new_tokens"])
        batch = Batch((Source(rows, 1, prompt, Lengths(new)),))
        roof_s = roof.seconds(new, batch.sampled_tokens(), batch.context_tokens())
        decode_s = rows * new / float(row[side]["median"]) - prefill.seconds(rows, prompt)
        roofs, decodes = roofs + roof_s, decodes + decode_s
        per_batch[rows] = roof_s / decode_s
    return roofs / decodes, per_batch


def steady(rows: list[dict[str, Any]], key: str, first: int = 2) -> float:
    """Median of a metric over a run's steps from ``first`` on (the first steps compile and warm up)."""
    return float(statistics.median(r[key] for r in rows if key in r and r.get("step", 0) >= first))


def host_per_trajectory(rollout_s: float, engine_s: float, trajectories: int) -> float:
    """A step's rollout less the engine's modelled time, per trajectory (``grpo_arith4_h200``)."""
    return (rollout_s - engine_s) / trajectories


def activation_bytes_per_vocab(peak_bytes: float, tokens: int, state_bytes: float, per_hidden: float) -> float:
    """From a trainer's peak memory (``train_mfu.json``'s eager ``peak_gb``) over one micro-batch of
    ``tokens``: what is left per token after the state and ``per_hidden`` (bytes a token for the
    layers), per vocabulary entry."""
    shape = qwen3_1p7b()
    return (peak_bytes / tokens - state_bytes / tokens - per_hidden) / shape.vocab
