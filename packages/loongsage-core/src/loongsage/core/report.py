"""``loongsage report <run>``: PNG plots of a run's metrics (reward, accuracy, KL, length, timings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loongsage.core.tracking import read_metrics

PANELS: dict[str, Callable[[str], bool]] = {
    "reward": lambda k: k == "rollout/reward_mean" or (k.startswith("rollout_per_ds/") and k.endswith("/reward_mean")),
    "accuracy": lambda k: k.startswith("eval/") and (k.endswith("/accuracy") or "/pass@" in k),
    "kl": lambda k: k in ("train/is_approx_k3_kl", "train/kl", "train/ppo_kl"),
    "response_length": lambda k: k == "rollout/response_length_mean" or (k.startswith("eval/") and k.endswith("/response_length")),
    "timing": lambda k: k.startswith("timing/"),
}


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(run_dir: str | Path) -> list[Path]:
    """Write one PNG per panel (and an overview) into ``<run_dir>/report``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    keys = sorted({k for r in rows for k in r if k != "step"})
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax_all, (panel, wanted) in zip(axes, PANELS.items()):
        chosen = [k for k in keys if wanted(k)]
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in (ax, ax_all):
            for key in chosen:
                xs, ys = _series(rows, key)
                target.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
            target.set_title(panel.replace("_", " "))
            target.set_xlabel("step")
            target.grid(alpha=0.3)
            if chosen:
                target.legend(fontsize=7)
        if panel == "kl":
            ax.set_yscale("symlog", linthresh=1e-6)
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
