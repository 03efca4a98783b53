"""The throughput model and ``loongsage plan``: the command through its real entry point against the
measured GRPO step, one-line refusals of bad input, the model's scaling properties, its length
distribution against the simulation's draws, its constants against the result files they came
from, and its async-gain formula against the simulated service."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from loongsage.core import cli
from loongsage.core.config import load_config
from loongsage.core.sim.engine import LatencyModel, LengthModel
from loongsage.core.throughput import calibration as K
from loongsage.core.throughput import constants as C
from loongsage.core.throughput.lengths import Lengths, expected_max
from loongsage.core.throughput.phases import (
    Batch,
    DecodeCost,
    PrefillCost,
    Source,
    async_step_s,
    sync_rollout,
    throughput_rollout,
)
from loongsage.core.throughput.placement import Placement, evaluate, plan
from loongsage.core.throughput.workload import workload

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SPEED = "gpu/grpo_qwen3_1p7b_random_h200"
# The stated accuracy on the measured step (docs/plan.md): its train phase calibrated the compiled
# trainer's MFU, its rollout and push are predictions from other benchmarks.
STEP_TOLERANCE = 0.10


def _result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _step_s(text: str) -> float:
    match = re.search(r"^  step\s+([0-9.]+) s", text, re.M)
    assert match, text
    return float(match.group(1))


def _plan(recipe: str, overrides: tuple[str, ...] | list[str] = (), **kwargs):
    cfg, registry = load_config(recipe, list(overrides))
    return workload(cfg, registry=registry, **kwargs)


# ----------------------------------------------------------------------------- the command
def test_plan_through_the_launcher_predicts_the_measured_step() -> None:
    launcher = Path(sys.executable).parent / "loongsage"  # the installed console script
    out = subprocess.run([str(launcher), "plan", SPEED], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    measured = _result("gpu_rl_step.json")["ours"]["step_s"]
    predicted = _step_s(out.stdout)
    assert abs(predicted / measured - 1) <= STEP_TOLERANCE, (predicted, measured)
    assert "exact (random_init's model has no end token)" in out.stdout
    assert "picked: the recipe's placement" in out.stdout
    for part in ("rollout", "train", "push", "GPU use", "async over sync", "placements considered"):
        assert part in out.stdout


def test_overrides_and_flags_change_the_answer(capsys) -> None:
    assert cli.main(["plan", SPEED]) == 0
    base = _step_s(capsys.readouterr().out)
    slower = ["data_sources.0.sampling.max_new_tokens=512", "trainer.micro_batch_tokens=4096", "--gpu", "h100"]
    assert cli.main(["plan", SPEED, *slower]) == 0
    longer = capsys.readouterr().out
    assert _step_s(longer) > base and "H100" in longer and "datasheet" in longer
    assert cli.main(["plan", SPEED, "--lengths", "64,256"]) == 0
    shorter = capsys.readouterr().out
    assert _step_s(shorter) < base and "log-normal, median 64, p99 256" in shorter


def test_shared_prompts_are_planned_once_per_group(capsys) -> None:
    """``share_prompts``: the speed step's 16 groups of 8 x (128 + 256) tokens train 16 x 128 + 128 x
    256 tokens, not 128 x 384, and the plan's train phase shrinks with them."""
    plain, shared = _plan(SPEED), _plan(SPEED, ["trainer.backend.params.share_prompts=true"])
    assert not plain.shares_prompts and shared.shares_prompts
    assert plain.batch.trained_tokens(plain.shares_prompts) == 128 * 384
    assert shared.batch.trained_tokens(shared.shares_prompts) == 16 * 128 + 128 * 256
    accel, place = C.ACCELERATORS["h200"], Placement("colocated", 1, 1, 1)
    assert evaluate(shared, accel, place).train_s < 0.8 * evaluate(plain, accel, place).train_s
    assert cli.main(["plan", SPEED, "trainer.backend.params.share_prompts=true"]) == 0
    faster = _step_s(capsys.readouterr().out)
    assert cli.main(["plan", SPEED]) == 0
    assert faster < _step_s(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["plan", SPEED, "--gpu", "b200"], ["--gpu", "h200"]),
        (["plan", SPEED, "--gpus", "0"], ["--gpus 0", "at least 1"]),
        (["plan", SPEED, "--gpus", "two"], ["--gpus", "int"]),
        (["plan", SPEED, "--lengths", "256"], ["--lengths", "MEDIAN,P99"]),
        (["plan", SPEED, "--lengths", "512,256"], ["--lengths", "MEDIAN <= P99"]),
        (["plan", SPEED, "--prompt-tokens", "0"], ["--prompt-tokens"]),
        (["plan"], ["no recipe", "loongsage plan <recipe>"]),
        (["plan", "gpu/no_such_recipe"], ["not found"]),
        (["plan", SPEED, "trainer.no_such_key=1"], ["no_such_key"]),
        (["plan", "tiny/grpo_arith_cpu"], ["gpus_per_actor=0", "--gpus N"]),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, names, capsys) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loongsage: error:"), captured.err
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_a_model_too_big_for_the_card_is_refused(capsys) -> None:
    """The 1.7B step's trainer state, activations of 12,288-token micro-batches and engine do not fit
    an A100's memory; smaller micro-batches do; a 30B model fits no single card at all."""
    assert cli.main(["plan", SPEED, "--gpu", "a100"]) == 2
    err = capsys.readouterr().err
    assert "fits no placement on 1 x A100" in err and "micro_batch_tokens" in err
    assert cli.main(["plan", SPEED, "--gpu", "a100", "trainer.micro_batch_tokens=4096"]) == 0
    capsys.readouterr()
    assert cli.main(["plan", SPEED, "model.builder.params.preset=qwen3-30b-a3b"]) == 2
    assert "fits no placement" in capsys.readouterr().err


