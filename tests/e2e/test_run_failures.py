"""Runs that stop, through the real launcher: each ends in one ``loongsage: error:`` line saying what
happened and what to do, the traceback in ``runs/<name>/run.log``, no process of the run left, the
checkpoints whole and resumable.

Each launch is a real ``loongsage`` process with its own Ray (tens of seconds on a small machine),
so one run carries several cases: a run stopped by SIGTERM is then refused the ways a resume can
be wrong (checked in-process: no Ray starts for them) before it resumes and is stopped by SIGINT;
a run whose reward raises is resumed and loses its trainer actor; a run on a small tmpfs fills it,
finds it full, then read-only, and resumes once there is room.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongsage.core.checkpoint import check_resumable
from loongsage.core.cli import main
from tests._procs import TAG_VARIABLE, lasting, process_name, survivors
from tests.e2e._runs import SMALL

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, sends signals")

COMMON = (
    *SMALL,
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=0",
)
RESUME_HINT = "run the same command with resume=true to continue from runs/{name}/checkpoints/step_(\\d{{6}})"


def _train(name: str, *extra: str) -> list[str]:
    return ["train", "tiny/grpo_arith_cpu", f"run.name={name}", *COMMON, *extra]


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "loongsage"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "loongsage.core.cli"]


def _rows(path: Path) -> list[dict]:
    """Complete JSON lines of a file another process may be writing."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line] if path.exists() else []


def _trained(run_dir: Path) -> list[int]:
    return sorted({r["step"] for r in _rows(run_dir / "metrics.jsonl") if "train/loss" in r})


def _checkpoints(run_dir: Path) -> list[int]:
    """The complete checkpoints' steps (a ``.tmp`` folder is one being written)."""
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_??????"))


