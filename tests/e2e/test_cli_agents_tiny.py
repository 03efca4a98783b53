"""mini-swe-agent and OpenCode, unmodified, driven by the tiny model through the launcher.

A CI-sized GRPO run of the tiny arithmetic recipe (Ray, the ``gateway`` service) whose agent is
``mini_swe_agent`` or ``opencode``: each sample is one run of the real program in the loopback-only
jail, talking to its gateway session, a few tokens per turn. The tiny model solves nothing; what is
checked is the plumbing: the runs finish, the gateway parsed every request the programs sent (with
their tools), turns were recorded and trained on, no process is left, and the programs tried to
reach nothing but the gateway (every destination they named, traced with strace, was on the
namespace's loopback; none of the catalog fetches, update checks or installs that would fail there
happened, so no episode came near its timeout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage.agentflow.programs import jail, netaudit
from loongsage.core.cli import main
from tests._procs import survivors

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(jail.bwrap_problem() is not None, reason=f"no loopback-only jail: {jail.bwrap_problem()}"),
    pytest.mark.skipif(netaudit.strace_problem() is not None, reason=f"no network audit: {netaudit.strace_problem()}"),
]

TIMEOUT_S = 90  # one episode; the episodes here take seconds
CONTEXT = 8192  # OpenCode's prompt with its bash tool is ~4.7k tokens of the tiny tokenizer
COMMON = [
    "run.total_steps=2",
    "data_sources.0.prompts_per_step=1",
    "data_sources.0.samples_per_prompt=2",
    "data_sources.0.eval_reader=null",
    "tracking.progress=false",
    "tracking.batches=true",
    "checkpoint.export_hf=false",
    f"rollout.engine={{name: native, params: {{max_model_len: {CONTEXT}, max_batch_size: 4}}}}",
    f"+services=[{{name: gateway, params: {{max_context_tokens: {CONTEXT}, middlewares: [{{name: request_log}}]}}}}]",
]


def _hydra(value) -> str:
    """A value in Hydra's override grammar (strings quoted)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_hydra(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


def _train(run_dir_root: Path, agent: str, params: dict, tag: str) -> tuple[Path, Path]:
    logs = run_dir_root / f"{agent}_episodes"
    params = {
        **params,
        "timeout_s": TIMEOUT_S,
        "audit_network": True,
        "log_dir": str(logs),
        "max_concurrency": 2,
        "env": {"LOONGSAGE_TEST_TAG": tag},
    }
    spec = _hydra({"name": agent, "params": params})
    assert main(["train", "tiny/grpo_arith_cpu", f"run.name={agent}", *COMMON, f"data_sources.0.agent={spec}"]) == 0
    return run_dir_root / "runs" / agent, logs


def _check_run(run_dir: Path, logs: Path, tag: str, tools: list[str], stream: bool) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # the trainer ran over the programs' tokens (the tiny model earns no reward, so GRPO's
    # advantages, and with them the loss and its gradient, are zero: plumbing, not learning)
    assert all(r["rollout/trajectories"] >= 2 and r["train/entropy"] > 0 for r in trained)
    assert rows[-1]["agentflow/turns"] >= 4  # two episodes a step, one turn at least each
    assert rows[-1]["agentflow/completion_tokens"] > 0
    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [len(b["groups"]) for b in batches] == [1, 1]  # each step's group was trained on
    # the gateway parsed every request the programs sent, in the shape these programs send them
    requests = [json.loads(line) for line in (run_dir / "gateway_requests.jsonl").read_text().splitlines()]
    assert len(requests) >= 4 and {r["status"] for r in requests} == {200}, requests
    shapes = {(tuple(r["tools"] or ()), r["stream"], r["protocol"]) for r in requests}
    assert shapes == {(tuple(tools), stream, "openai")}, shapes
    assert all(r["completion_tokens"] > 0 for r in requests)
    # every episode: the program ended by itself, in the jail, within its timeout, having named no
    # destination but the loopback (the gateway's relay). No bound on wall time beyond the timeout:
    # on a loaded machine the programs' start-up alone varies by tens of seconds; a blocked fetch
    # or install shows in the audit instead.
    episodes = [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]
    assert len(episodes) == 4
    for ep in episodes:
        assert ep["network"] == "loopback_only" and not ep["timed_out"] and ep["error"] is None, ep
        audit = ep["network_audit"]
        assert "error" not in audit and audit["outside"] == {} and audit["unix"] == {}, audit
        assert audit["loopback"], audit  # it did reach the gateway
        assert ep["leftover_processes"] == 0
    assert survivors(tag) == []  # nothing of any episode survives the run
    return episodes


def test_mini_swe_agent_episodes_through_the_launcher(ray_session, in_tmp, mini_program, tag):
    # mini's own prompts are long for a 256-token model; the CI-sized run keeps them short
    short = {
        "agent": {"system_template": "You run bash commands with the bash tool.", "instance_template": "{{task}}"},
        "model": {"format_error_template": "Call the bash tool."},
    }
    run_dir, logs = _train(in_tmp, "mini_swe_agent", {"step_limit": 2, "max_tokens": 8, "config": short}, tag)
    episodes = _check_run(run_dir, logs, tag, tools=["bash"], stream=False)
    # mini leaves a reply without a tool call out of its history (it sends the format error after
    # the task), so each episode's second request starts a new segment of its line
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["agentflow/segments/rewritten"] == 4
    for ep in episodes:
        # the tiny model calls no tool: each call is a format error, and the second call ends it
        assert ep["exit_code"] == 0 and ep["mini"]["exit_status"] == "LimitsExceeded", ep
        assert ep["mini"]["api_calls"] == 2


def test_opencode_episodes_through_the_launcher(ray_session, in_tmp, opencode_dir, tag):
    params = {
        "install_dir": str(opencode_dir),
        "max_tokens": 8,
        "context_tokens": CONTEXT,
        "max_steps": 2,
        "tools": ["bash"],
        "system_prompt": "You are a terse coding agent.",
    }
    run_dir, logs = _train(in_tmp, "opencode", params, tag)
    episodes = _check_run(run_dir, logs, tag, tools=["bash"], stream=True)
    for ep in episodes:
        assert ep["exit_code"] == 0, ep
        stderr = (logs / (Path(ep["logs"]).name + ".stderr")).read_text(errors="replace")
        # what OpenCode logs when it tries a fetch it was told not to make
        assert "models.dev" not in stderr and "install failed" not in stderr, stderr[-2000:]
