"""The ``megatron`` trainer and teacher backends through the real launcher and Ray: the tiny MOPD
recipe (two sources, a teacher each, GRPO's PG branch and the GKD branch) with the trainer and one
teacher on Megatron, against the torch trainer and the embedded teacher; R3 routing replay on a
tiny Qwen3-MoE, the native engine recording the routes, its experts split over two ranks; a
replica split over two tensor-parallel ranks; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main

SUB_TEACHER = (
    '{name: %s, params: {builder: {name: tiny_arith, params: {name: tiny-arith-teacher-sub, operations: "-",'
    " drop_prob: 0.0, steps: 20, batch_size: 64, warmup_steps: 10, init_from: {}}}}}"
)

ADD_TEACHER = (
    "{name: trainer, params: {builder: {name: tiny_arith, params: {name: tiny-arith-teacher-add, "
    'operations: "+", drop_prob: 0.0, steps: 20, batch_size: 64, warmup_steps: 10, init_from: {}}}}}'
)


# what these runs check is training: the start's and end's evaluations (always run) on 4 prompts, greedy
SMALL_EVALUATION = ("evaluation.every_steps=0", "evaluation.max_prompts=4", "evaluation.pass_k=0")


def _mopd(name: str, steps: int, trainer: str, teacher: str, *extra: str) -> list[dict]:
    """tiny/mopd_two_teachers_cpu, shortened, the `sub` source's teacher on ``teacher``."""
    args = [
        "train",
        "tiny/mopd_two_teachers_cpu",
        f"run.name={name}",
        f"run.total_steps={steps}",
        *SMALL_EVALUATION,
        "tracking.progress=false",
        "checkpoint.every_steps=0",
        "model.builder.params.steps=20",
        "data_sources.0.teacher.params.builder.params.steps=20",
        *(f"data_sources.{i}.{k}=4" for i in (0, 1) for k in ("prompts_per_step", "samples_per_prompt")),
        f"trainer.backend={{name: {trainer}}}",
        f"data_sources.1.teacher={SUB_TEACHER % teacher}",
        *extra,
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (Path("runs") / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.timeout(600)
def test_mopd_on_the_megatron_trainer_and_teacher_runs_as_on_torch(ray_session, in_tmp):
    """The same seed and student give the same rollouts, so the first step is the torch trainer's
    with the embedded teacher: the megatron teacher's log-probs of the student's tokens, the
    divergences, the loss and the gradient norm. The engine takes every push, and the run ends with
    an HF folder that transformers loads."""
    ours = _mopd("mcore", 2, "megatron", "megatron", "checkpoint.export_hf=true")
    assert [r["step"] for r in ours] == [1, 2]
    assert [r["engine/version"] for r in ours] == [1.0, 2.0]  # every push reached the engine
    ref = _mopd("torch", 1, "torch", "embedded", "checkpoint.export_hf=false")
    # both teachers held by two tensor-parallel ranks, split as the student: the JSD summed over
    # each rank's shard of the vocabulary
    held = _mopd(
        "held",
        1,
        "megatron",
        "trainer",
        "checkpoint.export_hf=false",
        "trainer.world_size=2",
        "trainer.backend.params={tensor_parallel: 2}",
        f"data_sources.0.teacher={ADD_TEACHER}",
    )
    for key in (
        "train_per_ds/sub/mopd_teacher_logprob",
        "train_per_ds/sub/gkd",
        "train_per_ds/add/gkd",
        "train/loss",
        "train/grad_norm",
    ):
        assert ours[0][key] == pytest.approx(ref[0][key], rel=1e-4, abs=1e-6), key
        assert held[0][key] == pytest.approx(ref[0][key], rel=1e-4, abs=1e-6), key
    assert ours[0]["train_per_ds/sub/mopd_teacher_logprob"] < 0
    from transformers import AutoModelForCausalLM

    start = json.loads((in_tmp / "runs" / "mcore" / "run_info.json").read_text())["model_path"]
    final = AutoModelForCausalLM.from_pretrained(str(in_tmp / "runs" / "mcore" / "final"), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    trained, before = final.state_dict(), initial.state_dict()
    assert trained.keys() == before.keys()
    assert any(not torch.equal(trained[n], before[n]) for n in before)  # the steps moved the weights


@pytest.mark.timeout(600)
def test_r3_replays_every_route_the_engine_recorded_on_experts_split_over_two_ranks(ray_session, in_tmp):
    """tiny/grpo_moe_r3_cpu on two trainer ranks, the experts split between them (each rank trains
    on half the rows): the native engine records the experts of every token it fed the tiny
    Qwen3-MoE; the megatron trainer replays them: each trained token's routes exactly once over the
    ranks (16 samples of 8 prompt + 8 sampled tokens a step), and the trainer's log-probs are the
    engine's."""
    assert (
        main(
            [
                "train",
                "tiny/grpo_moe_r3_cpu",
                "run.total_steps=2",
                "tracking.progress=false",
                *SMALL_EVALUATION,
                "checkpoint.every_steps=0",
                "trainer.world_size=2",
                "trainer.backend={name: megatron, params: {expert_parallel: 2}}",
            ]
        )
        == 0
    )
    rows = [
        json.loads(line) for line in (in_tmp / "runs" / "grpo_moe_r3_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0]
    for r in trained:
        assert r["rollout/trajectories"] == 16 and r["train/r3_replayed_tokens"] == 16 * 16, r
        assert r["train/is_logprob_abs_diff"] < 1e-5, r  # measured 1e-7 (fp32)


@pytest.mark.timeout(600)
def test_r3_replays_the_routes_of_trajectories_made_through_the_gateway(ray_session, in_tmp):
    """The same recipe with the chat agent: the model answers through the gateway's OpenAI
    endpoint, and each trajectory carries its line's routes (16 rows of a 16-token chat prompt and
    8 sampled tokens), all replayed."""
    assert (
        main(
            [
                "train",
                "tiny/grpo_moe_r3_cpu",
                "run.name=r3_gateway",
                "run.total_steps=1",
                *SMALL_EVALUATION,
                "tracking.progress=false",
                "checkpoint.every_steps=0",
                "data_sources.0.agent={name: chat}",
                "services=[{name: gateway, params: {chat_template: tokenizer, max_context_tokens: 256}}]",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (in_tmp / "runs" / "r3_gateway" / "metrics.jsonl").read_text().splitlines()]
    (r,) = [r for r in rows if "train/loss" in r]
    assert r["rollout/trajectories"] == 16 and r["train/r3_replayed_tokens"] == 16 * 24, r
    assert r["train/is_logprob_abs_diff"] < 1e-5, r


@pytest.mark.timeout(600)
def test_a_replica_split_over_two_trainer_ranks_trains_as_one(ray_session, in_tmp):
    """tiny/grpo_arith_cpu on two trainer ranks holding one replica, split by tensor parallelism or
    into two pipeline stages: both ranks get the same rows, the one computing the losses answers,
    and the first step is the one-rank torch trainer's."""
    common = [
        "train",
        "tiny/grpo_arith_cpu",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        *SMALL_EVALUATION,
        "tracking.progress=false",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
    ]
    assert (
        main(
            [
                *common,
                "run.name=tp2",
                "run.total_steps=2",
                "trainer.world_size=2",
                "trainer.backend={name: megatron, params: {tensor_parallel: 2}}",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                *common,
                "run.name=pp2",
                "run.total_steps=2",
                "trainer.world_size=2",
                "trainer.backend={name: megatron, params: {pipeline_parallel: 2}}",
            ]
        )
        == 0
    )
    assert main([*common, "run.name=one", "run.total_steps=1"]) == 0
    rows = {
        name: [
            r
            for r in map(json.loads, (in_tmp / "runs" / name / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r
        ]
        for name in ("tp2", "pp2", "one")
    }
    for split in ("tp2", "pp2"):
        assert [r["engine/version"] for r in rows[split]] == [1.0, 2.0]
        for key in ("train/loss", "train/grad_norm", "rollout/trajectories"):
            assert rows[split][0][key] == pytest.approx(rows["one"][0][key], rel=1e-4, abs=1e-6), (split, key)


def test_the_launcher_refuses_lora_and_a_layout_that_does_not_divide_before_any_actor(in_tmp, capsys, model_cache):
    code = main(
        [
            "train",
            "tiny/grpo_arith_cpu",
            "trainer.backend={name: megatron, params: {lora: {rank: 4}}}",
            "tracking.progress=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "lora: MegatronTrainer does not support LoRA; leave lora unset" in err
    code = main(
        [
            "train",
            "tiny/grpo_arith_cpu",
            "trainer.world_size=3",
            "data_sources.0.prompts_per_step=6",
            "trainer.backend={name: megatron, params: {tensor_parallel: 2}}",
            "tracking.progress=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "tensor_parallel=2 does not divide trainer.world_size=3; allowed: a divisor of 3" in err
