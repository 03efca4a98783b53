"""The ``sglang`` engine through the real launcher and Ray: the tiny GRPO recipe with
``rollout.engine.name=sglang`` and nothing else changed, the engine worker starting the stand-in
server (``sglang_contract_server.py``) as SGLang's own would be started. The stand-in's "model" is
a rule, not a network, so nothing is learned; what is checked is the wiring: generation with
log-probs, one weight push per step landing on the server (its version and weights), evaluation,
release and resume of the server's memory while the colocated trainer trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.cli import main
from tests.e2e._runs import SMALL

SERVER = str(Path(__file__).with_name("sglang_contract_server.py"))
pytestmark = pytest.mark.timeout(600)


def test_the_tiny_recipe_steps_with_the_sglang_engine(ray_session, in_tmp):
    engine = (
        f"rollout.engine={{name: sglang, params: {{launch: [{sys.executable}, {SERVER}], startup_timeout_s: 120}}}}"
    )
    args = [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=sgl",
        "run.total_steps=3",
        "data_sources.0.prompts_per_step=4",
        "data_sources.0.samples_per_prompt=4",
        "evaluation.every_steps=3",
        "evaluation.max_prompts=8",
        "evaluation.pass_k=0",
        "tracking.progress=false",
        "checkpoint.export_hf=false",
        "placement.release_engine_memory=true",
        engine,
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "sgl" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0]
    for r in trained:
        assert r["rollout/trajectories"] == 16 and r["sync/bytes"] > 0
        # the stand-in's log-probs are not the trainer's: the consistency metric sees it
        assert r["train/is_logprob_abs_diff"] > 0
    assert any("eval/arith/accuracy" in r for r in rows)


def test_a_server_that_dies_mid_rollout_is_replaced_and_the_run_finishes(ray_session, in_tmp):
    """The stand-in dies once, with requests in flight (its 40th request: in the third step, after
    the 4 of the first evaluation and 16 a step): the engine's calls fail as unavailable, its health
    probe names the dead server, the run replaces the replica (a new server, loaded with the current
    weights) and sends the lost requests again."""
    marker = in_tmp / "died"
    launch = f"[{sys.executable}, {SERVER}, --token-delay, '0.01', --die-after, '40', --die-once-file, {marker}]"
    engine = f"rollout.engine={{name: sglang, params: {{launch: {launch}, startup_timeout_s: 120}}}}"
    args = [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=sgl_dies",
        "run.total_steps=4",
        *SMALL,
        "colocate=false",
        "rollout.engine_health_timeout_s=10",
        engine,
    ]
    assert main(args) == 0
    assert marker.exists(), "the server never died"
    rows = [json.loads(line) for line in (in_tmp / "runs" / "sgl_dies" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0, 4.0]
    assert sum(r["rollout/engine_restarts"] for r in trained) == 1
    assert sum(r["rollout/requests_redispatched"] for r in trained) >= 1


def test_with_broadcast_the_server_takes_the_weights_from_the_trainers_group(ray_session, in_tmp):
    """``rollout.transport=broadcast`` (gloo here, NCCL between GPUs): the stand-in joins the
    trainer's group as SGLang does and takes every bucket itself; the engine worker stages nothing
    and each commit moves the version."""
    record = in_tmp / "calls.jsonl"
    launch = f"[{sys.executable}, {SERVER}, --record, {record}]"
    engine = f"rollout.engine={{name: sglang, params: {{launch: {launch}, startup_timeout_s: 120}}}}"
    args = [
        "train",
        "tiny/grpo_arith_cpu",
        "run.name=sgl_group",
        "run.total_steps=3",
        *SMALL,
        "colocate=false",
        "rollout.transport={name: broadcast, params: {backend: gloo, bucket_mb: 0.05, timeout_s: 60}}",
        engine,
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_tmp / "runs" / "sgl_group" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["engine/version"] for r in trained] == [1.0, 2.0, 3.0]
    assert all(r["sync/buckets"] > 1 for r in trained)  # several buckets a push, each broadcast to the server
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert {c["call"] for c in calls} == {"update_weights_from_distributed", "update_weight_version"}
    commits = [i for i, c in enumerate(calls) if c["call"] == "update_weight_version"]
    assert [calls[i]["version"] for i in commits] == ["1", "2", "3"]
    # the last push's tensors arrived as the trainer had them at the end (its checkpoint), bit for bit
    last = calls[commits[1] + 1 : commits[2]]
    names = [n for c in last for n in c["names"]]
    state = torch.load(in_tmp / "runs" / "sgl_group" / "checkpoints" / "step_000003" / "trainer.pt")["model"]
    assert len(names) == len(set(names)) and set(names) <= set(state)
    assert sum(c["received"] for c in last) == pytest.approx(
        sum(float(state[n].double().sum()) for n in names), rel=1e-12
    )
