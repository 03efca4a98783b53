"""The throughput model (``loongsage plan``) against every step measured here.

For each measured configuration the recipe is loaded as ``loongsage plan`` loads it (overrides
included), the model predicts the step and its phases, and both go into a table with the error.
First the calibration: each constant of ``loongsage.core.throughput.constants`` derived again from
the result file it came from (a constant that no longer matches its file is flagged). Each row
says whether its measurement calibrated a constant (``calibration``: the error there shows only how
the other constants combine) or is held out (``held out``: a prediction).

Configurations: ``gpu_rl_step`` at 05257a0 (fused engine, compiled trainer), de085c6 (eager trainer)
and 5ec1daf (torch decode kernels, eager trainer); the same step with the SGLang engine; the arith4
recipes (float32, bf16, and asynchronous on one shared card); the async gain of
``sim_async_gain.json`` at 8-1,000 simulated engines (the model's formula fed the simulation's
latency model); and the CPU ``async_vs_sync`` bench (the overlap formula fed its measured phases).

    uv run python bench/plan_vs_measured.py

Writes ``bench/results/plan_vs_measured.json`` and ``.md``. No GPU needed: it reads result files.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _source import source_state

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def metrics(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RESULTS / "gpu_runs" / name).read_text().splitlines() if line.strip()]


def predict(recipe: str, overrides: list[str], lengths: Any = None, prompt_tokens: int | None = None) -> Any:
    """The recipe's own placement, as ``loongsage plan`` predicts it."""
    from loongsage.core.config import load_config
    from loongsage.core.throughput.constants import ACCELERATORS
    from loongsage.core.throughput.placement import plan
    from loongsage.core.throughput.workload import workload

    cfg, registry = load_config(recipe, overrides)
    work = workload(cfg, lengths=lengths, prompt_tokens=prompt_tokens, registry=registry)
    result = plan(work, ACCELERATORS["h200"], int(work.recipe_gpus))
    assert result.recipe is not None
    return result.recipe, work


def arith4_prompt_tokens() -> float:
    """Tokens of the arith4 recipes' prompts: the reader's records through the chat template and the
    embedded tokenizer, as the single-turn agent encodes them."""
    from loongsage.core.rollout.agents import encode_prompt
    from loongsage.core.tinytask.arith import ArithmeticTask
    from loongsage.core.tinytask.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=384)
    task = ArithmeticTask(digits=4, operations="+-", split="train", size=1000)
    return statistics.mean(len(encode_prompt(tokenizer, task[i].prompt, "chat")) for i in range(200))