# ----------------------------------------------------------------------------- scaling
def test_more_engines_take_less_rollout_time() -> None:
    work = _plan(SPEED, ["data_sources.0.prompts_per_step=64"])
    accel = C.ACCELERATORS["h200"]
    rollouts = [evaluate(work, accel, Placement("colocated", n, n, n)).rollout.engine_s for n in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(rollouts, rollouts[1:])), rollouts
    # bandwidth-bound: a slower card's memory is a slower rollout
    cards = [evaluate(work, C.ACCELERATORS[g], Placement("colocated", 1, 1, 1)).rollout.engine_s for g in C.DATASHEET]
    assert cards[2] > cards[1] > cards[0], cards  # a100 > h100 > h200


def test_async_gains_over_sync_with_a_long_tail() -> None:
    tail = LengthModel(median=256, p99=2560)
    work = _plan(SPEED, ["data_sources.0.sampling.max_new_tokens=4096"], lengths=tail)
    result = plan(work, C.ACCELERATORS["h200"], 8)
    assert result.best_async is not None and result.best_sync is not None
    assert result.best_sync.step_s / result.best_async.step_s >= 1.5
    # on every split of the cards, overlapping the phases is never slower than taking turns
    steps = {(p.placement.engines, p.placement.asynchronous): p.step_s for p in result.considered}
    splits = [k for k, asynchronous in steps if asynchronous]
    assert len(splits) == 7 and all(steps[k, True] <= steps[k, False] for k in splits)


