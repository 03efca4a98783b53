"""Fully asynchronous training through the real launcher and Ray: generation runs beside training on
its own cores, within the staleness bound, and a resumed run re-dispatches what was not trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main


def _args(name: str, scheduler: str, steps: int, *extra: str) -> list[str]:
    return ["train", "tiny/grpo_arith_cpu", f"run.name={name}", f"run.total_steps={steps}", "colocate=false",
            f"rollout.scheduler={scheduler}", "data_sources.0.prompts_per_step=4", "data_sources.0.samples_per_prompt=4",
            "evaluation.every_steps=0", "evaluation.max_prompts=8", "evaluation.pass_k=0", "tracking.progress=false",
            "checkpoint.export_hf=false", *extra]


def _trained(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.parametrize("scheduler,eta", [("{name: no_window, params: {max_staleness: 1}}", 1),
                                           ("{name: windowed_fifo, params: {max_staleness: 2}}", 2),
                                           ("{name: one_step_off}", 1)])
def test_async_schedulers_train_within_the_staleness_bound(ray_session, in_tmp, scheduler, eta):
    assert main(_args("async", scheduler, 4)) == 0
    trained = _trained(in_tmp / "runs" / "async")
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0, 4.0]
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


def test_async_resume_trains_the_same_prompts_as_an_uninterrupted_run(ray_session, in_tmp):
    """In dispatch order (windowed_fifo), a run stopped after step 2 and resumed trains exactly the
    prompts of the uninterrupted run: the checkpoint holds the groups generated ahead of training
    (buffered, or in flight with their calls so far), and the resumed run goes on with them."""
    fifo = "{name: windowed_fifo, params: {max_staleness: 2}}"
    common = ("checkpoint.every_steps=1", "tracking.batches=true")
    assert main(_args("whole", fifo, 4, *common)) == 0
    assert main(_args("split", fifo, 2, *common)) == 0
    run_dir = in_tmp / "runs" / "split"
    rollout = torch.load(run_dir / "checkpoints" / "step_000002" / "rollout.pt", weights_only=False)
    ahead = rollout["sources"]["arith"]
    assert len(ahead["buffer"]) + len(ahead["in_flight"]) > 0  # generation had run ahead of training
    assert main([*_args("split", fifo, 4, *common), "resume=true"]) == 0
    assert [r["step"] for r in _trained(run_dir)] == [1, 2, 3, 4]
    whole = _trained_prompts(in_tmp / "runs" / "whole")
    assert len(whole) == 4 * 4 and len(set(whole)) == len(whole)  # nothing trained twice
    assert _trained_prompts(run_dir) == whole
    for row in map(json.loads, (run_dir / "batches.jsonl").read_text().splitlines()):
        assert all(g["staleness"] <= 2 for g in row["groups"])
