"""``loongsage report <run>``: PNG plots of a run's metrics.

Panels: reward, held-out accuracy, the policy (entropy and PPO clip fraction), KL (drift from the
reference/starting policy, the per-step PPO KL, the KL to MOPD teachers), train-inference
consistency (k3 KL and mean |log-ratio| between trainer and engine), response length, timings.
A series that is absent or zero at every step says nothing (PPO's KL and clip fraction are exactly
0 with one optimizer step per rollout) and is left out; a panel left with no series is not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from loongsage.core.tracking import read_metrics

PANELS: dict[str, Callable[[str], bool]] = {
    "reward": lambda k: k == "rollout/reward_mean" or (k.startswith("rollout_per_ds/") and k.endswith("/reward_mean")),
    "accuracy": lambda k: k.startswith("eval/") and (k.endswith("/accuracy") or "/pass@" in k),
    "policy": lambda k: k in ("train/entropy", "train/clipfrac", "train/dual_clipfrac"),
    "kl": lambda k: k in ("train/kl", "train/ppo_kl", "train/mopd_kl"),
    "consistency": lambda k: k in ("train/is_approx_k3_kl", "train/is_logprob_abs_diff"),
    "response_length": lambda k: (
        k == "rollout/response_length_mean" or (k.startswith("eval/") and k.endswith("/response_length"))
    ),
    "timing": lambda k: k.startswith("timing/"),
}
TITLES = {
    "policy": "policy: entropy, clip fraction",
    "kl": "KL: to the reference (drift), PPO step, teachers",
    "consistency": "trainer vs engine (k3 KL, mean |log-ratio|)",
}


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _informative(rows: list[dict], key: str) -> bool:
    """At least one finite, non-zero value."""
    return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and r[key] != 0 for r in rows)


def panel_series(rows: list[dict]) -> dict[str, list[str]]:
    """The keys each panel plots: the matching ones that are present and not zero throughout.

    Panels with nothing to plot are left out.
    """
    keys = sorted({k for r in rows for k in r if k != "step"})
    chosen = {panel: [k for k in keys if wanted(k) and _informative(rows, k)] for panel, wanted in PANELS.items()}
    return {panel: ks for panel, ks in chosen.items() if ks}


def write_report(run_dir: str | Path) -> list[Path]:
    """Write one PNG per non-empty panel (and an overview) into ``<run_dir>/report``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    panels = panel_series(rows)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    count = max(1, len(panels))
    fig_all, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.4), squeeze=False)
    for ax_all, (panel, chosen) in zip(axes[0], panels.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in (ax, ax_all):
            for key in chosen:
                xs, ys = _series(rows, key)
                target.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
            target.set_title(TITLES.get(panel, panel.replace("_", " ")), fontsize=9)
            target.set_xlabel("step")
            target.grid(alpha=0.3)
            target.legend(fontsize=7)
            if panel == "consistency":
                # spans many decades (1e-13 for matching fp32 numerics, 1e-3 for bf16 engines)
                target.set_yscale("log", nonpositive="mask")
            elif panel == "kl":
                target.set_yscale("symlog", linthresh=1e-6)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig_all.suptitle(run_dir.name)
    fig_all.tight_layout()
    overview = out_dir / "overview.png"
    fig_all.savefig(overview, dpi=100)
    plt.close(fig_all)
    return [overview, *written]
