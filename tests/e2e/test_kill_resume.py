"""kill -9 of the launcher mid-run, then ``resume=true``: no process of the killed run survives it,
and the resumed run trains exactly the prompts of an uninterrupted one, none twice.

The launcher is a real process killed with SIGKILL as soon as it starts training step 3: its
batch audit row is written before the step trains, so the kill lands after that step's training
began and (almost always) before its checkpoint. The resumed run then trains that step again from
the previous checkpoint; ``batches.jsonl`` keeps both rows and the last one counts. Asynchronously,
the checkpoint holds the rollout's buffer: the resumed run's first batch trains those very groups
(same ids, the tokens generated before the kill), not new samples of their prompts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main
from tests.e2e._runs import STEPS, SYNC, WINDOWED
from tests.e2e._runs import audited as audited_run

KILL_AT = 3


def _rows(path: Path) -> list[dict]:
    """Complete JSON lines of a file another process may be writing."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def _trained(run_dir: Path) -> list[tuple[str, int]]:
    """(source, record index) of every trained group, the last audit row of each step counting."""
    last = {row["step"]: row for row in _rows(run_dir / "batches.jsonl")}
    assert sorted(last) == list(range(1, STEPS + 1))
    return sorted((g["source"], g["index"]) for row in last.values() for g in row["groups"])


def _group_ids(run_dir: Path) -> dict[int, list[int]]:
    """step -> the group ids it trained (its last audit row)."""
    last = {row["step"]: row for row in _rows(run_dir / "batches.jsonl")}
    return {step: sorted(g["group_id"] for g in row["groups"]) for step, row in last.items()}


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, name) of every live process (Linux /proc; zombies left out)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), fields[19], cmdline or stat[stat.index("(") + 1 : stat.rindex(")")])
    return table


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, name) of every process below ``root``."""
    table = _processes()
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start, name) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = (start, name)
                todo.append(pid)
    return found


def _survivors(recorded: dict[int, tuple[str, str]]) -> list[str]:
    table = _processes()
    return [f"{pid} {name}" for pid, (start, name) in recorded.items() if pid in table and table[pid][1] == start]


def _wait_for(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float = 240.0, every: float = 0.002):
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s:\n{log.read_text()[-3000:]}"
        time.sleep(every)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
# synchronously, a kill -9 leaves nothing as it does here asynchronously, and a resume trains what
# the uninterrupted run trained bit for bit (test_resume_exact.py)
@pytest.mark.parametrize("scheduler", [WINDOWED, pytest.param(SYNC, marks=pytest.mark.slow)])
def test_a_launcher_killed_mid_run_leaves_nothing_and_resumes_the_same_prompts(launched, in_tmp, scheduler):
    uninterrupted = launched(audited_run("whole", scheduler)) / "runs" / "whole"  # same seed, same words

    run_dir, log = in_tmp / "runs" / "killed", in_tmp / "killed.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as from a shell
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loongsage.core.cli", *audited_run("killed", scheduler)],
            cwd=in_tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # every process of the run exists once it trains (Ray's head, its agents, the actors)
        _wait_for(
            "step 1", lambda: any(r["step"] >= 1 for r in _rows(run_dir / "metrics.jsonl")), proc, log, every=0.05
        )
        recorded = _descendants(proc.pid)
        _wait_for(
            f"step {KILL_AT}'s training",
            lambda: any(r["step"] >= KILL_AT for r in _rows(run_dir / "batches.jsonl")),
            proc,
            log,
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    names = " ".join(name for _, name in recorded.values())
    assert "raylet" in names and "gcs_server" in names and "ray::TrainerWorker" in names, names

    deadline = time.monotonic() + 15
    while _survivors(recorded) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _survivors(recorded), f"left running after the launcher was killed: {_survivors(recorded)}"

    audited = max(r["step"] for r in _rows(run_dir / "batches.jsonl"))
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_??????"))
    assert saved and saved[-1] < STEPS, (saved, log.read_text()[-2000:])
    assert audited >= KILL_AT and saved[-1] >= audited - 1

    assert main([*audited_run("killed", scheduler), "resume=true"]) == 0
    steps = {r["step"] for r in _rows(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert steps == set(range(1, STEPS + 1))
    whole, resumed = _trained(uninterrupted), _trained(run_dir)
    assert len(whole) == STEPS * 4 and max(Counter(whole).values()) == 1  # nothing trained twice
    assert resumed == whole
    # a step trained after the last checkpoint was trained again, on the same prompts
    rows = _rows(run_dir / "batches.jsonl")
    for step in range(saved[-1] + 1, audited + 1):
        again = [sorted((g["source"], g["index"]) for g in r["groups"]) for r in rows if r["step"] == step]
        assert len(again) == 2 and again[0] == again[1], step
    # every step trained the groups of the uninterrupted run, by id: nothing was sampled anew under
    # another id (seed) after the resume
    assert _group_ids(run_dir) == _group_ids(uninterrupted)

    checkpoint = run_dir / "checkpoints" / f"step_{saved[-1]:06d}"
    if scheduler == SYNC:  # nothing runs between synchronous steps: no rollout state to keep
        assert not (checkpoint / "rollout.pt").exists()
        return
    version = json.loads((checkpoint / "controller.json").read_text())["version"]
    rollout = torch.load(checkpoint / "rollout.pt", weights_only=False)["sources"]["arith"]
    buffered = {group[0].group_id: group for _, group in rollout["buffer"]}
    in_flight = {gid for _, gid, _ in rollout["in_flight"]}
    first = [r for r in rows if r["step"] == saved[-1] + 1][-1]["groups"]  # the resumed run's first batch
    assert {g["group_id"] for g in first} <= buffered.keys() | in_flight
    from_buffer = [g for g in first if g["group_id"] in buffered]
    assert from_buffer, (first, sorted(buffered))
    for g in from_buffer:  # trained with the tokens generated before the kill, by older policies
        oldest = min(v for t in buffered[g["group_id"]] for v in t.versions if v >= 0)
        assert g["staleness"] == version - oldest >= 1


def test_a_resumed_run_keeps_the_staleness_budget(ray_session, in_tmp):
    """``no_window`` dispatches while consumed + kept + running < (η + version + 1)·B: a resumed run
    continues the version numbering, so it must continue the consumed count too, or it dispatches
    (version)·B groups beyond the bound at once. After each batch at most η·B are left in flight or
    buffered, in the resumed steps as in the first ones."""
    eta, quota = 1, 4
    scheduler = f"{{name: no_window, params: {{max_staleness: {eta}}}}}"
    assert main(audited_run("budget", scheduler, 3)) == 0
    assert main([*audited_run("budget", scheduler, 5), "resume=true"]) == 0
    rows = [r for r in _rows(in_tmp / "runs" / "budget" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["engine/version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert max(r["rollout/in_flight"] + r["rollout/buffered"] for r in rows) <= eta * quota
    # and what was trained kept the bound, with generation running ahead of training
    assert all(r["rollout/groups_trained"] == quota and 0 <= r["rollout/staleness_max"] <= eta for r in rows)
    assert max(r["rollout/staleness_max"] for r in rows[1:]) >= 1
