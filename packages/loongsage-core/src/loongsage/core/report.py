"""``loongsage report <run>``: PNG plots of a run's metrics, one per panel and an overview grid.

Panels: reward (the run's and each source's), held-out accuracy and pass@k, loss, gradient norm,
learning rate, the policy (entropy, PPO clip fraction), KL (drift from the reference, the PPO step,
MOPD teachers), train-inference consistency (k3 KL, mean |log-ratio|), staleness, partial and
truncated rollouts, response length, timings. A series that is absent or zero at every step says
nothing (PPO's KL and clip fraction are exactly 0 with one optimizer step per rollout) and is left
out; a panel left with no series is not drawn. Each title names the series it shows.

Evaluations run every few steps: their series are drawn as points where they were measured (joined
by a thin dashed line), never as a line implying values in between. Steps where a lost engine was
replaced (``rollout/engine_restarts``) are marked by a vertical line on every panel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loongsage.core.tracking import read_metrics


@dataclass(frozen=True)
class Panel:
    """One plot: which keys it takes, its name in titles, and its y scale."""

    title: str
    wants: Callable[[str], bool]
    scale: str = "linear"  # "log" for values over decades, "symlog" for ones that start at 0
    zero_says_something: bool = False  # a reward or an accuracy of 0 is a result, a clip fraction of 0 is not


def _per_source(key: str, stat: str) -> bool:
    return key.startswith("rollout_per_ds/") and key.endswith(f"/{stat}")


PANELS: dict[str, Panel] = {
    "reward": Panel("reward", lambda k: k == "rollout/reward_mean" or _per_source(k, "reward_mean"), "linear", True),
    "accuracy": Panel(
        "held out", lambda k: k.startswith("eval/") and (k.endswith("/accuracy") or "/pass@" in k), "linear", True
    ),
    "loss": Panel("loss", lambda k: k in ("train/loss", "train/pg_loss", "train/value_loss", "train/gkd")),
    "grad_norm": Panel("gradient norm", lambda k: k == "train/grad_norm"),
    "lr": Panel("learning rate", lambda k: k == "train/lr"),
    "policy": Panel("policy", lambda k: k in ("train/entropy", "train/clipfrac", "train/dual_clipfrac")),
    "kl": Panel("KL", lambda k: k in ("train/kl", "train/ppo_kl", "train/mopd_kl"), "symlog"),
    # spans many decades (1e-13 for matching fp32 numerics, 1e-3 for bf16 engines)
    "consistency": Panel(
        "trainer vs engine", lambda k: k in ("train/is_approx_k3_kl", "train/is_logprob_abs_diff"), "log"
    ),
    "staleness": Panel(
        "staleness (policy versions)", lambda k: k in ("rollout/staleness_mean", "rollout/staleness_max")
    ),
    "partial": Panel("rollouts cut", lambda k: k in ("rollout/partial_frac", "rollout/truncated_frac")),
    "response_length": Panel(
        "response length",
        lambda k: (
            k == "rollout/response_length_mean"
            or _per_source(k, "response_length_mean")
            or (k.startswith("eval/") and k.endswith("/response_length"))
        ),
    ),
    "timing": Panel("seconds per step", lambda k: k.startswith("timing/")),
}
LABELS = {  # how a key reads in a legend and a title
    "rollout/reward_mean": "all sources",
    "rollout/response_length_mean": "all sources",
    "train/kl": "to reference",
    "train/ppo_kl": "PPO step",
    "train/mopd_kl": "to teachers",
    "train/is_approx_k3_kl": "k3 KL",
    "train/is_logprob_abs_diff": "mean |log-ratio|",
    "rollout/partial_frac": "partial (continued)",
    "rollout/truncated_frac": "truncated (max length)",
    "train/loss": "total",
    "train/pg_loss": "policy gradient",
    "train/value_loss": "value",
    "train/gkd": "distillation",
    "train/grad_norm": "gradient norm",
    "train/lr": "learning rate",
    "rollout/staleness_mean": "mean",
    "rollout/staleness_max": "max",
}
RESTARTS = "rollout/engine_restarts"
COLUMNS = 3


def label(key: str) -> str:
    """A key as a reader names it: ``rollout_per_ds/arith/reward_mean`` -> ``arith``."""
    if key in LABELS:
        return LABELS[key]
    parts = key.split("/")
    if parts[0] == "rollout_per_ds":
        return parts[1]
    if parts[0] == "eval":
        return f"{parts[1]} (held out)" if parts[-1] == "response_length" else f"{parts[1]} {parts[-1]}"
    if parts[0] == "timing":
        return parts[-1].removesuffix("_s").replace("_", " ")
    return parts[-1].replace("_", " ")


def title(panel: str, keys: list[str]) -> str:
    if len(keys) == 1 and label(keys[0]).replace(" ", "") in PANELS[panel].title.replace(" ", ""):
        return PANELS[panel].title  # "gradient norm", not "gradient norm: grad norm"
    if len(keys) > 4:  # the legend names them
        return f"{PANELS[panel].title} ({len(keys)} series)"
    return f"{PANELS[panel].title}: {', '.join(label(k) for k in keys)}"


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _informative(rows: list[dict], key: str, zero_says_something: bool = False) -> bool:
    """At least one finite value, non-zero unless zero says something."""
    return any(
        isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and (zero_says_something or r[key] != 0)
        for r in rows
    )


def panel_series(rows: list[dict]) -> dict[str, list[str]]:
    """The keys each panel plots: the matching ones that are present and not zero throughout.

    Panels with nothing to plot are left out.
    """
    keys = sorted({k for r in rows for k in r if k != "step"})
    if len({k.split("/")[1] for k in keys if k.startswith("rollout_per_ds/")}) < 2:  # one source: its series
        keys = [k for k in keys if not k.startswith("rollout_per_ds/")]  # are the run's, drawn once
    chosen = {
        name: [k for k in keys if panel.wants(k) and _informative(rows, k, panel.zero_says_something)]
        for name, panel in PANELS.items()
    }
    return {name: ks for name, ks in chosen.items() if ks}


def restart_steps(rows: list[dict]) -> list[int]:
    """Steps whose batch came after a lost engine was replaced (the metric counts them per batch)."""
    return [r["step"] for r in rows if isinstance(r.get(RESTARTS), (int, float)) and r[RESTARTS] > 0]


def _draw(ax, rows: list[dict], panel: str, keys: list[str], restarts: list[int]) -> None:  # noqa: ANN001
    from matplotlib.ticker import MaxNLocator

    steps = len(rows)
    for key in keys:
        xs, ys = _series(rows, key)
        sparse = key.startswith("eval/") or len(xs) < steps / 2  # measured at some steps only
        if sparse:
            ax.plot(xs, ys, linestyle=":", linewidth=0.8, marker="o", markersize=4, label=label(key))
        else:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label(key))
    for i, step in enumerate(restarts):
        ax.axvline(step, color="red", linestyle="--", linewidth=0.8, label="engine replaced" if i == 0 else None)
    ax.set_title(title(panel, keys), fontsize=9)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    scale = PANELS[panel].scale
    if scale == "log":
        ax.set_yscale("log", nonpositive="mask")
    elif scale == "symlog":
        ax.set_yscale("symlog", linthresh=1e-6)


def write_report(run_dir: str | Path) -> list[Path]:
    """Write one PNG per non-empty panel and an overview grid into ``<run_dir>/report``; return
    their paths, the overview first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    panels = panel_series(rows)
    restarts = restart_steps(rows)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    columns = min(COLUMNS, max(1, len(panels)))
    lines = max(1, math.ceil(len(panels) / columns))
    fig_all, axes = plt.subplots(lines, columns, figsize=(5.0 * columns, 3.6 * lines), squeeze=False)
    cells = [ax for line in axes for ax in line]
    for ax_all, (panel, keys) in zip(cells, panels.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in (ax, ax_all):
            _draw(target, rows, panel, keys, restarts)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for ax in cells[len(panels) :]:
        ax.set_visible(False)
    trained = max((r["step"] for r in rows), default=0)
    fig_all.suptitle(f"{run_dir.name}: {trained} steps", fontsize=11)
    fig_all.tight_layout()
    overview = out_dir / "overview.png"
    fig_all.savefig(overview, dpi=100)
    plt.close(fig_all)
    return [overview, *written]
