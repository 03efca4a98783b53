"""End to end through the real launcher and Ray: a shortened tiny GRPO recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loongsage.core.cli import main
from tests.e2e._runs import grpo_loop


def _short_run(recipe: str, name: str, steps: int, *extra: str) -> list[str]:
    """``loongsage train`` arguments for a CI-sized run: 4 prompts x 4 samples, a small evaluation."""
    return [
        "train",
        recipe,
        f"run.name={name}",
        f"run.total_steps={steps}",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.max_prompts=8",
        "evaluation.pass_k=0",
        "tracking.progress=false",
        "checkpoint.export_hf=false",
        *extra,
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _model_path(run_dir: Path) -> Path:
    return Path(json.loads((run_dir / "run_info.json").read_text())["model_path"])


def _trained(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "train/loss" in r]


# not colocated (no memory to hand over), the loop runs synchronously in tests/sglang/test_sglang_launcher.py
# and asynchronously in test_kill_resume.py's and test_engine_recovery.py's windowed_fifo runs
@pytest.mark.parametrize("colocate", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_grpo_loop_runs(launched, colocate):
    """The run test_resume_exact.py compares a stopped and resumed run against."""
    where = launched(grpo_loop(colocate, "whole", 4))
    run_dir = where / "runs" / "whole"
    release = colocate == "true"
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
        assert ("timing/engine_memory_s" in r) == release
        assert ("timing/trainer_offload_s" in r) == release
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
    logs = list((where / "log").glob("trainer_*.log"))
    assert logs and "recipe tiny/grpo_arith_cpu" in logs[0].read_text()


def test_shared_prompts_train_the_plain_runs_first_step(launched):
    """``share_prompts`` through the launcher: the first step samples the same groups as the plain
    run above (same weights, same seed) and trains them to the same loss and gradient norm, with
    each group's prompt computed once (the step counts the prompt tokens it did not compute again)."""
    plain = _trained(_metrics(launched(grpo_loop("true", "whole", 4)) / "runs" / "whole"))[0]
    sharing = "trainer.backend={name: torch, params: {share_prompts: true}}"
    shared_args = [*grpo_loop("true", "shared_prompts", 2), sharing]
    shared = _trained(_metrics(launched(shared_args) / "runs" / "shared_prompts"))
    assert [r["step"] for r in shared] == [1, 2]
    first = shared[0]
    assert first["rollout/reward_mean"] == plain["rollout/reward_mean"]
    assert first["rollout/response_length_mean"] == plain["rollout/response_length_mean"]
    assert abs(first["train/loss"] - plain["train/loss"]) < 1e-5
    assert first["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    assert "train/shared_prompt_tokens" not in plain
    # 4 prompts x 4 samples: 3 of every 4 rows' prompts are not computed again
    assert all(r["train/shared_prompt_tokens"] > 0 for r in shared)
    assert all(0.0 <= r["train/is_approx_k3_kl"] < 1e-6 for r in shared)


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


# A deterministic engine and a KL term in the loss touch different parts of the step: one run shows both.
EXACT = _short_run(
    "tiny/grpo_arith_cpu",
    "exact",
    2,
    "rollout.engine={name: native, params: {deterministic: true}}",
    "trainer.micro_batch_tokens=1",
    "algorithm.kl={name: k3}",
    "algorithm.kl_coef=0.05",
)
KL_IN_REWARD = _short_run(
    "tiny/grpo_arith_cpu",
    "kl_reward",
    2,
    "algorithm.kl={name: k3}",
    "algorithm.kl_coef=0.05",
    "algorithm.kl_in_reward=true",
    "algorithm.advantage.name=reinforce_pp",
)


@pytest.mark.parametrize("where", ["loss", "reward"])
def test_kl_against_a_frozen_reference(launched, where):
    """k3 KL to a frozen reference, in the loss (GRPO) or as a token reward (REINFORCE++)."""
    args, name = (EXACT, "exact") if where == "loss" else (KL_IN_REWARD, "kl_reward")
    trained = _trained(_metrics(launched(args) / "runs" / name))
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


def test_deterministic_engine_matches_the_trainer_exactly(launched):
    """Deterministic engine + one sequence per micro-batch: the train-inference mismatch is exactly 0."""
    trained = _trained(_metrics(launched(EXACT) / "runs" / "exact"))
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["train/is_logprob_abs_diff"] == 0.0 and r["train/is_approx_k3_kl"] == 0.0
