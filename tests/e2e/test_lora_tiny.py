"""End to end through the real launcher and Ray: a shortened tiny/grpo_lora_cpu (LoRA adapters, merged push)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from loongsage.core.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo_tiny import _metrics, _model_path, _short_run, _trained  # noqa: E402


def test_lora_recipe_trains_pushes_merged_weights_and_resumes(ray_session, in_tmp):
    # with a k3 KL penalty: its frozen reference is the base model with the adapters switched off
    args = _short_run(
        "tiny/grpo_lora_cpu",
        "lora",
        3,
        "checkpoint.every_steps=3",
        "checkpoint.export_hf=true",
        "algorithm.kl={name: k3}",
        "algorithm.kl_coef=0.05",
    )
    assert main(args) == 0
    run_dir = in_tmp / "runs" / "lora"
    trained = _trained(_metrics(run_dir))
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0]
    start = load_file(str(_model_path(run_dir) / "model.safetensors"))
    linear = [k for k in start if k.startswith("model.layers.") and k.endswith("_proj.weight")]
    merged_bytes = sum(start[k].numel() * start[k].element_size() for k in linear)
    # the reference is the starting policy: KL is 0 before the first update and positive after it
    assert abs(trained[0]["train/kl"]) < 1e-6 and trained[-1]["train/kl"] > 0
    for r in trained:
        assert r["train/grad_norm"] > 0
        # the engine samples with the trainer's merged weights: the train-inference mismatch stays tiny
        assert 0.0 <= r["train/is_approx_k3_kl"] < 1e-6
        # each push carries exactly the merged decoder linear layers, not the embedding or the norms
        assert r["sync/bytes"] == merged_bytes
    ck = run_dir / "checkpoints" / "step_000003"
    state = torch.load(ck / "trainer.pt", weights_only=False)
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])

    # the exported folder is the base model's layout with merged weights: frozen tensors untouched
    end = load_file(str(run_dir / "final" / "model.safetensors"))
    assert end.keys() == start.keys()
    frozen = [k for k in start if k not in linear]
    assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)
    assert any(not torch.equal(start[k], end[k]) for k in linear)

    # resume: the adapters come back, their merged weights reach a fresh engine before step 4
    assert main([*args, "run.total_steps=4", "resume=true"]) == 0
    resumed = _trained(_metrics(run_dir))[-1]
    assert resumed["step"] == 4 and resumed["engine/version"] == 4.0
    assert 0.0 <= resumed["train/is_approx_k3_kl"] < 1e-6
