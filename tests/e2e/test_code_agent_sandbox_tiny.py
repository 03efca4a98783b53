"""``tiny/code_agent_sandbox_cpu`` through the launcher and Ray: a black-box agent program works in
a sandbox of the run's ``sandboxes`` service, and the reward runs the task's tests inside that same
sandbox after the episode (the R2E/SWE pattern). Checked: every trajectory was tested in its own
agent's sandbox (the reward read the program's solution.py there, not the response), the rewards
vary (a gradient), every lease was released once its trajectory was scored, and no sandbox process,
directory or actor is left when the run ends."""

from __future__ import annotations

import json

import pytest

from loongsage.core.cli import main
from loongsage.sandbox.jail import jail_problem
from loongsage.sandbox.store import SandboxStore, default_root
from tests._procs import sandbox_processes

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(jail_problem() is not None, reason=f"no sandbox here: {jail_problem()}"),
]


def _sandbox_dirs() -> list[str]:
    root = default_root()
    return sorted(p.name for p in root.iterdir() if p.name != "uids") if root.exists() else []


def _live_sandbox_dirs() -> list[str]:
    """The sandbox folders, those of a process that died without removing them (a run killed
    earlier on this machine) reaped first, as the run's own pool does when it starts."""
    SandboxStore(default_root()).reap_orphans()
    return _sandbox_dirs()


def test_agent_program_works_in_a_sandbox_and_its_reward_tests_there(ray_session, in_tmp):
    before = _live_sandbox_dirs()
    args = [
        "train",
        "tiny/code_agent_sandbox_cpu",
        "run.name=agent",
        "run.total_steps=2",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.every_steps=0",
        "evaluation.max_prompts=8",
        "tracking.progress=false",
        "checkpoint.export_hf=false",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "agent" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/trajectories"] == 16 and r.get("rollout/failed_frac", 0) == 0 for r in trained), trained
    assert any(0 < r["rollout/reward_mean"] < 1 for r in trained) and any(r["train/grad_norm"] > 0 for r in trained)
    # every trajectory scored so far had its sandbox released once scored: none leased between steps
    for r in trained:
        assert r["sandbox/leased"] == 0 and r["sandbox/acquired"] == r["sandbox/released"] > 0, r
    assert trained[-1]["sandbox/acquired"] >= 8 + 2 * 16  # the first evaluation, then two steps
    assert sandbox_processes() == 0 and _sandbox_dirs() == before