def test_the_async_formula_follows_the_simulated_service() -> None:
    """sim_async_gain.json: the model's gain with the simulation's own costs, within 10% of the
    simulated service's at 64 to 1,000 engines (at 8 the model's 2.3x against 2.05x, 15%)."""
    sim = _result("sim_async_gain.json")
    latency = LatencyModel()
    lengths = Lengths(4096, LengthModel(**sim["settings"]["lengths"]))
    decode = DecodeCost(latency.step_fixed_s, latency.step_per_row_s)
    prefill = PrefillCost(latency.prefill_fixed_s, latency.prefill_token_s)
    for row in sim["rows"]:
        engines = row["engines"]
        batch = Batch(
            (Source(max(1, round(engines * 3 / 8)), 8, 20, lengths), Source(max(1, round(engines / 8)), 8, 20, lengths))
        )
        sync = sync_rollout(batch, engines, 256, decode, prefill)
        step, _ = async_step_s(throughput_rollout(batch, engines, 256, 2, decode, prefill), sync, 1, 4.0, 0.0)
        gain = (sync.total_s + 4.0) / step
        assert abs(gain / row["async_gain"] - 1) <= (0.15 if engines < 64 else 0.10), (engines, gain, row["async_gain"])


# ----------------------------------------------------------------------------- the parts
def test_lengths_follow_the_simulations_draws() -> None:
    model, limit = LengthModel(median=256, p99=2560), 4096
    lengths = Lengths(limit, model)
    rng = random.Random(7)
    draws = [model.draw(rng, limit) for _ in range(40_000)]
    assert lengths.mean() == pytest.approx(statistics.fmean(draws), rel=0.02)
    assert lengths.mean_square() == pytest.approx(statistics.fmean(d * d for d in draws), rel=0.05)
    for t in (100, 256, 1000, 2560):
        assert lengths.survival[t] == pytest.approx(sum(d > t for d in draws) / len(draws), abs=0.01)
    groups = [max(draws[i : i + 64]) for i in range(0, len(draws), 64)]  # longest of 64, 625 times
    assert expected_max([(lengths, 64)]) == pytest.approx(statistics.fmean(groups), rel=0.05)
    exact = Lengths(256)
    assert exact.mean() == 256 and expected_max([(exact, 1000)]) == 256


def test_the_constants_still_match_their_result_files() -> None:
    step, eager = _result("gpu_rl_step.json"), _result("history/gpu_rl_step.de085c6.json")
    seams = K.seams_s(step)
    assert C.TRAIN_SEAMS_S == pytest.approx(seams, rel=0.01)
    assert C.TRAINER_MFU["torch_compiled"] == pytest.approx(
        K.in_step_trainer_mfu(step["ours"]["trainer_compute_s"], C.H200_PEAK_BF16), rel=0.01
    )
    assert C.TRAINER_MFU["torch"] == pytest.approx(
        K.in_step_trainer_mfu(eager["ours"]["train_s"] - seams, C.H200_PEAK_BF16), rel=0.01
    )
    engine = _result("engine_gpu.json")
    assert C.H200_BANDWIDTH == pytest.approx(engine["info"]["copy_bandwidth_tb_s"] * 1e12, rel=0.01)
    for kernels, side in (
        ("fused", "engine_fused_tok_s"),
        ("torch", "engine_torch_graphs_tok_s"),
        ("sglang", "sglang_tok_s"),
    ):
        eta, _ = K.decode_efficiency(engine, side, C.ACCELERATORS["h200"], C.PREFILL_MFU)
        assert C.DECODE_EFFICIENCY[kernels] == pytest.approx(eta, rel=0.01), kernels


def test_the_shape_counts_as_the_benchmarks_do() -> None:
    """bench/gpu_rl_step.py's matmul_params and engine_gpu.json's weight bytes of the 1.7B shape."""
    shape = K.qwen3_1p7b()
    assert shape.matmul_params == 28 * (2048 * 128 * (16 * 2 + 8 * 2) + 3 * 2048 * 6144) + 151_936 * 2048
    assert shape.weight_bytes(2) == pytest.approx(_result("engine_gpu.json")["info"]["weights_gb"] * 1e9, rel=1e-3)
    assert shape.kv_bytes_per_token(2) == 114_688  # docs/engine.md: 114.7 KB a token
