"""``loongsage report``: which series each panel plots, and which panels are drawn."""

from __future__ import annotations

import json
from pathlib import Path

from loongsage.core.report import panel_series, restart_steps, title, write_report


def _rows(steps: int = 4, **series) -> list[dict]:
    return [{"step": s, **{key.replace("__", "/"): fn(s) for key, fn in series.items()}} for s in range(1, steps + 1)]


def _write(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


# one optimizer step per rollout: the PPO ratio is 1, so its KL and clip fraction are exactly 0
GRPO_ROWS = _rows(
    rollout__reward_mean=lambda s: 0.1 * s,
    train__entropy=lambda s: 1.0 / s,
    train__clipfrac=lambda s: 0.0,
    train__ppo_kl=lambda s: 0.0,
    train__is_approx_k3_kl=lambda s: 1e-13 * s,
    train__is_logprob_abs_diff=lambda s: 1e-7,
    timing__step_s=lambda s: 0.5,
)


def test_series_that_are_absent_or_zero_throughout_are_not_plotted():
    panels = panel_series(GRPO_ROWS)
    assert panels == {
        "reward": ["rollout/reward_mean"],
        "policy": ["train/entropy"],  # clipfrac is 0 at every step
        "consistency": ["train/is_approx_k3_kl", "train/is_logprob_abs_diff"],
        "timing": ["timing/step_s"],
    }  # no KL panel: ppo_kl is identically 0 and no reference is configured


def test_reference_kl_and_clipping_are_plotted_when_they_say_something():
    rows = _rows(
        train__kl=lambda s: 0.0 if s == 1 else 1e-3 * s,
        train__ppo_kl=lambda s: 2e-4,
        train__clipfrac=lambda s: 0.01,
        train__entropy=lambda s: 0.8,
        train__mopd_kl=lambda s: 0.5,
    )
    panels = panel_series(rows)
    assert panels["kl"] == ["train/kl", "train/mopd_kl", "train/ppo_kl"]
    assert panels["policy"] == ["train/clipfrac", "train/entropy"]


def test_sft_run_has_no_consistency_panel(tmp_path):
    rows = _rows(
        rollout__reward_mean=lambda s: 1.0,
        train__pg_loss=lambda s: 2.0 / s,
        train__entropy=lambda s: 2.0,
        eval__arith__accuracy=lambda s: 0.1 * s,
    )
    assert "consistency" not in panel_series(rows)
    paths = write_report(_write(tmp_path / "sft", rows))
    assert sorted(p.name for p in paths) == ["accuracy.png", "loss.png", "overview.png", "policy.png", "reward.png"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)


def test_write_report_draws_the_non_empty_panels(tmp_path):
    paths = write_report(_write(tmp_path / "grpo", GRPO_ROWS))
    assert sorted(p.name for p in paths) == [
        "consistency.png",
        "overview.png",
        "policy.png",
        "reward.png",
        "timing.png",
    ]


def test_a_multi_source_async_run_gets_its_panels_in_a_grid_with_titles_naming_their_series(tmp_path):
    rows = [{"step": 0, "eval/arith/accuracy": 0.2, "eval/arith/pass@8": 0.5, "eval/sort/accuracy": 0.0}]
    rows += _rows(
        8,
        rollout__reward_mean=lambda s: 0.1 * s,
        rollout_per_ds__arith__reward_mean=lambda s: 0.2 * s,
        rollout_per_ds__sort__reward_mean=lambda s: 0.0,  # a source that learns nothing is a result
        train__loss=lambda s: 1.0 / s,
        train__grad_norm=lambda s: 0.0 if s > 2 else 3.0,
        train__lr=lambda s: 1e-5,
        rollout__staleness_mean=lambda s: 0.5,
        rollout__staleness_max=lambda s: 1.0,
        rollout__partial_frac=lambda s: 0.25,
        rollout__engine_restarts=lambda s: 1.0 if s == 5 else 0.0,
        timing__step_s=lambda s: 1.0,
    )
    rows.append({"step": 8, "eval/arith/accuracy": 0.6, "eval/arith/pass@8": 0.9, "eval/sort/accuracy": 0.0})
    panels = panel_series(rows)
    assert panels["reward"] == [
        "rollout/reward_mean",
        "rollout_per_ds/arith/reward_mean",
        "rollout_per_ds/sort/reward_mean",
    ]
    assert panels["accuracy"] == ["eval/arith/accuracy", "eval/arith/pass@8", "eval/sort/accuracy"]
    assert title("reward", panels["reward"]) == "reward: all sources, arith, sort"
    assert title("accuracy", panels["accuracy"]) == "held out: arith accuracy, arith pass@8, sort accuracy"
    assert title("staleness", panels["staleness"]) == "staleness (policy versions): max, mean"
    assert title("grad_norm", panels["grad_norm"]) == "gradient norm"
    assert restart_steps(rows) == [5]
    paths = write_report(_write(tmp_path / "mixed_async", rows))
    names = {p.name for p in paths}
    for panel in ("reward", "accuracy", "loss", "grad_norm", "lr", "staleness", "partial", "timing"):
        assert f"{panel}.png" in names, panel
    from PIL import Image

    width, height = Image.open(paths[0]).size  # the overview: 3 columns, as many lines as it needs
    assert paths[0].name == "overview.png" and 1.0 < width / height < 2.0, (width, height)
