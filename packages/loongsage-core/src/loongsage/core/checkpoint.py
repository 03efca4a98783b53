"""Checkpoints: trainer state per rank plus the controller's exact data position, written atomically.

Layout: ``<run_dir>/checkpoints/step_000010/{trainer.pt, rng_rank<r>.pt, controller.json[, rollout.pt]}``;
the trainer state is full (unsharded), so a run may resume under another DP size. ``controller.json``
holds the step, the weight version and the rollout service's data position (per-source cursors, the
group counter, the batches consumed). An asynchronous run adds ``rollout.pt`` (``torch.save`` of
plain data and dataclasses): every source's buffer of finished groups, its groups in flight with the
engine calls they made (cut samples with their tokens and versions), its dispatch counter and the
records waiting to go again (see :mod:`loongsage.core.rollout.service`). Both are taken in the same
weight-update window, so they match the trainer state. A directory is complete once it is renamed
from its ``.tmp`` name, so a crash mid-save never leaves a checkpoint that ``resume=true`` would
pick up.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("loongsage")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    found = sorted(p for p in checkpoint_dir(run_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    return found[-1] if found else None


def save(run_dir: Path, step: int, state: dict[str, Any], trainers: list[Any], critic: Any | None,
         keep_last: int, rollout: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step``: every trainer rank's state (and the critic's), as
    ``controller.json`` the step with ``state`` (the weight version and the rollout service's data
    position) and, when given, ``rollout`` (the asynchronous rollout's buffers and groups in flight)
    as ``rollout.pt``. Both are taken on the event loop that runs the service (this runs in a worker
    thread, while the run goes on). Keeps the newest ``keep_last`` checkpoints (0: all)."""
    import ray
    import torch

    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray.get([t.save.remote(str(tmp)) for t in trainers]
            + ([critic.save.remote(str(tmp / "critic"))] if critic is not None else []))
    (tmp / "controller.json").write_text(json.dumps({"step": step, **state}, indent=1))
    if rollout is not None:
        torch.save(rollout, tmp / "rollout.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    old = sorted(p for p in checkpoint_dir(run_dir).glob("step_*") if not p.name.endswith(".tmp"))
    for p in old[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    log.info("checkpoint: %s", final)
    return final


def restore(run_dir: Path, trainers: list[Any], critic: Any | None) -> dict[str, Any] | None:
    """Load the latest checkpoint's state into the trainer ranks (and the critic); return what
    :func:`save` wrote as ``controller.json`` (step, version, rollout state), with ``rollout.pt``'s
    content as ``"rollout"`` when there is one, or None without a checkpoint."""
    import ray
    import torch

    path = latest(run_dir)
    if path is None:
        log.warning("resume: no checkpoint under %s; starting from step 0", checkpoint_dir(run_dir))
        return None
    state = json.loads((path / "controller.json").read_text())
    if (path / "rollout.pt").exists():  # our own file: trajectories and records, not only tensors
        state["rollout"] = torch.load(path / "rollout.pt", weights_only=False)
    ray.get([t.load.remote(str(path)) for t in trainers]
            + ([critic.load.remote(str(path / "critic"))] if critic is not None else []))
    log.info("resume: %s (step %d, version %d)", path, int(state["step"]), int(state["version"]))
    return state


def export_final(run_dir: Path, trainers: list[Any]) -> Path:
    """The trained policy as an HF folder, ``<run_dir>/final`` (every rank takes part)."""
    import ray

    out = Path(run_dir) / "final"
    ray.get([t.export_hf.remote(str(out)) for t in trainers])
    log.info("exported HF model: %s", out)
    return out
