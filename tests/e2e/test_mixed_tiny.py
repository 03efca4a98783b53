"""End to end through the real launcher and Ray: a shortened tiny/mixed_async_cpu (two tasks, one policy)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo_tiny import _metrics, _model_path, _short_run, _trained  # noqa: E402

MIXED = "tiny/mixed_async_cpu"
# CI-sized: 4 prompts x 4 samples per source, and the two-task model fine-tuned for 20 steps from
# the default warm start instead of the recipe's 1,500 (cached by these params, so built once)
CI = ["data_sources.1.prompts_per_step=4", "data_sources.1.samples_per_prompt=4", "model.builder.params.steps=20"]
# One run for both tests: the recipe fully asynchronous (no_window, eta = 1, as it ships) on 2 DP
# ranks x 2 mini-batches, its trained batches audited, evaluated at its start and end
RUN = _short_run(
    MIXED,
    "mixed",
    4,
    *CI,
    "rollout.scheduler={name: no_window, params: {max_staleness: 1}}",
    "trainer.world_size=2",
    "trainer.mini_batches_per_step=2",
    "tracking.batches=true",
    "evaluation.every_steps=0",
    "evaluation.max_prompts=4",
)


def test_two_sources_train_one_policy_with_their_own_rewards_and_lengths(launched):
    run_dir = launched(RUN) / "runs" / "mixed"
    rows = _metrics(run_dir)
    trained = _trained(rows)
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    for r in trained:
        assert r["rollout/trajectories"] == 32  # 4 prompts x 4 samples from each source
        for source in ("arith", "sort"):
            assert 0.0 <= r[f"rollout_per_ds/{source}/reward_mean"] <= 1.0
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] >= 0  # 0 when every group is uniform
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0, 4.0]  # one weight push per step
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


def audit(run_dir: Path, quotas: dict[str, int], ranks: int, mini_batches: int, eta: int) -> int:
    """Check a run's trained batches (``tracking.batches``): every step's groups come from each
    source in its exact quota, dealt equally to every DP rank and mini-batch, none staler than
    ``eta`` versions, and no prompt trained twice. Returns the number of steps audited."""
    steps = {}
    for line in (run_dir / "batches.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]] = row  # a resumed run re-trains steps after its checkpoint: the last counts
    seen = set()
    for step, row in sorted(steps.items()):
        cells: dict[tuple[int, int], dict[str, int]] = {}
        for g in row["groups"]:
            cell = cells.setdefault((g["rank"], g["mini_batch"]), dict.fromkeys(quotas, 0))
            cell[g["source"]] += 1
            assert 0 <= g["staleness"] <= eta, (step, g)
            assert (g["source"], g["index"]) not in seen, (step, g)
            seen.add((g["source"], g["index"]))
        assert sorted(cells) == [(r, m) for r in range(ranks) for m in range(mini_batches)], step
        for cell in cells.values():  # the step's proportion, on every rank and every mini-batch
            assert cell == {s: q // (ranks * mini_batches) for s, q in quotas.items()}, (step, cells)
    assert sorted(steps) == list(range(1, len(steps) + 1))
    return len(steps)


def test_fully_async_mixed_sources_keep_exact_proportions_and_the_staleness_bound(launched):
    """The mixed recipe fully asynchronous (no_window, eta = 1) on 2 DP ranks x 2 mini-batches: the
    batch audit shows each source's exact share on every rank and mini-batch, and no trained group
    whose oldest token lags more than eta versions, while generation ran ahead of training."""
    run_dir = launched(RUN) / "runs" / "mixed"
    assert audit(run_dir, {"arith": 4, "sort": 4}, ranks=2, mini_batches=2, eta=1) == 4
    trained = _trained(_metrics(run_dir))
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0, 4.0]
    assert max(r["rollout/staleness_max"] for r in trained) == 1  # generation ran ahead of training
    for r in trained:
        assert r["rollout/trajectories"] == 32
        assert r["rollout_per_ds/arith/response_length_mean"] <= 5
        assert r["rollout_per_ds/sort/response_length_mean"] <= 24