# ----------------------------------------------------------------------------- calibration
def calibration(host_engine_s: float, arith4_bytes: float) -> list[dict[str, Any]]:
    """Each constant against its file; ``host_engine_s``: the bf16 arith4 run's modelled engine time."""
    from loongsage.core.throughput import calibration as K
    from loongsage.core.throughput import constants as C

    h200 = C.ACCELERATORS["h200"]
    train_mfu, older = load("train_mfu.json"), load("history/train_mfu.c7ef7f5.json")
    step, eager_step = load("gpu_rl_step.json"), load("history/gpu_rl_step.de085c6.json")
    engine, arith = load("engine_gpu.json"), metrics("grpo_arith4_h200.metrics.jsonl")
    seams = K.seams_s(step)
    shape = K.qwen3_1p7b()
    rows = [
        ("H200_PEAK_BF16", C.H200_PEAK_BF16, train_mfu["matmul_tflops"] * 1e12, "train_mfu.json (d8485dc)"),
        ("H200_BANDWIDTH", C.H200_BANDWIDTH, engine["info"]["copy_bandwidth_tb_s"] * 1e12, "engine_gpu.json (d8485dc)"),
        ("TRAIN_SEAMS_S", C.TRAIN_SEAMS_S, seams, "gpu_rl_step.json (05257a0)"),
        (
            "TRAINER_MFU[torch_compiled]",
            C.TRAINER_MFU["torch_compiled"],
            K.in_step_trainer_mfu(step["ours"]["trainer_compute_s"], C.H200_PEAK_BF16),
            "gpu_rl_step.json (05257a0)",
        ),
        (
            "TRAINER_MFU[torch]",
            C.TRAINER_MFU["torch"],
            K.in_step_trainer_mfu(eager_step["ours"]["train_s"] - seams, C.H200_PEAK_BF16),
            "history/gpu_rl_step.de085c6.json",
        ),
        ("PREFILL_MFU", C.PREFILL_MFU, C.TRAINER_MFU["torch"], "= TRAINER_MFU[torch] (assumed)"),
        (
            "TRAINER_MFU[megatron]",
            C.TRAINER_MFU["megatron"],
            K.bench_trainer_mfu(older, "megatron", C.H200_PEAK_BF16),
            "history/train_mfu.c7ef7f5.json",
        ),
        (
            "TRAINER_MFU[megatron_te]",
            C.TRAINER_MFU["megatron_te"],
            K.bench_trainer_mfu(older, "megatron_te", C.H200_PEAK_BF16),
            "history/train_mfu.c7ef7f5.json",
        ),
    ]
    for kernels, side in (
        ("fused", "engine_fused_tok_s"),
        ("torch", "engine_torch_graphs_tok_s"),
        ("sglang", "sglang_tok_s"),
    ):
        eta, per_batch = K.decode_efficiency(engine, side, h200, C.PREFILL_MFU)
        spread = ", ".join(f"{b}: {v:.3f}" for b, v in per_batch.items())
        rows.append((f"DECODE_EFFICIENCY[{kernels}]", C.DECODE_EFFICIENCY[kernels], eta, f"engine_gpu.json ({spread})"))
    rollout = K.steady(metrics("grpo_arith4_bf16_h200.metrics.jsonl"), "timing/rollout_s")
    rows += [
        (
            "HOST_S_PER_TRAJECTORY",
            C.HOST_S_PER_TRAJECTORY,
            K.host_per_trajectory(rollout, host_engine_s, 512),
            f"grpo_arith4_bf16_h200 (rollout {rollout:.4f} s less the engine's modelled {host_engine_s:.4f} s)",
        ),
        (
            "PUSH_FIXED_S",
            C.PUSH_FIXED_S,
            K.steady(arith, "timing/sync_s") - arith4_bytes / C.IPC_BYTES_PER_S,
            "grpo_arith4_h200 (sync_s less the bytes at IPC_BYTES_PER_S)",
        ),
        (
            "ENGINE_MEMORY_FIXED_S",
            C.ENGINE_MEMORY_FIXED_S,
            K.steady(arith, "timing/engine_memory_s") - 2 * arith4_bytes / C.HOST_LINK_BYTES_PER_S,
            "grpo_arith4_h200 (engine_memory_s less the weights out and back)",
        ),
        (
            "ACTIVATION_BYTES_PER_VOCAB",
            C.ACTIVATION_BYTES_PER_VOCAB,
            K.activation_bytes_per_vocab(
                train_mfu["sides"]["torch"]["peak_gb"] * 1e9,
                train_mfu["settings"]["rows"] * train_mfu["settings"]["seq"],
                shape.total_params * 18,
                C.ACTIVATION_BYTES_PER_HIDDEN * shape.hidden * shape.layers,
            ),
            "train_mfu.json eager peak_gb (d8485dc)",
        ),
    ]
    out = []
    for name, constant, derived, source in rows:
        drift = abs(constant / derived - 1)
        out.append({"constant": name, "value": constant, "derived": derived, "drift": drift, "source": source})
    return out


# ----------------------------------------------------------------------------- the steps
def phase_rows(config: str, pred: Any, measured: dict[str, float], roles: dict[str, str]) -> list[dict[str, Any]]:
    predicted = {
        "rollout_s": pred.rollout.total_s,
        "train_s": pred.train_s,
        "push_s": pred.push_s,
        "step_s": pred.step_s,
        "peak_card_gb": pred.memory.card / 1e9,
    }
    return [
        {
            "config": config,
            "phase": phase,
            "measured": measured[phase],
            "predicted": predicted[phase],
            "error": predicted[phase] / measured[phase] - 1,
            "role": roles.get(phase, "held out"),
        }
        for phase in ("rollout_s", "train_s", "push_s", "step_s", "peak_card_gb")
        if phase in measured
    ]


def from_step_json(result: dict[str, Any]) -> dict[str, float]:
    o = result["ours"]
    out = {"rollout_s": o["rollout_s"], "train_s": o["train_s"], "push_s": o["sync_s"], "step_s": o["step_s"]}
    if "peak_card_gb" in o:
        out["peak_card_gb"] = o["peak_card_gb"]
    return out


def from_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    from loongsage.core.throughput.calibration import steady

    keys = {
        "rollout_s": "timing/rollout_s",
        "train_s": "timing/train_s",
        "push_s": "timing/sync_s",
        "step_s": "timing/step_s",
    }
    return {phase: steady(rows, key) for phase, key in keys.items()}


# the commit each learning run of bench/results/gpu_runs measured: runs of older code show how far
# the engine and trainer have moved since, against a model calibrated on the newest
RUN_COMMITS = {"grpo_arith4_h200": "fb011ee", "grpo_arith4_bf16_h200": "b4c3fa5", "grpo_arith4_async_h200": "5ec1daf"}


