"""Expert parallelism in the ``megatron`` trainer (CPU, gloo): two data-parallel ranks of a tiny
Qwen3-MoE with its experts split two ways compute what they compute with every expert on both
ranks. The ranks' micro-batches differ in count and shape (the all-gather dispatcher needs equal
token counts: the forward pads to the group's largest); an expert's gradient is summed over the
ranks that hold it, a dense one over all; the gradient norm counts each expert once; the exports
gather every expert on rank 0 in HF's fused layout; a checkpoint resumes exactly, each rank's
experts' optimizer state included; the distributed optimizer (the experts in a bucket of their
own) steps as the whole one and resumes exactly. Layouts that cannot split the experts are
refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _moe_worker import EXPERTS, build  # noqa: E402

WORKER = Path(__file__).with_name("_ep_worker.py")


def _run(model_dir: str, work: Path, ep: int) -> list[dict]:
    run = subprocess.run([sys.executable, str(WORKER), model_dir, str(work), str(ep)], capture_output=True, text=True,
                         timeout=280, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(work / f"ep{ep}.pt", weights_only=False)


@pytest.mark.timeout(600)
def test_experts_split_over_two_ranks_train_as_replicated_ones(tmp_path):
    model_dir = build(tmp_path / "moe")
    whole, split = _run(model_dir, tmp_path, 1), _run(model_dir, tmp_path, 2)
    assert [r["layout"] for r in split] == [(0, 2, True), (1, 2, True)]  # each rank a data-parallel rank
    assert [r["local_experts"] for r in whole] == [EXPERTS * 2] * 2  # per layer, two layers
    assert [r["local_experts"] for r in split] == [EXPERTS] * 2
    for rank, (one, two) in enumerate(zip(whole, split)):
        mask = torch.ones_like(one["logprobs"], dtype=torch.bool)
        mask[:, :8] = False
        for key in ("logprobs", "entropy", "replayed"):
            assert (one[key] - two[key])[mask].abs().max() < 1e-5, (rank, key)
        assert (one["replayed"] - one["logprobs"])[mask].abs().max() > 1e-3  # the routes were replayed
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert (one["after"] - two["after"])[mask].abs().max() < 1e-3  # AdamW's first step: lr x sign(g)
        assert two["resumed_exact"] and two["resumed_step_exact"], rank
        for r in (one, two):  # the distributed optimizer steps as the whole one
            assert r["split_grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
            assert (r["split_after"] - r["after"])[mask].abs().max() < 1e-5
            assert r["split_resumed_step_exact"]
    assert whole[0]["grad_norm"] == whole[1]["grad_norm"]  # the same gradients after the sum
    exported, reference = split[0]["exported"], whole[0]["exported"]
    assert split[1]["exported"] == {}  # rank 0 gathers the experts; the other rank yields nothing
    assert exported.keys() == reference.keys()
    assert exported["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == EXPERTS
    diffs = {n: (t - exported[n]).abs().max().item() for n, t in reference.items()}
    assert max(diffs.values()) <= 2.5e-3, diffs


def test_a_layout_that_cannot_split_the_experts_is_refused_in_one_line(tmp_path):
    from loongsage.megatron.trainer import MegatronTrainer

    model_dir = build(tmp_path / "moe")  # 8 experts
    cases = ((3, 3, "expert_parallel=3 does not divide num_experts=8; allowed: a divisor of 8"),
             (4, 2, "expert_parallel=4 does not divide trainer.world_size=2; allowed: a divisor of 2"))
    for ep, world, message in cases:
        with pytest.raises(ValueError) as err:
            MegatronTrainer.preflight({"expert_parallel": ep}, model_dir, world_size=world)
        assert str(err.value) == message
    for params in ({"tensor_parallel": 2}, {"expert_parallel": 2, "tensor_parallel": 2}):
        with pytest.raises(ValueError, match=r"^tensor_parallel=2 on a mixture of experts needs sequence parallelism"):
            MegatronTrainer.preflight(params, model_dir, world_size=4)
