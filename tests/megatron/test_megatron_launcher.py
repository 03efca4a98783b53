"""The ``megatron`` trainer backend through the real launcher and Ray: the tiny GRPO recipe with
nothing changed but the backend. Its first step is the torch backend's first step (the same
rollouts, the same fp32 arithmetic up to rounding), the engine takes its weights every step, and
the run ends with an HF folder that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main


def _run(name: str, steps: int, *extra: str) -> list[dict]:
    args = ["train", "tiny/grpo_arith_cpu", f"run.name={name}", f"run.total_steps={steps}",
            "data_sources.0.prompts_per_step=4", "data_sources.0.samples_per_prompt=4", "evaluation.every_steps=0",
            "tracking.progress=false", "checkpoint.every_steps=0", *extra]
    assert main(args) == 0
    rows = [json.loads(line) for line in (Path("runs") / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.timeout(600)
def test_the_tiny_recipe_trains_on_megatron_as_on_torch(ray_session, in_tmp):
    ours = _run("mcore", 3, "trainer.backend={name: megatron}", "checkpoint.export_hf=true")
    assert [r["step"] for r in ours] == [1, 2, 3]
    assert [r["engine/version"] for r in ours] == [1.0, 2.0, 3.0]  # every push reached the engine
    torch_rows = _run("torch", 1, "checkpoint.export_hf=false")
    for key in ("train/loss", "train/grad_norm"):
        assert ours[0][key] == pytest.approx(torch_rows[0][key], rel=1e-4, abs=1e-6), key
    from transformers import AutoModelForCausalLM

    start = json.loads((in_tmp / "runs" / "mcore" / "run_info.json").read_text())["model_path"]
    final = AutoModelForCausalLM.from_pretrained(str(in_tmp / "runs" / "mcore" / "final"), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    trained, before = final.state_dict(), initial.state_dict()
    assert trained.keys() == before.keys()
    assert any(not torch.equal(trained[n], before[n]) for n in before)  # three steps moved the weights


def test_the_launcher_refuses_lora_and_unknown_architectures_before_any_actor(in_tmp, capsys, model_cache):
    code = main(["train", "tiny/grpo_arith_cpu", "trainer.backend={name: megatron, params: {lora: {rank: 4}}}",
                 "tracking.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "lora: MegatronTrainer does not support LoRA; leave lora unset" in err
