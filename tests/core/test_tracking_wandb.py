"""The wandb tracker, offline: steps land in one W&B run across a resume; config checks; no wandb installed.

Every test here runs W&B in offline mode with its directories in tmp_path: nothing leaves the machine.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loongsage.core.config import load_config
from loongsage.core.tracking import WANDB_MISSING, WANDB_RUN_ID_FILE, WandbTracker
from loongsage.core.types import ConfigError

REPO = Path(__file__).resolve().parents[2]


def offline_env(monkeypatch: pytest.MonkeyPatch, home: Path, wandb_dir: Path | None) -> None:
    """W&B offline and quiet, every file it writes under ``home``; ``wandb_dir`` is WANDB_DIR (None: unset)."""
    for key in (
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_NAME",
        "WANDB_RUN_GROUP",
        "WANDB_TAGS",
        "WANDB_DIR",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports from its service
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampler
    monkeypatch.setenv("WANDB__DISABLE_META", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(home / sub))
    if wandb_dir is not None:
        monkeypatch.setenv("WANDB_DIR", str(wandb_dir))


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """WANDB_DIR in tmp_path; W&B's process-wide state is torn down after the test (it caches the env)."""
    import wandb

    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    offline_env(monkeypatch, tmp_path / "wandb_home", wandb_dir)
    yield wandb_dir
    wandb.teardown()


