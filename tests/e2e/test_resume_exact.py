"""Resume is exact: a run stopped after step 2 and resumed equals the uninterrupted run, step by step
and bit for bit in its final weights (through the real launcher and Ray), and continues at the data
position where it stopped. The uninterrupted run is test_grpo_tiny.py's loop run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e._runs import grpo_loop

# sampled evaluation (pass@2) at every second step draws too: it must not shift the training draws
NOISY = ("timing/", "perf/")  # wall-clock figures


def _steps(run_dir: Path) -> dict[int, dict]:
    """The last row logged for every step, without wall-clock figures."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(NOISY)}
    return rows


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(_checkpoint(run_dir, step) / "trainer.pt", weights_only=False)
    return state["model"]


# not colocated, test_kill_resume.py's windowed_fifo run, killed and resumed, trains the uninterrupted
# run's groups, by id
@pytest.mark.parametrize("colocate", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(launched, colocate):
    whole_dir = launched(grpo_loop(colocate, "whole", 4)) / "runs" / "whole"
    stopped_at_2 = grpo_loop(colocate, "split", 2)
    split_dir = launched(stopped_at_2, [*grpo_loop(colocate, "split", 4), "resume=true"]) / "runs" / "split"
    whole, split = _steps(whole_dir), _steps(split_dir)
    assert sorted(whole) == sorted(split) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        a, b = whole[step], split[step]
        # the stopped run evaluated pass@k at its last step (2); everything else is logged by both
        shared = a.keys() & b.keys()
        assert {k for k in a.keys() ^ b.keys() if not k.startswith("eval/")} == set(), step
        assert "train/loss" in shared and "rollout/reward_mean" in shared
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}, f"step {step} differs"
    # the resumed run went on at step 3 with the next version of the weights ...
    assert [split[s]["engine/version"] for s in (3, 4)] == [3.0, 4.0]
    # ... and at the exact data position of step 2: two more steps of 4 prompts, new group ids
    stopped = json.loads((_checkpoint(split_dir, 2) / "controller.json").read_text())
    resumed = json.loads((_checkpoint(split_dir, 4) / "controller.json").read_text())
    assert resumed["mixer"]["arith"]["offset"] == stopped["mixer"]["arith"]["offset"] + 2 * 4
    assert resumed["next_group_id"] > stopped["next_group_id"]
    # the sampled evaluation at the end saw the same policy and drew the same samples
    assert whole[4]["eval/arith/pass@2"] == split[4]["eval/arith/pass@2"]
    end_whole, end_split = _weights(whole_dir, 4), _weights(split_dir, 4)
    assert end_whole.keys() == end_split.keys()
    assert all(torch.equal(end_whole[k], end_split[k]) for k in end_whole)
    # and the run did learn something in those steps: the weights moved from step 2
    mid = _weights(split_dir, 2)
    assert any(not torch.equal(mid[k], end_split[k]) for k in mid)
