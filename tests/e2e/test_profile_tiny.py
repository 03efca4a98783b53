"""``run.profile_steps`` end to end: a real launcher run on Ray writes a kernel-level trace of the
listed step from every role's actor, and of no other step."""

from __future__ import annotations

import gzip
import json

from loongsage.core.cli import main
from tests.e2e._runs import SMALL


def test_profile_steps_write_a_trace_per_actor_of_the_listed_step_only(ray_session, in_tmp):
    args = ["train", "tiny/grpo_arith_cpu", "run.name=profiled", "run.total_steps=2", "run.profile_steps=[2]", *SMALL]
    assert main(args) == 0
    run_dir = in_tmp / "runs" / "profiled"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    # the colocated tiny run: one trainer rank, one engine, the reward worker; nothing of step 1
    written = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert written == [f"step2.{role}.0.trace.json.gz" for role in ("engine", "reward", "trainer")], written
    ops = {}
    for name in written:
        with gzip.open(run_dir / "profile" / name, "rt") as fh:
            trace = json.load(fh)
        ops[name.split(".")[1]] = {e.get("name", "") for e in trace["traceEvents"] if e.get("ph") == "X"}
    # the trainer's forward and backward matmuls, the engine's decode (its own thread's ops included)
    assert {"aten::mm", "aten::log_softmax"} <= ops["trainer"], sorted(ops["trainer"])[:50]
    assert any(op.startswith("autograd::engine::evaluate_function") for op in ops["trainer"])
    assert any(op.startswith("aten::") for op in ops["engine"]), sorted(ops["engine"])[:50]
    assert "aten::mm" in ops["engine"] or "aten::linear" in ops["engine"]
    log = (run_dir / "run.log").read_text()
    assert f"step 2: 3 profile traces in {run_dir.resolve() / 'profile'}" in log
