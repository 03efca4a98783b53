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
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongsage.core.failures import RunError, disk_full, free_space
from loongsage.core.types import ConfigError

if TYPE_CHECKING:
    from loongsage.core.roles import CriticGroup, TrainerGroup

log = logging.getLogger("loongsage")


class CheckpointError(RunError):
    """A checkpoint that cannot be resumed from; the message names it and what to do instead."""

    resumable = False


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    found = sorted(p for p in checkpoint_dir(run_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    return found[-1] if found else None


def save(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    trainer: TrainerGroup,
    critic: CriticGroup,
    keep_last: int,
    rollout: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step``: every trainer rank's state (and the critic's), as
    ``controller.json`` the step with ``state`` (the weight version and the rollout service's data
    position) and, when given, ``rollout`` (the asynchronous rollout's buffers and groups in flight)
    as ``rollout.pt``. Both are taken on the event loop that runs the service (this runs in a worker
    thread, while the run goes on). Keeps the newest ``keep_last`` checkpoints (0: all)."""
    import torch

    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _wait_all(trainer.save(str(tmp)), critic.save(str(tmp / "critic")))
        (tmp / "controller.json").write_text(json.dumps({"step": step, **state}, indent=1))
        if rollout is not None:
            torch.save(rollout, tmp / "rollout.pt")
    except Exception as exc:
        # the free space is read before the partial files go: it is what names a full disk
        free = free_space(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest(run_dir)
        kept = f"{previous} is intact" if previous is not None else "no earlier checkpoint exists"
        if disk_full(exc) is not None:
            raise RunError(
                f"no space left on device while writing checkpoint {final} ({free} on its file system; "
                f"the partial checkpoint was removed and {kept}); free some space there (or set "
                "run.output_dir elsewhere)"
            ) from exc
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    old = sorted(p for p in checkpoint_dir(run_dir).glob("step_*") if not p.name.endswith(".tmp"))
    for p in old[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    log.info("checkpoint: %s", final)
    return final


def restore(run_dir: Path, trainer: TrainerGroup, critic: CriticGroup) -> dict[str, Any] | None:
    """Load the latest checkpoint's state into the trainer ranks (and the critic); return what
    :func:`save` wrote as ``controller.json`` (step, version, rollout state), with ``rollout.pt``'s
    content as ``"rollout"`` when there is one, or None without a checkpoint."""
    import torch

    path = latest(run_dir)
    if path is None:
        log.warning("resume: no checkpoint under %s; starting from step 0", checkpoint_dir(run_dir))
        return None
    try:
        state = json.loads((path / "controller.json").read_text())
        if (path / "rollout.pt").exists():  # our own file: trajectories and records, not only tensors
            state["rollout"] = torch.load(path / "rollout.pt", weights_only=False)
        _wait_all(trainer.load(str(path)), critic.load(str(path / "critic")))
    except Exception as exc:
        if type(exc).__name__ in ("ActorDiedError", "RayActorError"):  # not the checkpoint's fault
            raise
        cause = getattr(exc, "cause", None) or exc  # a trainer rank's own error, not Ray's wrapper
        raise CheckpointError(
            f"resume: checkpoint {path} could not be loaded ({type(cause).__name__}: "
            f"{_first_line(cause)}); if the model or trainer settings differ from the run that wrote "
            f"it, resume with that run's; if the checkpoint is damaged, {_instead(run_dir, path)}"
        ) from exc
    log.info("resume: %s (step %d, version %d)", path, int(state["step"]), int(state["version"]))
    return state


def _wait_all(*pending: Any) -> None:
    """Wait for calls started together (the trainer ranks' and the critic's run concurrently)."""
    for calls in pending:
        calls.wait()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _instead(run_dir: Path, bad: Path) -> str:
    """What to do about the damaged checkpoint ``bad``: go back to the one before it, or start over."""
    earlier = sorted(
        p
        for p in checkpoint_dir(run_dir).glob("step_*")
        if p.is_dir() and not p.name.endswith(".tmp") and p.name < bad.name
    )
    if earlier:
        return f"delete {bad} to resume from {earlier[-1].name}, the checkpoint before it"
    return f"it is the only checkpoint: delete {bad} to start over from step 0 (resume=true), or use a new run.name"


def _damaged_file(path: Path) -> str | None:
    """Why a checkpoint file cannot be read back, or None. torch's files are zip archives whose
    directory sits at the end: a file cut short (a full disk, a copy stopped part-way) has lost it,
    which opening the archive finds without reading the tensors."""
    if path.stat().st_size == 0:
        return "empty"
    with path.open("rb") as fh:
        if fh.read(4) != b"PK\x03\x04":
            return None  # not torch's zip format: another writer's file, left to its reader
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as exc:
        return f"cut short ({exc})"


def check_resumable(run_dir: Path, source_names: list[str], total_steps: int) -> Path | None:
    """Before Ray starts: the checkpoint ``resume=true`` would continue from (None: there is none), after
    checking that it can be. Raises :class:`ConfigError` (one line) when its data sources are not
    the config's (the data position is per source), when it is at or past ``total_steps`` (there
    would be nothing to train), or when a file of it is damaged."""
    path = latest(run_dir)
    if path is None:
        return None
    try:
        state = json.loads((path / "controller.json").read_text())
        step, saved = int(state["step"]), sorted(state["mixer"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"resume: checkpoint {path} is damaged (controller.json: {type(exc).__name__}: "
            f"{_first_line(exc)}); {_instead(run_dir, path)}"
        ) from None
    for file in sorted(path.rglob("*.pt")):
        problem = _damaged_file(file)
        if problem is not None:
            raise ConfigError(
                f"resume: checkpoint {path} is damaged ({file.relative_to(path)}: {problem}); {_instead(run_dir, path)}"
            )
    if saved != sorted(source_names):
        missing = [n for n in saved if n not in source_names]
        extra = [n for n in source_names if n not in saved]
        what = "; ".join(
            part
            for part in (
                f"not in the config: {', '.join(missing)}" if missing else "",
                f"not in the checkpoint: {', '.join(extra)}" if extra else "",
            )
            if part
        )
        raise ConfigError(
            f"resume: checkpoint {path} was written by a run of the data sources [{', '.join(saved)}] "
            f"and the config has [{', '.join(sorted(source_names))}] ({what}); resume with the "
            "checkpoint's data_sources, or start a new run (another run.name)"
        )
    if step >= total_steps:
        raise ConfigError(
            f"resume: checkpoint {path} is at step {step} and run.total_steps={total_steps}, so there is "
            f"nothing left to train; set run.total_steps above {step} to train further"
        )
    return path


def export_final(run_dir: Path, trainer: TrainerGroup) -> Path:
    """The trained policy as an HF folder, ``<run_dir>/final`` (every rank takes part)."""
    out = Path(run_dir) / "final"
    trainer.export_hf(str(out))
    log.info("exported HF model: %s", out)
    return out
