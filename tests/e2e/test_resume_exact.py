"""Resume is exact: a run stopped after step 2 and resumed equals the uninterrupted run, step by step
and bit for bit in its final weights (through the real launcher and Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main

# sampled evaluation (pass@2) at every second step draws too: it must not shift the training draws
COMMON = ["tiny/grpo_arith_cpu", "data_sources.0.prompts_per_step=4", "data_sources.0.samples_per_prompt=4",
          "evaluation.every_steps=2", "evaluation.max_prompts=8", "evaluation.pass_k=2", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
          "checkpoint.export_hf=false", "tracking.progress=false"]
NOISY = ("timing/", "perf/")  # wall-clock figures


def _steps(run_dir: Path) -> dict[int, dict]:
    """The last row logged for every step, without wall-clock figures."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(NOISY)}
    return rows


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / "trainer.pt", weights_only=False)
    return state["model"]


@pytest.mark.parametrize("colocate", ["true", "false"])
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(ray_session, in_tmp, colocate):
    assert main(["train", *COMMON, "run.name=whole", "run.total_steps=4", f"colocate={colocate}"]) == 0
    assert main(["train", *COMMON, "run.name=split", "run.total_steps=2", f"colocate={colocate}"]) == 0
    assert main(["train", *COMMON, "run.name=split", "run.total_steps=4", f"colocate={colocate}", "resume=true"]) == 0
    whole, split = _steps(in_tmp / "runs" / "whole"), _steps(in_tmp / "runs" / "split")
    assert sorted(whole) == sorted(split) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        a, b = whole[step], split[step]
        # the stopped run evaluated pass@k at its last step (2); everything else is logged by both
        shared = a.keys() & b.keys()
        assert {k for k in a.keys() ^ b.keys() if not k.startswith("eval/")} == set(), step
        assert "train/loss" in shared and "rollout/reward_mean" in shared
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}, f"step {step} differs"
    # the sampled evaluation at the end saw the same policy and drew the same samples
    assert whole[4]["eval/arith/pass@2"] == split[4]["eval/arith/pass@2"]
    end_whole, end_split = _weights(in_tmp / "runs" / "whole", 4), _weights(in_tmp / "runs" / "split", 4)
    assert end_whole.keys() == end_split.keys()
    assert all(torch.equal(end_whole[k], end_split[k]) for k in end_whole)
    # and the run did learn something in those steps: the weights moved from step 2
    mid = _weights(in_tmp / "runs" / "split", 2)
    assert any(not torch.equal(mid[k], end_split[k]) for k in mid)
