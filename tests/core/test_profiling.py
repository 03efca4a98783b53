"""The actors' side of ``run.profile_steps`` (loongsage.core.profiling), in-process: what a profile
records and how its trace is written. The launcher run is tests/e2e/test_profile_tiny.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from pathlib import Path

import torch

from loongsage.core.config import Config, RunConfig
from loongsage.core.profiling import AsyncProfiledActor, ProfiledActor, trace_dir, trace_name


def _ops(path: Path) -> set[str]:
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    return {e.get("name", "") for e in trace["traceEvents"] if e.get("ph") == "X"}


def _matmul() -> None:
    a = torch.randn(32, 32)
    (a @ a).sum()


def test_a_trace_holds_the_work_of_every_thread_between_start_and_stop(tmp_path) -> None:
    actor = ProfiledActor()
    assert actor.stop_profile(str(tmp_path / "none.trace.json.gz")) is None  # never started: nothing written
    torch.zeros(2).sub_(1)  # before the start: not in the trace
    actor.start_profile()
    actor.start_profile()  # a profile left running (a step that failed) is replaced, not an error
    worker = threading.Thread(target=_matmul)  # an actor serves calls on threads other than the caller's
    worker.start()
    worker.join()
    torch.ones(3).add_(1)
    path = tmp_path / "profile" / trace_name(3, "trainer", 1)
    assert actor.stop_profile(str(path)) == str(path)
    assert path.name == "step3.trainer.1.trace.json.gz"
    ops = _ops(path)
    assert {"aten::mm", "aten::add_"} <= ops and "aten::sub_" not in ops
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no partial file left beside it
    assert actor.stop_profile(str(path)) is None  # stopped once


def test_an_asynchronous_actor_writes_while_its_loop_serves(tmp_path) -> None:
    actor = AsyncProfiledActor()
    path = tmp_path / trace_name(1, "engine", 0)

    async def step() -> str | None:
        actor.start_profile()
        await asyncio.to_thread(_matmul)
        _matmul()
        return await actor.stop_profile(str(path))

    assert asyncio.run(step()) == str(path)
    assert "aten::mm" in _ops(path)


def test_the_traces_go_under_the_run_folder_unless_profile_dir_says_otherwise(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = Config(run=RunConfig(name="r", output_dir="out", profile_steps=[1]))
    assert trace_dir(cfg) == tmp_path / "out" / "r" / "profile"  # absolute: actors run elsewhere
    cfg = Config(run=RunConfig(profile_dir="traces"))
    assert trace_dir(cfg) == tmp_path / "traces"
