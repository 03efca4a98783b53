"""Metric trackers (a backend kind): every step's metrics go to each configured tracker.

``tracking.backends`` lists trackers, each a name (``jsonl``) or a spec with params
(``{name: wandb, params: {project: p}}``). A tracker factory gets, besides its params, the
framework's arguments it declares in ``receives`` (:class:`~loongsage.core.contracts.Tracker`), of
:data:`TRACKER_ARGS`: ``run_dir``, ``run_name``, ``config`` (the validated run config as a plain
dict) and ``resume`` (``checkpoint.resume``); a user may not set those. It may define
``preflight(params)``, called at config validation, which raises ``ValueError`` with a one-line
reason (a missing optional package, say).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from loongsage.core.contracts import Tracker, TrackerArg
from loongsage.core.failures import RunError
from loongsage.core.types import ConfigError

# What the framework can hand a tracker's factory: a tracker receives those it declares.
TRACKER_ARGS: tuple[str, ...] = get_args(TrackerArg)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class JsonlTracker(Tracker):
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (what ``loongsage report`` reads)."""

    kind = "tracker"
    receives: ClassVar[tuple[TrackerArg, ...]] = ("run_dir",)

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
class TensorboardTracker(Tracker):
    """Scalars to ``<run_dir>/tensorboard``."""

    kind = "tracker"
    receives: ClassVar[tuple[TrackerArg, ...]] = ("run_dir",)

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


WANDB_MISSING = "the wandb tracker needs the wandb package: pip install 'loongsage-core[wandb]'"
WANDB_RUN_ID_FILE = "wandb_run_id"


@dataclass
class WandbTracker(Tracker):
    """Weights & Biases: the run config once, then every step's finite scalars with ``step`` as the
    W&B step.

    The W&B run id is kept in ``<run_dir>/wandb_run_id``; a resumed run (``resume=true``) attaches
    to that id, so its steps continue the same W&B run. W&B's files go to ``<run_dir>/wandb/``
    unless ``WANDB_DIR`` is set. ``mode`` defaults to ``WANDB_MODE`` when set, else ``online``;
    ``offline`` needs no account and no network (``wandb sync`` uploads the run later).
    """

    kind = "tracker"
    receives: ClassVar[tuple[TrackerArg, ...]] = ("run_dir", "run_name", "config", "resume")

    run_dir: str
    run_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    project: str | None = None  # default: WANDB_PROJECT, else "loongsage"
    entity: str | None = None  # default: WANDB_ENTITY, else the account's default entity
    mode: Literal["online", "offline", "disabled"] | None = None  # default: WANDB_MODE, else online
    name: str | None = None  # default: run.name
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    @classmethod
    def preflight(cls, params: dict[str, Any]) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise ValueError(WANDB_MISSING)

    def __post_init__(self) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"{WANDB_MISSING} ({exc})") from None

        run_dir = Path(self.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if self.resume and id_file.is_file() else ""
        resumed = bool(run_id)
        if not resumed:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self._run = wandb.init(
                project=self.project or os.environ.get("WANDB_PROJECT") or "loongsage",
                entity=self.entity,
                name=self.name or self.run_name or None,
                group=self.group,
                tags=self.tags or None,
                mode=self.mode,
                id=run_id,
                resume="allow" if resumed else None,
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                config=self.config,
            )
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise RunError(
                f"wandb tracker: wandb.init failed: {type(exc).__name__}: {first} (log in with `wandb login` "
                "or set WANDB_API_KEY; to log without an account or network, use mode offline: "
                "WANDB_MODE=offline)"
            ) from exc
        id_file.write_text(run_id + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {k: v for k, v in metrics.items() if _finite(v)}
        if row:
            self._run.log(row, step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()


def tracker_spec(entry: Any) -> dict[str, Any]:
    """One ``tracking.backends`` entry as a ``{name, params}`` spec (a bare name has no params)."""
    return {"name": entry} if isinstance(entry, str) else entry


def check_trackers(registry: Any, backends: list[Any]) -> None:
    """Config validation: every entry names a known tracker, its params fit (the framework's
    arguments it does not receive are no params of the user's either), its preflight passes."""
    for j, entry in enumerate(backends):
        path = f"tracking.backends[{j}]"
        spec = tracker_spec(entry)
        params = registry.check("tracker", spec, path, skip=TRACKER_ARGS)
        tracker = registry.entry("tracker", spec["name"], path)
        # a factory needing an argument it does not declare is refused here, not when the run starts
        registry.check("tracker", spec, path, skip=tracker.factory.receives)
        preflight = tracker.preflight
        if preflight is not None:
            try:
                preflight(params)
            except ValueError as exc:
                raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None


def create_trackers(registry: Any, cfg: Any, run_dir: Path) -> list[Any]:
    """Build the trackers of ``cfg.tracking.backends`` for the run in ``run_dir``."""
    available = {
        "run_dir": str(run_dir),
        "run_name": cfg.run.name,
        "config": cfg.to_dict(),
        "resume": cfg.checkpoint.resume,
    }
    trackers: list[Any] = []
    try:
        for j, entry in enumerate(cfg.tracking.backends):
            path = f"tracking.backends[{j}]"
            spec = tracker_spec(entry)
            receives = registry.entry("tracker", spec["name"], path).factory.receives
            trackers.append(registry.create("tracker", spec, path, **{arg: available[arg] for arg in receives}))
    except BaseException:
        for tracker in trackers:  # the ones already open (a file, a W&B run) are closed, not leaked
            tracker.close()
        raise
    return trackers


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
