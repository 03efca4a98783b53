"""End to end through the real launcher and Ray: a shortened tiny/mixed_async_cpu (two tasks, one policy)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from loongsage.core.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo_tiny import _metrics, _model_path, _short_run, _trained  # noqa: E402

MIXED = "tiny/mixed_async_cpu"
# CI-sized: 4 prompts x 4 samples per source, and the two-task model fine-tuned for 20 steps from
# the default warm start instead of the recipe's 1,500 (cached by these params, so built once)
CI = ["data_sources.1.prompts_per_step=4", "data_sources.1.samples_per_prompt=4", "model.builder.params.steps=20",
      "evaluation.every_steps=2"]


def test_two_sources_train_one_policy_with_their_own_rewards_and_lengths(ray_session, in_tmp):
    assert main(_short_run(MIXED, "mixed", 2, *CI)) == 0
    run_dir = in_tmp / "runs" / "mixed"
    rows = _metrics(run_dir)
    trained = _trained(rows)
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["rollout/trajectories"] == 32  # 4 prompts x 4 samples from each source
        for source in ("arith", "sort"):
            assert 0.0 <= r[f"rollout_per_ds/{source}/reward_mean"] <= 1.0
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] >= 0  # 0 when every group is uniform
    assert [r["engine/version"] for r in trained] == [1.0, 2.0]  # one weight push per step
    for row in (rows[0], rows[-1]):
        for source in ("arith", "sort"):
            assert 0.0 <= row[f"eval/{source}/accuracy"] <= 1.0
        # each source decodes with its own max_new_tokens: 5 for arith, 24 for the sorted lists
        assert row["eval/arith/response_length"] <= 5 < row["eval/sort/response_length"] <= 24
    # the policy is the two-task warm start, fine-tuned from the default one
    info = json.loads((_model_path(run_dir) / "loongsage_warmstart.json").read_text())["params"]
    assert (info["sort"], info["init_from"], info["steps"], info["drop_prob"]) == ({}, {}, 20, 0.6)
    config = (run_dir / "config.yaml").read_text()
    assert "digit_sort" in config and "top_p: 0.95" in config and "max_new_tokens: 24" in config
