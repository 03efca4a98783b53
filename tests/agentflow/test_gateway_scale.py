"""The gateway at scale: 2,000 sessions at once, each a scripted agent of 3 turns with a tool's
pause between them, all in their conversations at the same time, through the official ``openai``
client in a process of its own, against the real gateway (uvicorn on loopback) on the real engine
router over 8 simulated engines in real time (:mod:`loongsage.agentflow.sim`). One run serves
every test of the module.

Bounds (the figures measured on two shared cores are in docs/simulation.md):

* every turn is answered, none with an error;
* every session's trajectory holds exactly the engine's tokens, and the rest of its prompt tokens,
  with the loss mask on the sampled ones only; the agent got exactly their text;
* the gateway's process grows by at most ``MEMORY_PER_SESSION`` per open session;
* the gateway's process's CPU per turn (CPU time: what another process on the machine does not
  change);
* the gateway's own time per turn (its app's, from the request's body in to the answer out, less
  the engine call) at the median, against a bound ten times its target: wall time on a machine
  that other work may hold, so this catches only a gateway that stalls on every turn;
* after the sessions closed, the gateway and the router hold nothing of them.

The latency targets themselves (the gateway's own median and 99th percentile, the latency it adds
as the agent sees it) are checked by ``bench/gateway_scale.py``, which reports them per repeat:
wall-clock figures here would hold the waits of a CPU suite running beside them (in one run the
gateway's loop waited 0.9 s for a CPU per second it ran, and the median it added reached 0.94 s).
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from loongsage.agentflow.chat.messages import openai_tools
from loongsage.agentflow.chat.templates import QWEN3_TOOLS_TEMPLATE
from loongsage.agentflow.sim.fleet import LOOKUP, Script, first_messages
from loongsage.agentflow.sim.scale import Scenario, digest, percentile, run_gateway

pytestmark = pytest.mark.timeout(300)

SESSIONS = 2000
# 3 turns, a tool of 5-15 s between turns, the agents starting over 10 s: every one of the 2,000 is
# in its conversation at once (the first cannot end before the last starts); 6,000 turns in about 40 s
SCRIPT = Script(turns=3, think_s=10.0, ramp_s=10.0)
MEMORY_PER_SESSION = 128 << 10  # bytes of resident memory per open session (measured: about 50 KiB)
# seconds: ten times the target for the gateway's own median time per turn (bench/gateway_scale.py)
STALL_MEDIAN_S = 0.25
CPU_PER_TURN_S = 0.005  # the gateway's process: gateway, router and simulated engines (measured 1.4-2.4 ms)


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny byte-level tokenizer (no model: the engines are simulated) with the tools template."""
    from loongsage.core.tinytask.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def run(tokenizer):
    run = asyncio.run(run_gateway(tokenizer, Scenario(sessions=SESSIONS, script=SCRIPT)))
    print(_figures(run))
    return run


def _figures(run) -> str:
    added, own = run.added_latency_s() or [0.0], run.gateway_own_s() or [0.0]
    return (
        f"{run.answered} turns in {run.wall_s:.1f} s, {run.peak_conversations()} conversations at once at the "
        f"most; added per turn as the agent sees it: median "
        f"{percentile(added, 0.5):.4f} s, p99 {percentile(added, 0.99):.4f} s; the gateway's own: median "
        f"{percentile(own, 0.5):.4f} s, p99 {percentile(own, 0.99):.4f} s; memory per session "
        f"{run.memory_per_session() / 1024:.1f} KiB; CPU per turn {1000 * run.cpu_s / max(run.answered, 1):.2f} ms "
        f"(agents' process {1000 * run.fleet_cpu_s / max(run.answered, 1):.2f} ms); loop lag p99: gateway "
        f"{percentile(run.loop_lag_s, 0.99):.4f} s, agents {run.fleet_loop_lag_s['p99']:.4f} s; the gateway's loop "
        f"waited for a CPU {run.loop_waited_for_cpu:.2f} s per s it ran"
    )


def test_every_turn_is_answered(run):
    assert not run.errors, f"{len(run.errors)} turns failed, the first: {run.errors[:3]}"
    assert [len(turns) for turns in run.turns] == [SCRIPT.turns] * SESSIONS
    assert run.answered == SESSIONS * SCRIPT.turns
    assert all(len(calls) == SCRIPT.turns for calls in run.engine_calls)  # one engine call a turn, no retry


