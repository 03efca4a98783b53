"""Fully asynchronous training through the real launcher and Ray: generation runs beside training on
its own cores, within the staleness bound, and a resumed run re-dispatches what was not trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main
from tests.e2e._runs import STEPS, WINDOWED, audited


def _trained(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


# Each scheduler decides only what to dispatch and when (tests/core/test_schedulers.py, one test each);
# the rollout around it is the same. Through the launcher, no_window is also trained, resumed and held
# to its bound by test_kill_resume.py's test_a_resumed_run_keeps_the_staleness_budget and
# test_mixed_tiny.py's audited run; one_step_off by nothing else.
@pytest.mark.parametrize(
    "scheduler,eta",
    [
        pytest.param("{name: no_window, params: {max_staleness: 1}}", 1, marks=pytest.mark.slow),
        (WINDOWED, 2),
        pytest.param("{name: one_step_off}", 1, marks=pytest.mark.slow),
    ],
)
def test_async_schedulers_train_within_the_staleness_bound(launched, scheduler, eta):
    trained = _trained(launched(audited("whole", scheduler)) / "runs" / "whole")
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert [r["engine/version"] for r in trained] == [float(s) for s in range(1, STEPS + 1)]
    for r in trained:
        assert r["rollout/groups_trained"] == 4 and r["rollout/trajectories"] == 16
        assert 0 <= r["rollout/staleness_max"] <= eta
        if "one_step_off" in scheduler:  # exactly one step ahead: nothing is ever too stale to train
            assert r.get("rollout/stale_dropped", 0) == 0
    # generation ran ahead of training: later batches were sampled by an older policy
    assert max(r["rollout/staleness_max"] for r in trained[1:]) >= 1


def _trained_prompts(run_dir: Path) -> list[tuple[str, int]]:
    """Every trained group's (source, record index) from the batch audit, the last row of each step."""
    steps = {}
    for line in (run_dir / "batches.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]] = row
    return sorted((g["source"], g["index"]) for row in steps.values() for g in row["groups"])


# test_kill_resume.py's windowed_fifo case resumes the same way from the checkpoint of a run killed
# mid-step (its rollout state, buffered and in flight, taken by the same snapshot) and checks the
# same prompts, by group id, and that the first resumed batch trains the buffered groups
@pytest.mark.slow
def test_async_resume_trains_the_same_prompts_as_an_uninterrupted_run(launched, in_tmp):
    """In dispatch order (windowed_fifo), a run stopped after step 2 and resumed trains exactly the
    prompts of the uninterrupted run: the checkpoint holds the groups generated ahead of training
    (buffered, or in flight with their calls so far), and the resumed run goes on with them."""
    whole = _trained_prompts(launched(audited("whole", WINDOWED)) / "runs" / "whole")
    assert main(audited("split", WINDOWED, 2)) == 0
    run_dir = in_tmp / "runs" / "split"
    rollout = torch.load(run_dir / "checkpoints" / "step_000002" / "rollout.pt", weights_only=False)
    ahead = rollout["sources"]["arith"]
    assert len(ahead["buffer"]) + len(ahead["in_flight"]) > 0  # generation had run ahead of training
    assert main([*audited("split", WINDOWED), "resume=true"]) == 0
    assert [r["step"] for r in _trained(run_dir)] == list(range(1, STEPS + 1))
    assert len(whole) == STEPS * 4 and len(set(whole)) == len(whole)  # nothing trained twice
    assert _trained_prompts(run_dir) == whole
    for row in map(json.loads, (run_dir / "batches.jsonl").read_text().splitlines()):
        assert all(g["staleness"] <= 2 for g in row["groups"])
