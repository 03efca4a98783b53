"""``tiny/code_sandbox_cpu`` through the launcher and Ray, CI-sized: the policy's code is scored by
unit tests run in a fresh ``local`` sandbox per trajectory (the ``code_tests`` reward in the reward
worker). Checked: the runs finish, rewards come from the tests (the warm start's samples both pass
and fail them, so there is a gradient), greedy decoding starts below sampling (RL headroom), and no
sandbox process or directory is left. Whether success rises is the full recipe's result
(docs/sandbox.md), not a CI test."""

from __future__ import annotations

import json

import pytest

from loongsage.core.cli import main
from loongsage.sandbox.jail import jail_problem
from tests._procs import sandbox_processes

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(jail_problem() is not None, reason=f"no sandbox here: {jail_problem()}"),
]


def test_code_recipe_trains_on_sandboxed_unit_tests(ray_session, in_tmp):
    args = [
        "train",
        "tiny/code_sandbox_cpu",
        "run.name=code",
        "run.total_steps=2",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.every_steps=0",
        "evaluation.max_prompts=16",
        "evaluation.pass_k=4",
        "tracking.progress=false",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "code" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/trajectories"] == 16 and r.get("rollout/failed_frac", 0) == 0 for r in trained), trained
    assert any(0 < r["rollout/reward_mean"] < 1 for r in trained) and any(r["train/grad_norm"] > 0 for r in trained)
    first = next(r for r in rows if "eval/code_fn/accuracy" in r)
    assert first["eval/code_fn/accuracy"] < first["eval/code_fn/pass@4"], first
    assert sandbox_processes() == 0
