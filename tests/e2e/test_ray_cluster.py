"""A run that joins a running Ray cluster (``RAY_ADDRESS``), as on a multi-node machine set.

The cluster is this session's Ray (a real GCS and raylet on this machine, started before the run and
outliving it). The launcher, a process of its own as from a shell, joins it: its actors run there
with the launcher's environment forwarded (the model cache, the project's variables); the run
trains; at its end the run's actors are gone and the cluster keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests._procs import TAG_VARIABLE, lasting, process_name, survivors
from tests.e2e._runs import SMALL

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_run_joins_the_cluster_at_ray_address_and_leaves_it_running(ray_session, in_tmp, tag):
    ray = ray_session
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address, TAG_VARIABLE: tag}
    argv = [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=joined",
        "run.total_steps=2",
        *SMALL,
        "placement.num_cpus=2",  # ignored, with a warning: the cluster has its own resources
    ]
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # the actors carry the launcher's tag: its environment reached them
        while not done.is_set():
            # an actor's process is titled ray::Class, or ray::Class.method() while it runs one
            seen.update((process_name(pid) or "").split(".")[0] for pid in survivors(tag))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "loongsage.core.cli", *argv],
            cwd=in_tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        done.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stderr  # it joined, it did not start one
    assert "placement.num_cpus=2 is ignored: the run joins the Ray cluster at RAY_ADDRESS=" in proc.stderr, proc.stderr
    assert {"ray::TrainerWorker", "ray::EngineWorker", "ray::RewardWorker"} <= seen, seen
    rows = [json.loads(line) for line in (in_tmp / "runs" / "joined" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]

    assert lasting(tag) == []  # the run's actors end with it
    assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42  # the cluster keeps serving