class Launch:
    """A launcher process of its own session (so that a signal can go to its whole process group,
    as a terminal's Ctrl-C does), its environment marked with the test's tag."""

    def __init__(self, cwd: Path, tag: str, argv: list[str], **env: str):
        self.stderr = cwd / f"launch_{time.monotonic_ns()}.err"
        environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as from a shell
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [*_launcher(), *argv],
                cwd=cwd,
                env={**environ, TAG_VARIABLE: tag, **env},
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )

    def wait_for(self, what: str, ready, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, (
                f"the launcher exited ({self.proc.returncode}) before {what}:\n{self.stderr.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
            time.sleep(0.2)

    def finish(self, timeout: float = 300.0) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return rc, self.stderr.read_text()


def _one_line(stderr: str) -> str:
    """The launcher's error line: the last line of stderr and its only error; no traceback above it,
    only the launcher's own lines (and Ray's start-up notices)."""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("loongsage: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert "Traceback" not in stderr and not any(line.startswith("  File ") for line in lines), stderr
    for line in lines[:-1]:
        assert line.startswith("[loongsage] ") or re.match(r"\d{4}-\d\d-\d\d [\d:,]+\s+(INFO|WARNING) ", line), stderr
    return errors[0]


def _nothing_left(tag: str, run_dir: Path) -> None:
    left = lasting(tag)
    assert not left, f"left running: {left}"
    assert not list((run_dir / "checkpoints").glob("*.tmp")), "a checkpoint left half written"


def _refused(capsys, argv: list[str]) -> str:
    """``argv`` through the launcher in this process: refused in one line, before Ray or any file."""
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out.err
    return out.err.removeprefix("loongsage: error: ").rstrip("\n")


def test_sigterm_and_sigint_stop_a_run_in_one_line_and_a_wrong_resume_is_refused(model_cache, in_tmp, tag, capsys):
    run_dir = in_tmp / "runs" / "sig"
    first = Launch(in_tmp, tag, _train("sig", "run.total_steps=40"))
    first.wait_for("two checkpoints", lambda: len(_checkpoints(run_dir)) >= 2)
    os.kill(first.proc.pid, signal.SIGTERM)  # as a process manager stops a service
    rc, err = first.finish()
    line = _one_line(err)
    found = re.fullmatch(
        r"loongsage: error: stopped by SIGTERM after (\d+) of 40 steps; Ray was shut down; "
        + RESUME_HINT.format(name="sig"),
        line,
    )
    assert rc == 143 and found, (rc, err)
    saved = _checkpoints(run_dir)[-1]
    assert int(found[2]) == saved <= int(found[1])
    _nothing_left(tag, run_dir)
    log = (run_dir / "run.log").read_text()
    assert "Traceback" in log and "Stopped: SIGTERM" in log, log[-3000:]
    assert re.search(r"INFO loongsage: step 1: .*train/loss=", log)  # every step's metrics, in the run's log

    # a resume that cannot be right is refused before Ray starts, naming the checkpoint
    ckpt = f"runs/sig/checkpoints/step_{saved:06d}"
    files = sorted(in_tmp.rglob("*"))
    assert _refused(capsys, _train("sig", "run.total_steps=40")) == (
        f"run.name=sig: runs/sig already holds a run stopped after its checkpoint step_{saved:06d}; continue it with "
        "resume=true, give this run its own folder (another run.name=... or run.output_dir=...), or remove that folder"
    )
    assert _refused(capsys, _train("sig", "run.total_steps=2", "resume=true")) == (
        f"resume: checkpoint {ckpt} is at step {saved} and run.total_steps=2, so there is nothing left to train; set "
        f"run.total_steps above {saved} to train further"
    )
    assert _refused(capsys, _train("sig", "run.total_steps=40", "resume=true", "data_sources.0.name=sums")) == (
        f"resume: checkpoint {ckpt} was written by a run of the data sources [arith] and the config has [sums] (not in "
        "the config: arith; not in the checkpoint: sums); resume with the checkpoint's data_sources, or start a new "
        "run (another run.name)"
    )
    assert sorted(in_tmp.rglob("*")) == files
    shutil.copytree(run_dir, in_tmp / "runs" / "cut")  # a copy stopped part-way: its last trainer.pt cut short
    trainer = in_tmp / "runs" / "cut" / "checkpoints" / f"step_{saved:06d}" / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[: trainer.stat().st_size // 2])
    message = _refused(capsys, _train("cut", "run.total_steps=40", "resume=true"))
    assert message.startswith(
        f"resume: checkpoint runs/cut/checkpoints/step_{saved:06d} is damaged (trainer.pt: cut short ("
    ), message
    assert message.endswith(
        f"delete runs/cut/checkpoints/step_{saved:06d} to resume from step_{saved - 1:06d}, the checkpoint before it"
    )

    # the run resumes from its checkpoint; Ctrl-C (SIGINT to the terminal's process group) stops it
    second = Launch(in_tmp, tag, _train("sig", "run.total_steps=40", "resume=true"))
    # a checkpoint past the first, complete: a step's metrics are logged before its checkpoint is
    # written, so a signal right after the log would find the first checkpoint still the latest
    second.wait_for("a checkpoint past the first", lambda: any(s > saved for s in _checkpoints(run_dir)))
    os.killpg(second.proc.pid, signal.SIGINT)
    rc, err = second.finish()
    line = _one_line(err)
    found = re.fullmatch(
        r"loongsage: error: stopped by SIGINT after (\d+) of 40 steps; Ray was shut down; "
        + RESUME_HINT.format(name="sig"),
        line,
    )
    assert rc == 130 and found, (rc, err)
    assert int(found[1]) > saved and int(found[2]) == _checkpoints(run_dir)[-1] > saved
    _nothing_left(tag, run_dir)
    assert f"resume: {run_dir.resolve()}/checkpoints/step_{saved:06d}" in (run_dir / "run.log").read_text()
    assert check_resumable(run_dir, ["arith"], 40) == run_dir / "checkpoints" / f"step_{_checkpoints(run_dir)[-1]:06d}"


FLAKY = '''
"""A reward that raises once the policy has been updated (unless FLAKY_OFF is set)."""
import os

from loongsage.core.hookspecs import hookimpl


class Flaky:
    def __call__(self, trajectory, record):
        if max(trajectory.versions, default=0) >= 1 and not os.environ.get("FLAKY_OFF"):
            raise ValueError("flaky reward: cannot score a sample of version 1")
        return float(trajectory.response_text.strip() == str(record.label))


@hookimpl
def loongsage_rewards():
    return {"flaky": Flaky}
'''


def _trainer_pids(tag: str) -> list[int]:
    return [pid for pid in survivors(tag) if (process_name(pid) or "").startswith("ray::TrainerWorker")]


def test_a_raising_reward_and_a_dead_trainer_each_end_in_one_line_and_the_run_resumes(model_cache, in_tmp, tag):
    plugins = in_tmp / "plugins"
    plugins.mkdir()
    (plugins / "flaky_reward.py").write_text(FLAKY)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(plugins), os.environ.get("PYTHONPATH", "")) if p)}
    argv = _train("flaky", "run.total_steps=40", "plugins=[flaky_reward]", "data_sources.0.reward={name: flaky}")
    run_dir = in_tmp / "runs" / "flaky"

    # step 1 samples with version 0 and trains; step 2's samples are version 1: the reward raises
    rc, err = Launch(in_tmp, tag, argv, **env).finish(timeout=900)
    line = _one_line(err)
    assert rc == 1, err
    assert line.startswith("loongsage: error: the run failed after 1 of 40 steps: "), line
    assert "ValueError: flaky reward: cannot score a sample of version 1" in line and "(in the reward actor, " in line
    assert line.endswith(
        "; fix the cause, then run the same command with resume=true to continue from "
        "runs/flaky/checkpoints/step_000001; the traceback is in runs/flaky/run.log"
    ), line
    _nothing_left(tag, run_dir)
    log = (run_dir / "run.log").read_text()
    assert "Traceback" in log and "flaky reward: cannot score" in log and re.search(r"step 1: .*train/loss=", log)

    # fixed, it resumes from step 1; a trainer actor killed mid-run ends it in one line too
    resumed = Launch(in_tmp, tag, [*argv, "resume=true"], FLAKY_OFF="1", **env)
    # the metrics row of a step is written before its checkpoint: wait for both
    resumed.wait_for("step 2", lambda: 2 in _trained(run_dir) and 2 in _checkpoints(run_dir))
    (pid,) = _trainer_pids(tag)
    os.kill(pid, signal.SIGKILL)
    rc, err = resumed.finish()
    line = _one_line(err)
    found = re.fullmatch(
        rf"loongsage: error: the trainer actor \(pid {pid}\) died after (\d+) of 40 steps: its process "
        r"exited unexpectedly \(killed by a signal or the OOM killer, or crashed\); "
        + RESUME_HINT.format(name="flaky")
        + "; the traceback is in runs/flaky/run.log",
        line,
    )
    assert rc == 1 and found, (rc, err)
    assert int(found[2]) == _checkpoints(run_dir)[-1] >= 2
    _nothing_left(tag, run_dir)


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    return probe.returncode == 0


def test_a_full_or_read_only_disk_is_one_line_and_leaves_the_checkpoints_resumable(model_cache, in_tmp, tag):
    """On a tmpfs of 3000 KiB (in a mount namespace of its own): one checkpoint (1.8 MB) fits, the
    second does not; then the disk is full before the run writes anything, then read-only; then,
    with room again, the run resumes from the checkpoint the full disk left intact."""
    mnt = in_tmp / "mnt"
    mnt.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    result = in_tmp / "result.json"
    helper = Path(__file__).with_name("_full_disk.py")
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, TAG_VARIABLE: tag}
    proc = subprocess.run(
        [
            "unshare",
            "-rm",
            sys.executable,
            str(helper),
            str(mnt),
            str(result),
            "3000",
            json.dumps(_launcher()),
            json.dumps([*COMMON, "run.total_steps=3"]),
        ],
        cwd=in_tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    disk = f"{mnt}/disk"

    fills = out["fills"]
    line = _one_line(fills["stderr"])
    assert fills["rc"] == 1, fills
    assert re.fullmatch(
        rf"loongsage: error: no space left on device while writing checkpoint {disk}/checkpoints/"
        r"step_000002 \([\d.]+ \w+ free on its file system; the partial checkpoint was removed and "
        rf"{disk}/checkpoints/step_000001 is intact\); free some space there \(or set run.output_dir "
        rf"elsewhere\); then run the same command with resume=true to continue from {disk}/checkpoints/"
        rf"step_000001; the traceback is in {disk}/run.log",
        line,
    ), line
    assert "disk/checkpoints/step_000001/trainer.pt" in fills["files"]
    assert not [f for f in fills["files"] if "step_000002" in f], fills["files"]  # no half checkpoint
    assert "Traceback" in fills["run_log"] and "unexpected pos" in fills["run_log"]

    full = out["full"]
    line = _one_line(full["stderr"])
    assert full["rc"] in (1, 2) and re.search(r"no space left on device", line, re.I), full

    read_only = out["read_only"]
    line = _one_line(read_only["stderr"])
    assert read_only["rc"] == 1, read_only
    assert line.startswith(
        f"loongsage: error: cannot write {disk}/run.log: Read-only file system; make {disk} "
        f"writable again (or set run.output_dir elsewhere), then run the same command with "
        f"resume=true to continue from {disk}/checkpoints/step_000001"
    ), line

    resumed = out["resumed"]
    assert resumed["rc"] == 0, resumed["stderr"][-3000:]
    assert f"resume: {disk}/checkpoints/step_000001" in resumed["run_log"]
    assert {f"disk/checkpoints/step_00000{s}/trainer.pt" for s in (1, 2, 3)} <= set(resumed["files"])
    assert not survivors(tag), f"left running: {survivors(tag)}"
