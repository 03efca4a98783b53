"""Metric trackers (a backend kind): every step's metrics go to each configured tracker."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class JsonlTracker:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (what ``loongsage report`` reads)."""

    kind = "tracker"

    run_dir: str

    def __post_init__(self) -> None:
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        self._fh = open(Path(self.run_dir) / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if _finite(v)}}
        self._fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._fh.close()


@dataclass
class TensorboardTracker:
    """Scalars to ``<run_dir>/tensorboard``."""

    kind = "tracker"

    run_dir: str

    def __post_init__(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(Path(self.run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if _finite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in this run directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A resumed run appends; keep the last row written for each (step, key).
    merged: dict[int, dict[str, float]] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update(row)
    return [merged[s] for s in sorted(merged)]
