"""Checkpoints: trainer state per rank plus the controller's exact data position, written atomically.

Layout: ``<run_dir>/checkpoints/step_000010/{trainer.pt, rng_rank<r>.pt, controller.json}``; the
trainer state is full (unsharded), so a run may resume under another DP size. A directory
is complete once it is renamed from its ``.tmp`` name, so a crash mid-save never leaves a checkpoint
that ``resume=true`` would pick up.
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


def save(ctl: Any, rollout_state: dict[str, Any]) -> Path:
    """Write the checkpoint of the step just finished; ``rollout_state`` is the rollout service's
    state, taken on the event loop that runs the service (this runs in a worker thread)."""
    import ray

    final = checkpoint_dir(ctl.run_dir) / f"step_{ctl.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray.get([t.save.remote(str(tmp)) for t in ctl.trainers]
            + ([ctl.critic.save.remote(str(tmp / "critic"))] if ctl.critic is not None else []))
    state = {"step": ctl.step, "version": ctl.version, **rollout_state}
    (tmp / "controller.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    keep = ctl.cfg.checkpoint.keep_last
    old = sorted(p for p in checkpoint_dir(ctl.run_dir).glob("step_*") if not p.name.endswith(".tmp"))
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    log.info("checkpoint: %s", final)
    return final


def restore(ctl: Any) -> int:
    """Load the latest checkpoint into the actors and the controller; return the step to start at."""
    import ray

    path = latest(ctl.run_dir)
    if path is None:
        log.warning("resume: no checkpoint under %s; starting from step 0", checkpoint_dir(ctl.run_dir))
        return 0
    state = json.loads((path / "controller.json").read_text())
    ray.get([t.load.remote(str(path)) for t in ctl.trainers]
            + ([ctl.critic.load.remote(str(path / "critic"))] if ctl.critic is not None else []))
    ctl.rollout.restore(state)
    ctl.step = int(state["step"])
    ctl._push_weights()
    ray.get([e.set_version.remote(int(state["version"])) for e in ctl.engines])
    ctl.version = int(state["version"])
    log.info("resume: %s (step %d, version %d)", path, ctl.step, ctl.version)
    return ctl.step


def export_final(ctl: Any) -> Path:
    import ray

    out = Path(ctl.run_dir) / "final"
    ray.get([t.export_hf.remote(str(out)) for t in ctl.trainers])
    log.info("exported HF model: %s", out)
    return out