def steps() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from loongsage.core.sim.engine import LengthModel

    recipe = "gpu/grpo_qwen3_1p7b_random_h200"
    out: list[dict[str, Any]] = []
    calibrated_train = {
        "train_s": "calibration (trainer MFU, seams)",
        "step_s": "held out, its train phase calibration",
    }
    cases = [
        ("gpu_rl_step 05257a0", [], from_step_json(load("gpu_rl_step.json")), calibrated_train),
        (
            "gpu_rl_step de085c6 (eager trainer)",
            ["trainer.backend.params.compile_layers=false"],
            from_step_json(load("history/gpu_rl_step.de085c6.json")),
            calibrated_train,
        ),
        (
            "gpu_rl_step 5ec1daf (torch decode kernels, eager trainer)",
            ["trainer.backend.params.compile_layers=false", "rollout.engine.params.kernels=torch"],
            from_step_json(load("history/gpu_rl_step.5ec1daf.json")),
            {},
        ),
        (
            "gpu_rl_step with the SGLang engine (d8485dc)",
            ["rollout.engine.name=sglang"],
            from_metrics(metrics("grpo_qwen3_1p7b_random_h200.sglang.metrics.jsonl")),
            {},
        ),
    ]
    for config, overrides, measured, roles in cases:
        pred, _ = predict(recipe, overrides)
        out += phase_rows(config, pred, measured, roles)
    prompt = arith4_prompt_tokens()
    lengths = LengthModel(median=5, p99=8)  # the runs' mean response: 5.09 tokens of at most 8
    arith4 = {}
    for name, roles in (
        ("grpo_arith4_h200", {"push_s": "calibration (fixed part)"}),
        ("grpo_arith4_bf16_h200", {"rollout_s": "calibration (host)"}),
        ("grpo_arith4_async_h200", {}),
    ):
        pred, work = predict(f"gpu/{name}", [], lengths, round(prompt))
        arith4[name] = (pred, work)
        if name == "grpo_arith4_h200":
            roles["train_s"] = "calibration (engine memory moves)"
            roles["step_s"] = "held out, its push and memory moves calibration"
        out += phase_rows(f"{name} {RUN_COMMITS[name]}", pred, from_metrics(metrics(f"{name}.metrics.jsonl")), roles)
    fp32, work = arith4["grpo_arith4_h200"]
    info = {
        "arith4_prompt_tokens": prompt,
        "arith4_mean_response_tokens": work.batch.sources[0].lengths.mean(),
        "arith4_engine_s": fp32.rollout.engine_s,
        "arith4_bf16_engine_s": arith4["grpo_arith4_bf16_h200"][0].rollout.engine_s,
        "arith4_weight_bytes": work.shape.weight_bytes(work.dtype_bytes),
    }
    return out, info


# ----------------------------------------------------------------------------- the async gain
def simulated_gain() -> list[dict[str, Any]]:
    """``sim_async_gain.json``: the model's sync and async steps with the simulation's own costs (its
    LatencyModel per decode step, its prefill, 256 rows an engine, no host time, the trainer's 4 s,
    an instant push) against the simulated service's."""
    from loongsage.core.sim.engine import LatencyModel, LengthModel
    from loongsage.core.throughput.lengths import Lengths
    from loongsage.core.throughput.phases import (
        Batch,
        DecodeCost,
        PrefillCost,
        Source,
        async_step_s,
        sync_rollout,
        throughput_rollout,
    )

    sim = load("sim_async_gain.json")
    latency, train_s = LatencyModel(), float(sim["settings"]["train_s"])
    lengths = Lengths(4096, LengthModel(**sim["settings"]["lengths"]))  # the bench's max_new_tokens
    decode = DecodeCost(fixed_s=latency.step_fixed_s, per_row_s=latency.step_per_row_s)
    prefill = PrefillCost(fixed_s=latency.prefill_fixed_s, per_token_s=latency.prefill_token_s)
    out = []
    for row in sim["rows"]:
        engines = row["engines"]
        arith, sort = max(1, round(engines * 3 / 8)), max(1, round(engines / 8))  # as the bench splits them
        batch = Batch((Source(arith, 8, 20, lengths), Source(sort, 8, 20, lengths)))  # ~20-token prompts
        sync = sync_rollout(batch, engines, 256, decode, prefill)
        thr = throughput_rollout(batch, engines, 256, 2, decode, prefill)
        sync_s = sync.total_s + train_s
        async_s, bound = async_step_s(thr, sync, 1, train_s, 0.0)
        gain = sync_s / async_s
        out.append(
            {
                "engines": engines,
                "sync_s": [row["sync"]["simulated_s_per_step"], sync_s],
                "async_s": [row["no_window"]["simulated_s_per_step"], async_s],
                "gain": [row["async_gain"], gain],
                "gain_error": gain / row["async_gain"] - 1,
                "async_bound": bound,
            }
        )
    return out


