"""Kernel-level profiles of chosen steps (``run.profile_steps``): a ``torch.profiler`` trace per actor.

The controller brackets each listed step exactly where its ``timing/step_s`` is measured: before the
rollout it asks every role's actors to start profiling (:meth:`StepProfiles.start`), and once the
weight push is done to stop and write (:meth:`StepProfiles.stop`), so a trace holds that step's
work of that actor and the writing counts in none of the step's timings. Each actor writes
``step<N>.<role>.<rank>.trace.json.gz``, a gzipped Chrome trace (``chrome://tracing``, Perfetto),
CPU ops and, on a GPU, the CUDA kernels. With no step listed nothing here runs.

Actors serve calls on different threads (a trainer rank on its main thread, an engine on its event
loop, the autograd engine on its own): the profiler records every thread of the process where torch
can (``profile_all_threads``), else the caller's thread and those torch hands its state to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loongsage.core.config import Config
    from loongsage.core.worker_group import WorkerGroup

log = logging.getLogger("loongsage")

START_TIMEOUT_S = 120.0  # an actor that does not answer this soon is left unprofiled (a hung engine)
STOP_TIMEOUT_S = 600.0  # writing a large GPU trace takes seconds; this bounds a hung actor's wait


def trace_dir(cfg: Config) -> Path:
    """Where the traces go: ``run.profile_dir``, else ``<run dir>/profile``; absolute, because the
    actors may run in another working directory."""
    return Path(cfg.run.profile_dir or cfg.run_dir / "profile").resolve()


def trace_name(step: int, role: str, rank: int) -> str:
    return f"step{step}.{role}.{rank}.trace.json.gz"


# ----------------------------------------------------------------------------- the actors' side
def _start_profiler() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    try:  # every thread of the process; trace_only: no Python event objects built at stop (seconds)
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True, trace_only=True)
    except (ImportError, TypeError):  # an older torch: the calling thread (and what inherits its state)
        config = None
    profiler = profile(activities=activities, experimental_config=config)
    profiler.start()
    return profiler


def _stop_profiler(profiler: Any) -> Any:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the kernels launched in the step finish inside the trace
    profiler.stop()
    return profiler


def write_trace(profiler: Any, path: str) -> str:
    """Write a stopped profile to ``path`` (gzipped: the name ends in ``.gz``), through a temporary
    name, so that an interrupted write leaves no truncated trace under the final name."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name[: -len('.gz')]}.partial.gz")
    profiler.export_chrome_trace(str(partial))
    os.replace(partial, target)
    return str(target)


class _Profiling:
    """The profile an actor runs between ``start_profile`` and ``stop_profile`` (at most one)."""

    _step_profile: Any = None

    def start_profile(self) -> None:
        """Start recording (a profile still running from a step that failed is dropped)."""
        if self._step_profile is not None:
            self._step_profile.stop()
        self._step_profile = _start_profiler()

    def _take_profile(self) -> Any:
        profiler, self._step_profile = self._step_profile, None
        return None if profiler is None else _stop_profiler(profiler)


class ProfiledActor(_Profiling):
    """Mixin of an actor whose calls run one at a time (a trainer rank, the critic, a teacher)."""

    def stop_profile(self, path: str) -> str | None:
        """Stop recording and write the trace to ``path``; returns it, or None when nothing was
        recorded (an engine that replaced a lost one during the step)."""
        profiler = self._take_profile()
        return None if profiler is None else write_trace(profiler, path)


class AsyncProfiledActor(_Profiling):
    """Mixin of an asynchronous actor (an engine, the reward worker): its event loop goes on serving
    while the trace is written (an asynchronous rollout keeps generating meanwhile). The profile
    stops on the loop's thread, where it started."""

    async def stop_profile(self, path: str) -> str | None:
        profiler = self._take_profile()
        return None if profiler is None else await asyncio.to_thread(write_trace, profiler, path)


# ----------------------------------------------------------------------------- the controller's side
class StepProfiles:
    """The steps to profile and the role groups whose actors record them.

    Best effort: an actor that fails or does not answer (an engine lost in the step) costs its own
    trace and a warning, never the run.
    """

    def __init__(self, steps: Sequence[int], directory: Path, groups: Sequence[WorkerGroup]):
        self.steps, self.directory, self.groups = frozenset(steps), directory, list(groups)

    def __contains__(self, step: int) -> bool:
        return step in self.steps

    def start(self, step: int) -> None:
        calls = [(f"{g.role} {r}", ref) for g in self.groups for r, ref in enumerate(g.call_async("start_profile"))]
        _wait(calls, START_TIMEOUT_S, f"step {step}: could not start profiling")

    def stop(self, step: int) -> list[Path]:
        """Stop every actor's profile and write it; returns the traces written (logged)."""
        from loongsage.core.worker_group import per_rank

        start = time.perf_counter()
        calls = []
        for g in self.groups:
            paths = [str(self.directory / trace_name(step, g.role, r)) for r in range(len(g))]
            calls += [(f"{g.role} {r}", ref) for r, ref in enumerate(g.call_async("stop_profile", per_rank(paths)))]
        written = [Path(p) for p in _wait(calls, STOP_TIMEOUT_S, f"step {step}: no profile trace") if p]
        log.info(
            "step %d: %d profile traces in %s (written in %.1f s): %s",
            step,
            len(written),
            self.directory,
            time.perf_counter() - start,
            " ".join(p.name for p in written),
        )
        return written


def _wait(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
    """The answers of ``calls`` (``(who, ObjectRef)``) that came within ``timeout_s``; a failure or
    silence is logged as ``what`` for whom it concerns."""
    import ray

    refs = [ref for _, ref in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    done = set(ready)
    answers = []
    for who, ref in calls:
        if ref not in done:
            log.warning("%s from %s: no answer within %g s", what, who, timeout_s)
            continue
        try:
            answers.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - profiling never fails the run
            log.warning("%s from %s: %s: %s", what, who, type(exc).__name__, (str(exc).splitlines() or [""])[0][:300])
    return answers