# ----------------------------------------------------------------------------- reading offline runs back
def _records(path: Path):
    """The protobuf records of a ``.wandb`` file: W&B's header, then a LevelDB-format log of 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_runs(root: Path) -> list[dict]:
    """Each ``offline-run-*`` session under ``root`` (a WANDB_DIR): its run id, name, config and history.

    W&B's service writes the files; ``run.finish()`` may return before it has flushed them, so this
    first waits for the service to shut down (``wandb.teardown()``; a later ``wandb.init`` starts one).
    """
    import json

    import wandb

    wandb.teardown()
    sessions = []
    for run_dir in sorted(root.glob("wandb/offline-run-*")):
        (log,) = run_dir.glob("*.wandb")
        session = {"dir": run_dir.name, "file": log.name, "ids": set(), "name": None, "config": {}, "history": {}}
        for record in _records(log):
            which = record.WhichOneof("record_type")
            if which == "run":
                session["ids"].add(record.run.run_id)
                session["name"] = record.run.display_name
                session["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif which == "config":
                session["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif which == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                session["history"][record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        sessions.append(session)
    return sessions


# ----------------------------------------------------------------------------- the tracker itself
def _metrics(step: int) -> dict[str, float]:
    return {
        "train/loss": 1.0 / step,
        "rollout/reward_mean": 0.25 * step,
        "eval/arith/accuracy": 0.5,
        "train/inf": math.inf,
        "train/nan": math.nan,
        "flag": True,
    }


def test_offline_run_resumes_into_the_same_wandb_run(wandb_offline, tmp_path):
    run_dir = tmp_path / "runs" / "unit"
    config = {"run": {"name": "unit", "total_steps": 3}, "checkpoint": {"resume": False}}
    tracker = WandbTracker(run_dir=str(run_dir), run_name="unit", config=config, resume=False, project="tests")
    for step in (1, 2, 3):
        tracker.log(step, _metrics(step))
    tracker.close()
    run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
    assert len(run_id) == 8 and run_id.isalnum()

    resumed_config = {"run": {"name": "unit", "total_steps": 5}, "checkpoint": {"resume": True}}
    tracker = WandbTracker(run_dir=str(run_dir), run_name="unit", config=resumed_config, resume=True, project="tests")
    for step in (4, 5):
        tracker.log(step, _metrics(step))
    tracker.close()
    tracker.close()  # closing twice is harmless
    assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == run_id

    sessions = read_offline_runs(wandb_offline)
    assert len(sessions) == 2
    assert all(s["ids"] == {run_id} and s["file"] == f"run-{run_id}.wandb" for s in sessions)
    assert all(s["dir"].endswith(run_id) or f"-{run_id}-" in s["dir"] for s in sessions)
    assert [s["name"] for s in sessions] == ["unit", "unit"]
    # the run config, once per session: the resumed session records what it resumed with
    assert [s["config"]["run"]["total_steps"] for s in sessions] == [3, 5]
    assert [s["config"]["checkpoint"]["resume"] for s in sessions] == [False, True]
    history = {step: row for s in sessions for step, row in s["history"].items()}
    assert sorted(history) == [1, 2, 3, 4, 5]
    assert [sorted(s["history"]) for s in sessions] == [[1, 2, 3], [4, 5]]
    for step, row in history.items():
        # finite scalars only: inf, nan and booleans are not metrics
        assert row == pytest.approx(
            {"train/loss": 1.0 / step, "rollout/reward_mean": 0.25 * step, "eval/arith/accuracy": 0.5}
        ), row

    # a run started again without resume is a new W&B run (and the file names it)
    tracker = WandbTracker(run_dir=str(run_dir), run_name="unit", config=config, resume=False, project="tests")
    tracker.close()
    fresh = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
    assert fresh != run_id
    assert {i for s in read_offline_runs(wandb_offline) for i in s["ids"]} == {run_id, fresh}


def test_resume_without_an_id_file_starts_a_run_and_keeps_its_id(wandb_offline, tmp_path):
    """A run resumed that never had the wandb tracker (no id file) starts a W&B run and records its id."""
    run_dir = tmp_path / "runs" / "late"
    tracker = WandbTracker(run_dir=str(run_dir), run_name="late", resume=True, name="shown", tags=["a", "b"])
    tracker.log(7, {"train/loss": 0.5})
    tracker.close()
    run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
    (session,) = read_offline_runs(wandb_offline)
    assert session["ids"] == {run_id} and session["name"] == "shown"
    assert session["history"] == {7: {"train/loss": 0.5}}


def test_a_runs_trackers_and_their_resume_log_one_wandb_run_beside_metrics_jsonl(tmp_path, monkeypatch):
    """What the launcher builds for ``tracking.backends=[jsonl,wandb]`` (``create_trackers`` over the
    run's config, WANDB_DIR unset: W&B's files in the run directory), for a run and then its resume
    (``resume=true``): one W&B run, its config once per session, every row as metrics.jsonl has it.
    (tests/e2e/test_wandb_tiny.py does this through two launcher runs.)"""
    import json

    import wandb

    from loongsage.core.tracking import create_trackers

    monkeypatch.chdir(REPO)
    offline_env(monkeypatch, tmp_path / "wandb_home", None)
    run_dir = tmp_path / "runs" / "wired"
    logged = {0: {"eval/arith/accuracy": 0.25}, 1: _metrics(1), 2: _metrics(2), 3: _metrics(3)}
    try:
        for steps, resume, total in (((0, 1, 2), "false", 2), ((3,), "true", 3)):
            overrides = [
                "run.name=wired",
                "tracking.backends=[jsonl,wandb]",
                f"run.total_steps={total}",
                f"checkpoint.resume={resume}",
            ]
            cfg, registry = load_config("tiny/grpo_arith_cpu", overrides)
            trackers = create_trackers(registry, cfg, run_dir)
            assert [type(t).__name__ for t in trackers] == ["JsonlTracker", "WandbTracker"]
            for step in steps:
                for tracker in trackers:
                    tracker.log(step, logged[step])
            for tracker in trackers:
                tracker.close()
        run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
        sessions = read_offline_runs(run_dir)  # tears W&B's service down first: files complete
    finally:
        wandb.teardown()

    assert len(sessions) == 2
    for s in sessions:
        assert s["ids"] == {run_id} and s["file"] == f"run-{run_id}.wandb" and f"-{run_id}" in s["dir"]
        assert s["name"] == "wired" and s["config"]["run"]["name"] == "wired"
    assert [s["config"]["checkpoint"]["resume"] for s in sessions] == [False, True]
    assert [s["config"]["run"]["total_steps"] for s in sessions] == [2, 3]
    assert [sorted(s["history"]) for s in sessions] == [[0, 1, 2], [3]]
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3]
    for s in sessions:
        for step, row in s["history"].items():
            assert row == {k: v for k, v in rows[step].items() if k != "step"}


# ----------------------------------------------------------------------------- config
@pytest.fixture
def at_repo(monkeypatch) -> Path:
    monkeypatch.chdir(REPO)
    return REPO


def _config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config("tiny/grpo_arith_cpu", overrides)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_config_takes_names_and_specs(at_repo):
    cfg, _ = load_config("tiny/grpo_arith_cpu", ["tracking.backends=[jsonl,wandb]"])
    assert cfg.tracking.backends == ["jsonl", "wandb"]
    spec = "{name: wandb, params: {project: p, entity: team, mode: offline, group: g, tags: [x, y], name: n}}"
    cfg, _ = load_config("tiny/grpo_arith_cpu", [f"tracking.backends=[jsonl,{spec}]"])
    assert cfg.tracking.backends[1] == {
        "name": "wandb",
        "params": {"project": "p", "entity": "team", "mode": "offline", "group": "g", "tags": ["x", "y"], "name": "n"},
    }
    cfg, _ = load_config("tiny/grpo_arith_cpu")
    assert cfg.tracking.backends == ["jsonl", "tensorboard"]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            "{name: wandb, params: {projct: p}}",
            "tracking.backends[1].params.projct: unknown key; allowed: entity, group, mode, name, project, tags",
        ),
        (
            "{name: wandb, params: {mode: sometimes}}",
            "tracking.backends[1].params.mode: got 'sometimes'; allowed: 'online', 'offline', 'disabled'",
        ),
        ("{name: wandb, params: {tags: x}}", "tracking.backends[1].params.tags: got 'x'; expected a list"),
        # what the framework supplies is not a user's to set
        ("{name: wandb, params: {run_dir: /x}}", "tracking.backends[1].params.run_dir: unknown key; allowed: "),
        ("{name: wandb, params: {resume: true}}", "tracking.backends[1].params.resume: unknown key; allowed: "),
        ("{name: jsonl, params: {run_dir: /x}}", "tracking.backends[1].params.run_dir: unknown key; allowed: (none)"),
        ("{name: wandb, parms: {}}", "tracking.backends[1].parms: unknown key; allowed: name, params"),
        ("{params: {}}", "tracking.backends[1]: expected a mapping with 'name'"),
        ("mlflow", "tracking.backends[1].name: unknown tracker 'mlflow'; known: jsonl, tensorboard, wandb"),
    ],
)
def test_config_refuses_bad_tracker_entries(at_repo, entry, expected):
    assert _config_error([f"tracking.backends=[jsonl,{entry}]"]).startswith(expected)


def test_without_wandb_the_core_imports_and_config_names_the_extra():
    """wandb is an optional extra: the core imports without it; choosing the tracker is one config error."""
    script = textwrap.dedent("""
        import sys
        sys.modules["wandb"] = None  # as if not installed: `import wandb` raises ImportError
        import loongsage.core, loongsage.core.controller
        from loongsage.core.config import load_config
        from loongsage.core.tracking import WandbTracker
        from loongsage.core.types import ConfigError
        cfg, registry = load_config("tiny/grpo_arith_cpu")  # the default trackers need no wandb
        assert "wandb" in registry.names("tracker")
        try:
            load_config("tiny/grpo_arith_cpu", ["tracking.backends=[jsonl,wandb]"])
        except ConfigError as exc:
            print("CONFIG", exc)
        try:
            WandbTracker(run_dir=sys.argv[1])
        except ImportError as exc:
            print("BUILD", exc)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, str(REPO / "runs" / "never")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert f"CONFIG tracking.backends[1]: {WANDB_MISSING}" in lines
    assert any(line.startswith(f"BUILD {WANDB_MISSING}") for line in lines)
    assert WANDB_MISSING.endswith("pip install 'loongsage-core[wandb]'")
    assert not (REPO / "runs" / "never").exists()