def test_each_trajectory_holds_exactly_the_engines_tokens(run, tokenizer):
    from loongsage.agentflow.trajectories.rendering import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    tools = openai_tools([LOOKUP])
    eos = tokenizer.eos_token_id
    for s, (session, calls, turns) in enumerate(zip(run.sessions, run.engine_calls, run.turns)):
        (trajectory,) = session.trajectories()  # one line: every turn appended to the first
        assert trajectory.metadata["segment_categories"] == ["first"], f"session {s}"
        spans = trajectory.metadata["turns"]
        assert len(spans) == len(calls) == SCRIPT.turns
        tokens = trajectory.prompt_ids + trajectory.response_ids
        assert len(trajectory.prompt_ids) == spans[0]["response_start"]
        sampled = [0] * len(tokens)
        for k, (span, call, turn) in enumerate(zip(spans, calls, turns)):
            start, end = span["response_start"], span["response_end"]
            # the engine was given the line up to this turn's reply, and the line keeps the reply as sampled
            assert call.prompt == digest(tokens[:start]), f"session {s} turn {k}: prompt differs"
            assert call.samples == (digest(tokens[start:end]),), f"session {s} turn {k}: reply differs"
            reply = tokens[start:end]
            stopped = reply[-1] == eos
            assert turn["finish_reason"] == ("stop" if stopped else "length")
            assert turn["completion_tokens"] == len(reply)
            assert turn["content"] == renderer.decode(reply[:-1] if stopped else reply).strip()
            sampled[start:end] = [1] * (end - start)
        # the loss mask, log-probs (the simulated engine's -1.0) and versions on the sampled tokens only
        cut = len(trajectory.prompt_ids)
        assert trajectory.loss_mask == sampled[cut:], f"session {s}: the loss mask is not on the sampled tokens"
        expected_logprobs = [-1.0 if m else 0.0 for m in sampled[cut:]]
        assert trajectory.rollout_logprobs == expected_logprobs, f"session {s}"
        assert trajectory.versions == [0 if m else -1 for m in sampled[cut:]], f"session {s}"
        if s % 100 == 0:  # the first turn's prompt is the template's rendering of the agent's messages
            assert trajectory.prompt_ids == renderer.prompt(first_messages(s), tools)


def test_memory_per_session_is_bounded(run):
    assert run.rss_peak > run.rss_before  # the measure moved: 2,000 sessions hold something
    assert run.memory_per_session() <= MEMORY_PER_SESSION, _figures(run)


def test_the_gateway_neither_stalls_nor_burns_cpu_on_a_turn(run):
    added, own = run.added_latency_s(), run.gateway_own_s()
    assert len(added) == len(own) == SESSIONS * SCRIPT.turns
    assert percentile(own, 0.5) <= STALL_MEDIAN_S, _figures(run)
    assert run.cpu_s / max(run.answered, 1) <= CPU_PER_TURN_S, _figures(run)


def test_closed_sessions_leave_nothing_behind(run):
    assert run.tables_open["sessions"] == run.tables_open["router_sticky"] == SESSIONS
    closed = run.tables_closed
    assert closed["sessions"] == closed["open_trajectory_ids"] == closed["router_sticky"] == 0, closed
    assert closed["router_calls"] == closed["router_pending"] == 0, closed
    # the latest attempts of the last closed trajectories only, however many were opened
    from loongsage.agentflow.trajectories.store import TrajectoryStore

    assert closed["closed_trajectory_ids"] == TrajectoryStore().closed_kept < SESSIONS, closed
    # nothing but this run's list holds a closed session: once the run lets go of them they are freed
    gc.collect()
    for k in range(0, SESSIONS, SESSIONS // 20):
        session = run.sessions[k]
        held_by = [type(r).__name__ for r in gc.get_referrers(session) if r is not run.sessions]
        assert not held_by, f"session {session.route_key} is still held by {held_by}"


def test_the_store_forgets_all_but_the_last_closed_trajectories():
    from loongsage.agentflow.chat.errors import APIError
    from loongsage.agentflow.trajectories.store import TrajectoryStore

    store = TrajectoryStore()
    store.closed_kept = 2
    first = store.open("t0")
    retry = store.open("t0", 1)  # retires attempt 0, found without a scan of the open sessions
    assert first.closed and not retry.closed and store.sessions() == [retry]

    async def close_all() -> None:
        await store.close("t0", 1)
        for name in ("t1", "t2"):
            store.open(name)
            await store.close(name, 0)

    asyncio.run(close_all())
    with pytest.raises(APIError, match="no such trajectory is open"):  # t0 forgotten: a plain 404
        store.get("t0", 1)
    with pytest.raises(APIError, match=r"not open \(attempt 0 was\)"):  # t2 remembered
        store.get("t2", 0)
    with pytest.raises(ValueError, match="not newer"):
        store.open("t2", 0)
    assert store.open("t0", 0).attempt == 0  # forgotten: its attempts may start again
