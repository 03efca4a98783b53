"""End to end through the real launcher and Ray: a shortened tiny SFT recipe (teacher-forced agent + nll)."""

from __future__ import annotations

import json
import math

from loongsage.core.cli import main


def test_sft_recipe_trains_the_nll_down(ray_session, in_tmp):
    args = [
        "train",
        "tiny/sft_chat_cpu",
        "run.name=sft",
        "run.total_steps=3",
        "data_sources.0.prompts_per_step=16",
        "evaluation.every_steps=3",
        "evaluation.max_prompts=8",
        "tracking.progress=false",
        "checkpoint.export_hf=false",
        "checkpoint.every_steps=3",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    nll = [r["train/pg_loss"] for r in trained]
    assert all(math.isfinite(x) and x > 0 for x in nll)
    # lr warms up from 1e-4 on fresh prompts every step: the NLL still falls from step 1 to step 3
    assert nll[2] < nll[0], nll
    for r in trained:
        assert r["rollout/trajectories"] == 16  # one teacher-forced trajectory per prompt
        assert r["rollout/reward_mean"] == 1.0  # the labels are exact answers: teacher forcing scores them 1
        assert r["train/grad_norm"] > 0
    # evaluation generated through the engine (greedy), scored by exact match
    assert "eval/arith/accuracy" in rows[0] and "eval/arith/accuracy" in rows[-1]
    assert 0.0 <= rows[-1]["eval/arith/accuracy"] <= 1.0
