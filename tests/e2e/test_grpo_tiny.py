"""End to end through the real launcher and Ray: a shortened tiny GRPO recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loongsage.core.cli import main

SHORT = [
    "run.name=e2e",
    "run.total_steps=4",
    "data_sources.0.prompts_per_step=4",
    "data_sources.0.samples_per_prompt=4",
    "evaluation.every_steps=2",
    "evaluation.max_prompts=16",
    "evaluation.pass_k=2",
    "checkpoint.every_steps=2",
    "tracking.progress=false",
]


def _short_run(recipe: str, name: str, steps: int, *extra: str) -> list[str]:
    """``loongsage train`` arguments for a CI-sized run: 4 prompts x 4 samples, a small evaluation."""
    return ["train", recipe, f"run.name={name}", f"run.total_steps={steps}", "data_sources.0.prompts_per_step=4",
            "data_sources.0.samples_per_prompt=4", "evaluation.max_prompts=8", "evaluation.pass_k=0",
            "tracking.progress=false", "checkpoint.export_hf=false", *extra]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _model_path(run_dir: Path) -> Path:
    return Path(json.loads((run_dir / "run_info.json").read_text())["model_path"])


def _trained(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "train/loss" in r]


@pytest.mark.parametrize("colocate", ["true", "false"])
def test_grpo_loop_runs_and_resumes(ray_session, in_tmp, colocate):
    # colocated, the engines give their memory (their KV cache, on CPU) to the trainer while it trains,
    # and the trainer its own to the engines while they generate (on CPU nothing moves)
    release = ["placement.release_engine_memory=true", "placement.offload_trainer=true"] if colocate == "true" else []
    args = ["train", "tiny/grpo_arith_cpu", *SHORT, f"colocate={colocate}", *release]
    assert main(args) == 0
    run_dir = in_tmp / "runs" / "e2e"
    rows = _metrics(run_dir)
    trained = _trained(rows)
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    # the engine received every update, one version per step
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0, 4.0]
    for r in trained:
        assert r["rollout/trajectories"] == 16
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["train/grad_norm"] > 0
        # same fp32 model in trainer and engine: the train-inference mismatch is tiny
        assert 0.0 <= r["train/is_approx_k3_kl"] < 1e-6
        assert ("timing/engine_memory_s" in r) == bool(release)
        assert ("timing/trainer_offload_s" in r) == bool(release)
    assert any(k.startswith("eval/arith/accuracy") for k in rows[0])
    assert "eval/arith/pass@2" in rows[-1]
    # weights changed: the exported final policy differs from the starting model
    final = run_dir / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    start = load_file(str(_model_path(run_dir) / "model.safetensors"))
    end = load_file(str(final / "model.safetensors"))
    assert start.keys() == end.keys()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    for ck in (run_dir / "checkpoints").iterdir():
        assert {"trainer.pt", "rng_rank0.pt", "controller.json"} <= {p.name for p in ck.iterdir()}
    assert (run_dir / "tensorboard").is_dir()
    logs = list((in_tmp / "log").glob("trainer_*.log"))
    assert logs and "recipe tiny/grpo_arith_cpu" in logs[0].read_text()

    # resume: two more steps continue at step 5 and the exact data position of step 4
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "controller.json").read_text())
    assert main([*args, "run.total_steps=6", "resume=true"]) == 0
    rows = _metrics(run_dir)
    trained = _trained(rows)
    assert [r["step"] for r in trained][-2:] == [5, 6]
    assert [r["engine/version"] for r in trained][-2:] == [5.0, 6.0]
    resumed = json.loads((run_dir / "checkpoints" / "step_000006" / "controller.json").read_text())
    assert resumed["mixer"]["arith"]["offset"] == state["mixer"]["arith"]["offset"] + 2 * 4
    assert resumed["next_group_id"] > state["next_group_id"]


def test_dapo_recipe_refills_filtered_groups(ray_session, in_tmp):
    """tiny/dapo_arith_cpu: dynamic sampling drops uniform groups and refills them from the stream."""
    args = _short_run("tiny/dapo_arith_cpu", "dapo", 3, "rollout.max_refill_rounds=3")
    assert main(args) == 0
    run_dir = in_tmp / "runs" / "dapo"
    trained = _trained(_metrics(run_dir))
    assert [r["step"] for r in trained] == [1, 2, 3]
    for r in trained:
        assert r["rollout/groups_trained"] <= 4
        assert 0 <= r["rollout/refill_rounds"] <= 3
        # refill ran exactly when filters dropped groups
        assert (r["rollout/refill_rounds"] > 0) == (r["rollout/groups_filtered"] > 0)
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "controller.json").read_text())
    refills = sum(r["rollout/refill_rounds"] for r in trained)
    # every refill round consumed extra prompts from the data stream
    assert (state["mixer"]["arith"]["offset"] > 3 * 4) == (refills > 0)


@pytest.mark.parametrize("where", ["loss", "reward"])
def test_kl_against_a_frozen_reference(ray_session, in_tmp, where):
    """k3 KL to a frozen reference, in the loss (GRPO) or as a token reward (REINFORCE++)."""
    args = _short_run("tiny/grpo_arith_cpu", f"kl_{where}", 2, "algorithm.kl={name: k3}", "algorithm.kl_coef=0.05")
    if where == "reward":
        args += ["algorithm.kl_in_reward=true", "algorithm.advantage.name=reinforce_pp"]
    assert main(args) == 0
    trained = _trained(_metrics(in_tmp / "runs" / f"kl_{where}"))
    assert [r["step"] for r in trained] == [1, 2]
    first, second = trained
    key = "train/kl" if where == "loss" else "rollout/kl_reward"
    assert key in first and ("rollout/kl_reward" in first) == (where == "reward")
    # the reference is the starting policy: KL is 0 before the first update and positive after it
    assert first[key] == pytest.approx(0.0, abs=1e-6)
    assert abs(second[key]) > 0


def test_ppo_with_a_critic(ray_session, in_tmp):
    """tiny/ppo_arith_cpu: GAE over a learned value model trained beside the policy; resumable."""
    args = _short_run("tiny/ppo_arith_cpu", "ppo", 3, "checkpoint.every_steps=2")
    assert main(args) == 0
    run_dir = in_tmp / "runs" / "ppo"
    trained = _trained(_metrics(run_dir))
    assert [r["step"] for r in trained] == [1, 2, 3]
    # the value head starts at zero and learns: values move towards the returns
    assert trained[0]["critic/values"] == pytest.approx(0.0, abs=1e-6)
    assert abs(trained[-1]["critic/values"]) > 0 and trained[-1]["critic/grad_norm"] > 0
    assert all(r["critic/value_loss"] >= 0 for r in trained)
    assert (run_dir / "checkpoints" / "step_000002" / "critic" / "trainer.pt").is_file()
    assert main([*args, "run.total_steps=4", "resume=true"]) == 0
    assert [r["step"] for r in _trained(_metrics(run_dir))][-1] == 4


def test_deterministic_engine_matches_the_trainer_exactly(ray_session, in_tmp):
    """Deterministic engine + one sequence per micro-batch: the train-inference mismatch is exactly 0."""
    args = _short_run("tiny/grpo_arith_cpu", "exact", 2, "rollout.engine={name: native, params: {deterministic: true}}",
                      "trainer.micro_batch_tokens=1")
    assert main(args) == 0
    trained = _trained(_metrics(in_tmp / "runs" / "exact"))
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["train/is_logprob_abs_diff"] == 0.0 and r["train/is_approx_k3_kl"] == 0.0