def cpu_overlap() -> list[dict[str, Any]]:
    """``async_vs_sync.json`` (CPU, tiny model): the overlap formula fed the measured phases. The
    synchronous step's generation, training and push; asynchronously the engine and the trainer each
    get half of the cores, so generation is taken to slow down as training measurably did."""
    result = load("async_vs_sync.json")["summary"]

    def mean(config: str, key: str) -> float:
        return statistics.mean(r[key] for r in result[config]["per_repeat"])

    gen, train, push = (mean("sync", k) for k in ("rollout_s_mean", "train_s_mean", "sync_s_mean"))
    sync_step = mean("sync", "step_s_mean")
    out = []
    for config in ("one_step_off", "no_window", "window_gated", "windowed_fifo"):
        a_train, a_push = mean(config, "train_s_mean"), mean(config, "sync_s_mean")
        predicted = max(gen * a_train / train, a_train) + a_push
        measured = mean(config, "step_s_mean")
        out.append(
            {
                "config": config,
                "async_step_s": [measured, predicted],
                "gain": [sync_step / measured, sync_step / predicted],
                "gain_error": (sync_step / predicted) / (sync_step / measured) - 1,
                "sync_phases_s": [gen, train, push],
            }
        )
    return out


# ----------------------------------------------------------------------------- output
def markdown(result: dict[str, Any]) -> str:
    src = result["source"]
    lines = [
        f"commit `{src['commit'][:10]}` ({src['uncommitted_files']} uncommitted files); the model of "
        "`loongsage.core.throughput` against the result files of `bench/results/` (no GPU run here).",
        "",
        "## Calibration: each constant derived again from its file",
        "",
        "| constant | in the code | from the file | drift | file |",
        "|---|---:|---:|---:|---|",
    ]
    for c in result["calibration"]:
        lines.append(
            f"| `{c['constant']}` | {c['value']:.5g} | {c['derived']:.5g} | {c['drift']:.1%} | {c['source']} |"
        )
    lines += [
        "",
        "## Predicted against measured, per phase",
        "",
        "Measured: the benchmark's medians (`gpu_rl_step`), or the median over steps 2 and later of the "
        "run's metrics (phase medians do not add up to the step's). push: `timing/sync_s`. "
        f"arith4: {result['info']['arith4_prompt_tokens']:.1f}-token prompts, responses log-normal (median 5, "
        f"p99 8; mean {result['info']['arith4_mean_response_tokens']:.2f} tokens, measured 5.09).",
        "",
        "| configuration | phase | measured | predicted | error | role |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["steps"]:
        lines.append(
            f"| {r['config']} | {r['phase']} | {r['measured']:.4g} | {r['predicted']:.4g} | {r['error']:+.1%} | "
            f"{r['role']} |"
        )
    lines += [
        "",
        "## The async gain against the simulated service (`sim_async_gain.json`)",
        "",
        "| engines | sync s/step (sim, model) | no_window s/step (sim, model) | gain (sim, model) | error | "
        "async bound |",
        "|---:|---|---|---|---:|---|",
    ]
    for r in result["simulated_gain"]:
        lines.append(
            f"| {r['engines']} | {r['sync_s'][0]:.2f}, {r['sync_s'][1]:.2f} | {r['async_s'][0]:.2f}, "
            f"{r['async_s'][1]:.2f} | {r['gain'][0]:.2f}x, {r['gain'][1]:.2f}x | {r['gain_error']:+.1%} | "
            f"{r['async_bound']} |"
        )
    lines += [
        "",
        "## The overlap formula on the CPU bench (`async_vs_sync.json`, measured phases in)",
        "",
        "| scheduler | async s/step (measured, formula) | gain over sync (measured, formula) | error |",
        "|---|---|---|---:|",
    ]
    for r in result["cpu_overlap"]:
        lines.append(
            f"| {r['config']} | {r['async_step_s'][0]:.3f}, {r['async_step_s'][1]:.3f} | {r['gain'][0]:.2f}x, "
            f"{r['gain'][1]:.2f}x | {r['gain_error']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    source = source_state()  # the commit, first
    rows, info = steps()
    result = {
        "source": source,
        "calibration": calibration(info["arith4_bf16_engine_s"], info["arith4_weight_bytes"]),
        "info": info,
        "steps": rows,
        "simulated_gain": simulated_gain(),
        "cpu_overlap": cpu_overlap(),
    }
    (RESULTS / "plan_vs_measured.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (RESULTS / "plan_vs_measured.md").write_text(text)
    print(text)
    drifted = [c["constant"] for c in result["calibration"] if c["drift"] > 0.01]
    if drifted:
        print(f"constants that no longer match their files: {', '.join(drifted)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
