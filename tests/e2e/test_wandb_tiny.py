"""End to end through the real launcher: the wandb tracker (offline) beside jsonl, across a resume."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loongsage.core.cli import main
from loongsage.core.tracking import WANDB_RUN_ID_FILE

_spec = importlib.util.spec_from_file_location(
    "_wandb_offline", Path(__file__).parents[1] / "core" / "test_tracking_wandb.py"
)
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)


def _args(steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=wandb_e2e",
        f"run.total_steps={steps}",
        "data_sources.0.prompts_per_step=2",
        "data_sources.0.samples_per_prompt=2",
        "evaluation.max_prompts=4",
        "evaluation.pass_k=0",
        "checkpoint.every_steps=1",
        "checkpoint.export_hf=false",
        "tracking.progress=false",
        "tracking.backends=[jsonl,wandb]",
        *extra,
    ]


# the trackers the launcher builds from the run's config, for a run and its resume, are checked without
# Ray by tests/core/test_tracking_wandb.py's
# test_a_runs_trackers_and_their_resume_log_one_wandb_run_beside_metrics_jsonl
@pytest.mark.slow
def test_wandb_run_continues_across_resume(ray_session, in_tmp, monkeypatch):
    # offline, WANDB_DIR unset: W&B's files go to the run directory
    _helpers.offline_env(monkeypatch, in_tmp / "wandb_home", None)
    run_dir = in_tmp / "runs" / "wandb_e2e"
    try:
        assert main(_args(2)) == 0
        run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
        assert main(_args(3, "resume=true")) == 0
        assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == run_id
        sessions = _helpers.read_offline_runs(run_dir)  # tears W&B's service down first: files complete
    finally:
        import wandb

        wandb.teardown()

    assert len(sessions) == 2
    for s in sessions:
        assert s["ids"] == {run_id} and s["file"] == f"run-{run_id}.wandb" and f"-{run_id}" in s["dir"]
        assert s["name"] == "wandb_e2e" and s["config"]["run"]["name"] == "wandb_e2e"
    assert [s["config"]["checkpoint"]["resume"] for s in sessions] == [False, True]
    assert [s["config"]["run"]["total_steps"] for s in sessions] == [2, 3]
    # step 0 (the first evaluation), 1 and 2, then the resumed run's step 3
    assert [sorted(s["history"]) for s in sessions] == [[0, 1, 2], [3]]
    history = {step: row for s in sessions for step, row in s["history"].items()}
    # the same numbers as metrics.jsonl, step for step
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3]
    for step, row in history.items():
        assert "train/loss" in row or step == 0
        assert row == {k: v for k, v in rows[step].items() if k != "step"}
