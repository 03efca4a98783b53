"""A progress bar per step with the few numbers a user watches."""

from __future__ import annotations

import sys
from typing import Any


class StepProgress:
    KEYS = (("rollout/reward_mean", "reward"), ("train/is_approx_k3_kl", "k3"), ("timing/step_s", "s/step"))

    def __init__(self, total: int, start: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, leave=True
            )

    def update(self, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        post = {short: f"{metrics[key]:.3g}" for key, short in self.KEYS if key in metrics}
        acc = [v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/accuracy")]
        if acc:
            post["eval_acc"] = f"{sum(acc) / len(acc):.3f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
