"""An engine actor killed (SIGKILL) in the middle of a rollout, through the real launcher and Ray (in
this process, so that the test sees when the run waits on its engine): the run notices, starts a
replacement in the engine's bundle with the current weights, sends the lost requests again with
their seeds, and finishes having trained exactly the prompts of an undisturbed run, none twice."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from loongsage.core.cli import main
from loongsage.core.rollout import EngineRouter
from tests.e2e._runs import STEPS, SYNC, WINDOWED, audited


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _rows(run_dir / "metrics.jsonl") if "train/loss" in r}


def _trained(run_dir: Path) -> list[tuple[str, int]]:
    last = {row["step"]: row for row in _rows(run_dir / "batches.jsonl")}
    assert sorted(last) == list(range(1, STEPS + 1))
    return sorted((g["source"], g["index"]) for row in last.values() for g in row["groups"])


def _engine_processes() -> set[int]:
    """Live engine actor processes below this one (the workers of its own Ray)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            table[int(name)] = (int(fields[1]), fields[0])
    below, todo = set(), [os.getpid()]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid not in below]
        below.update(children)
        todo.extend(children)
    return {pid for pid in below if table[pid][1] != "Z" and _title(pid).startswith("ray::EngineWorker")}


def _title(pid: int) -> str:
    """A Ray worker's process title: ``ray::<class>.<method>`` while it runs that method."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _held() -> int:
    """Requests this process's engine routers (the running run's) are waiting on engines for."""
    return sum(sum(router.in_flight) for router in gc.get_objects() if type(router) is EngineRouter)


class _Killer(threading.Thread):
    """Once ``run_dir`` has trained a step, SIGKILL the run's engine in the middle of a rollout: when
    its title names ``generate_stream`` it is frozen (SIGSTOP), and killed if the run still waits on
    requests half a second later (so they are lost with it), else let go on (the stream had just
    ended)."""

    def __init__(self, run_dir: Path, before: set[int]):
        super().__init__(daemon=True)
        self.run_dir, self.before = run_dir, before
        self.killed: tuple[int, int] | None = None  # (pid, last step logged before the kill)
        self.stop = threading.Event()

    def run(self) -> None:
        engines: set[int] = set()
        while not self.stop.is_set() and not (engines and _steps(self.run_dir)):
            engines = _engine_processes() - self.before
            time.sleep(0.01)
        if self.stop.is_set():
            return
        (pid,) = engines
        while not self.stop.is_set():
            if _title(pid) == "ray::EngineWorker.generate_stream":
                os.kill(pid, signal.SIGSTOP)
                held = _held()
                time.sleep(0.5)
                if held and _held() == held:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = (pid, max(_steps(self.run_dir)))
                    return
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.001)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
# synchronously, that the lost requests sampled again with their seeds give the very tokens of an
# undisturbed round is tests/core/test_router.py's test_a_lost_engine_is_replaced_and_its_requests_sampled_again
# (engines killed and frozen); the replacement's start and weights through the launcher are checked here
@pytest.mark.parametrize("scheduler", [pytest.param(SYNC, marks=pytest.mark.slow), WINDOWED])
def test_an_engine_killed_mid_rollout_is_replaced_and_the_run_trains_the_same_prompts(launched, in_tmp, scheduler):
    uninterrupted = launched(audited("whole", scheduler)) / "runs" / "whole"  # same seed, same words
    before = _engine_processes()
    killer = _Killer(in_tmp / "runs" / "killed", before)
    killer.start()
    try:
        assert main(audited("killed", scheduler)) == 0
    finally:
        killer.stop.set()
        killer.join()
    assert killer.killed is not None, "the engine was never seen generating"
    pid, step = killer.killed
    assert step < STEPS  # killed while the run still had steps to train
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    whole, killed = _steps(uninterrupted), _steps(in_tmp / "runs" / "killed")
    assert sorted(killed) == list(range(1, STEPS + 1))
    assert sum(r["rollout/engine_restarts"] for r in killed.values()) == 1
    assert sum(r["rollout/requests_redispatched"] for r in killed.values()) >= 1
    assert [r["engine/version"] for r in killed.values()] == [float(s) for s in range(1, STEPS + 1)]
    trained = _trained(in_tmp / "runs" / "killed")
    assert len(trained) == STEPS * 4 and max(Counter(trained).values()) == 1  # no prompt trained twice
    assert trained == _trained(uninterrupted)  # ... or lost
    if scheduler == SYNC:
        # the lost requests were sampled again on the same weights with the same seeds: every step
        # trained the same samples, so it scored and learned the same
        for s in range(1, STEPS + 1):
            for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm"):
                assert killed[s][key] == whole[s][key], (s, key)
