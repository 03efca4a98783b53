"""mini-swe-agent and OpenCode, unmodified, driven by the tiny model through the launcher.

One CI-sized GRPO step of the tiny arithmetic task (Ray, the ``gateway`` service) with two data
sources, one per program: each sample of source ``mini`` is one run of mini-swe-agent, each of
source ``opencode`` one run of OpenCode, in the loopback-only jail, talking to its gateway session,
a few tokens per turn; the two sources' episodes run side by side. The tiny model solves nothing;
what is checked is the plumbing: the runs finish, the gateway parsed every request the programs
sent (with their tools), turns were recorded and trained on, no process is left, and the programs
tried to reach nothing but the gateway (every destination they named, traced with strace, was on
the namespace's loopback; none of the catalog fetches, update checks or installs that would fail
there happened, so no episode came near its timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
from pathlib import Path

import pytest

from loongsage.agentflow.programs import jail, netaudit
from loongsage.core.cli import main
from tests._procs import survivors

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(jail.bwrap_problem() is not None, reason=f"no loopback-only jail: {jail.bwrap_problem()}"),
    pytest.mark.skipif(netaudit.strace_problem() is not None, reason=f"no network audit: {netaudit.strace_problem()}"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90  # one episode; the episodes here take seconds
CONTEXT = 8192  # OpenCode's prompt with its bash tool is ~4.7k tokens of the tiny tokenizer
COMMON = [
    "run.name=cli_agents",
    "run.total_steps=1",
    "tracking.progress=false",
    "tracking.batches=true",
    "checkpoint.export_hf=false",
    f"rollout.engine={{name: native, params: {{max_model_len: {CONTEXT}, max_batch_size: 8}}}}",
    f"+services=[{{name: gateway, params: {{max_context_tokens: {CONTEXT}, middlewares: [{{name: request_log}}]}}}}]",
]
# mini's own prompts are long for a 256-token model; the CI-sized run keeps them short
MINI = {
    "step_limit": 2,
    "max_tokens": 8,
    "config": {
        "agent": {"system_template": "You run bash commands with the bash tool.", "instance_template": "{{task}}"},
        "model": {"format_error_template": "Call the bash tool."},
    },
}
OPENCODE = {
    "max_tokens": 8,
    "context_tokens": CONTEXT,
    "max_steps": 2,
    "tools": ["bash"],
    "system_prompt": "You are a terse coding agent.",
}


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


def _source(name: str, params: dict, root: Path, tag: str) -> dict:
    """A data source of the arithmetic task whose agent is the program ``name``: two episodes."""
    params = {
        **params,
        "timeout_s": TIMEOUT_S,
        "audit_network": True,
        "log_dir": str(root / f"{name}_episodes"),
        "max_concurrency": 2,
        "env": {"LOONGSAGE_TEST_TAG": tag},
    }
    return {
        "name": name,
        "reader": {"name": "arith", "params": {"split": "train", "size": 1000}},
        "prompts_per_step": 1,
        "samples_per_prompt": 2,
        "agent": {"name": name if name == "opencode" else "mini_swe_agent", "params": params},
        "reward": {"name": "exact_match"},
        "sampling": {"temperature": 1.0, "max_new_tokens": 5},
    }


@pytest.fixture(scope="module")
def run(request, tmp_path_factory, ray_session):
    """The run with a source for each program installed here: ``(root, tag, {source: reason skipped})``."""
    root = tmp_path_factory.mktemp("cli_agents")
    (root / "recipes").symlink_to(REPO / "recipes")
    tag = secrets.token_hex(8)
    sources, skipped = [], {}
    for name, fixture, params in (("mini", "mini_program", MINI), ("opencode", "opencode_dir", OPENCODE)):
        try:
            found = request.getfixturevalue(fixture)
        except pytest.skip.Exception as why:
            skipped[name] = str(why)
            continue
        extra = {"install_dir": str(found)} if name == "opencode" else {}
        sources.append(_source(name, {**extra, **params}, root, tag))
    if sources:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)
            try:
                assert main(["train", "tiny/grpo_arith_cpu", *COMMON, f"data_sources={_hydra(sources)}"]) == 0
            finally:
                left = survivors(tag)
                for pid in left:  # nothing may outlive the run; a regression must not outlive the test
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        assert left == []  # nothing of any episode survives the run
    return root, tag, skipped


def _check_run(root: Path, source: str, tools: list[str], stream: bool) -> list[dict]:
    run_dir, logs = root / "runs" / "cli_agents", root / f"{source}_episodes"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1]
    # the trainer ran over the programs' tokens (the tiny model earns no reward, so GRPO's
    # advantages, and with them the loss and its gradient, are zero: plumbing, not learning)
    assert all(r["rollout/trajectories"] >= 2 and r["train/entropy"] > 0 for r in trained)
    assert all(f"rollout_per_ds/{source}/response_length_mean" in r for r in trained)
    assert rows[-1]["agentflow/turns"] >= 4  # two episodes of each program, one turn at least each
    assert rows[-1]["agentflow/completion_tokens"] > 0
    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [sum(g["source"] == source for g in b["groups"]) for b in batches] == [1]  # its group trained
    # the gateway parsed every request the program sent, in the shape this program sends them
    requests = [json.loads(line) for line in (run_dir / "gateway_requests.jsonl").read_text().splitlines()]
    requests = [r for r in requests if f"-{source}-" in r["trajectory"]]
    assert len(requests) >= 2 and {r["status"] for r in requests} == {200}, requests
    shapes = {(tuple(r["tools"] or ()), r["stream"], r["protocol"]) for r in requests}
    assert shapes == {(tuple(tools), stream, "openai")}, shapes
    assert all(r["completion_tokens"] > 0 for r in requests)
    # every episode: the program ended by itself, in the jail, within its timeout, having named no
    # destination but the loopback (the gateway's relay). No bound on wall time beyond the timeout:
    # on a loaded machine the programs' start-up alone varies by tens of seconds; a blocked fetch
    # or install shows in the audit instead.
    episodes = [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]
    assert len(episodes) == 2
    for ep in episodes:
        assert ep["network"] == "loopback_only" and not ep["timed_out"] and ep["error"] is None, ep
        audit = ep["network_audit"]
        assert "error" not in audit and audit["outside"] == {} and audit["unix"] == {}, audit
        assert audit["loopback"], audit  # it did reach the gateway
        assert ep["leftover_processes"] == 0
    return episodes


def test_mini_swe_agent_episodes_through_the_launcher(run):
    root, _, skipped = run
    if "mini" in skipped:
        pytest.skip(skipped["mini"])
    episodes = _check_run(root, "mini", tools=["bash"], stream=False)
    # mini leaves a reply without a tool call out of its history (it sends the format error after
    # the task), so each episode's second request starts a new segment of its line
    last = [json.loads(line) for line in (root / "runs" / "cli_agents" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["agentflow/segments/rewritten"] == 2
    for ep in episodes:
        # the tiny model calls no tool: each call is a format error, and the second call ends it
        assert ep["exit_code"] == 0 and ep["mini"]["exit_status"] == "LimitsExceeded", ep
        assert ep["mini"]["api_calls"] == 2


def test_opencode_episodes_through_the_launcher(run):
    root, _, skipped = run
    if "opencode" in skipped:
        pytest.skip(skipped["opencode"])
    logs = root / "opencode_episodes"
    for ep in _check_run(root, "opencode", tools=["bash"], stream=True):
        assert ep["exit_code"] == 0, ep
        stderr = (logs / (Path(ep["logs"]).name + ".stderr")).read_text(errors="replace")
        # what OpenCode logs when it tries a fetch it was told not to make
        assert "models.dev" not in stderr and "install failed" not in stderr, stderr[-2000:]
