"""The ``command`` agent: real programs (the official OpenAI client among them) against a real
gateway on loopback over the tiny model; hostile programs; the loopback-only jail; ``file_reward``."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from loongsage.agentflow.agents.blackbox import CommandAgent, FileReward
from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.gateway.engines import DirectEngine
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService
from loongsage.agentflow.programs import jail
from loongsage.core.plugins import load_registry
from loongsage.core.rollout import AgentContext
from loongsage.core.types import ConfigError, DataRecord, RewardInfraError, SamplingParams, Status
from tests._procs import lasting, survivors

pytestmark = pytest.mark.timeout(180)

PROGRAMS = Path(__file__).parent / "programs"
JAIL_PROBLEM = jail.bwrap_problem()
needs_jail = pytest.mark.skipif(JAIL_PROBLEM is not None, reason=f"no loopback-only jail here: {JAIL_PROBLEM}")
NETWORKS = ["host", pytest.param("loopback_only", marks=needs_jail)]


class Recorder:
    """The engine client, keeping each call's sampled tokens."""

    def __init__(self, inner):
        self.inner, self.outputs, self.samplings = inner, [], []

    async def generate(self, input_ids, sampling, session=None):
        results = await self.inner.generate(input_ids, sampling, session)
        self.outputs.append([r.output_ids for r in results])
        self.samplings.append(sampling)
        return results

    def release_session(self, session):
        self.inner.release_session(session)


@pytest.fixture(scope="module")
def native(tiny):
    from loongsage.core.engine.native import NativeEngine

    return NativeEngine(tiny[0], max_model_len=1024, max_batch_size=8)


def run_agent(native, tokenizer, agent, record, n=1, sampling=None, private=()):
    """The agent's group, with a gateway on this event loop (as a run's service is)."""
    engine = Recorder(DirectEngine(native))

    async def go():
        gateway = Gateway(ChatService(engine, tokenizer, parser=Qwen3ChatParser()))
        await gateway.start()
        try:
            ctx = AgentContext(
                engine=None,
                tokenizer=tokenizer,
                sampling=sampling or SamplingParams(n=n),
                group_id=7,
                services={"gateway": gateway},
                private_paths=tuple(private),
            )
            return await agent.run(record, ctx), gateway
        finally:
            await gateway.stop()

    group, gateway = asyncio.run(go())
    return group, gateway, engine


def agent(script, *args, **params):
    return CommandAgent(command=[sys.executable, str(PROGRAMS / script), *args], **params)


def record(prompt="2+2="):
    return DataRecord(source="bb", index=4, prompt=prompt)


# ------------------------------------------------------------------------------ conversation
@pytest.mark.parametrize("sampling_from", ["program", "source"])
def test_turns_sample_as_the_program_asks_or_as_the_source_says(native, tokenizer, sampling_from):
    """chat2.py asks for greedy turns; with sampling_from=source the source's sampling is what the
    engine samples with. Either way each turn's record says what it used."""
    source = SamplingParams(n=1, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05)
    program = agent("chat2.py", "{prompt_file}", network="host", sampling_from=sampling_from)
    (t,), _, engine = run_agent(native, tokenizer, program, record(), sampling=source)
    used = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    if sampling_from == "source":
        used = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    assert [turn["sampling"] for turn in t.metadata["turns"]] == [used, used]
    assert [{k: getattr(s, k) for k in used} for s in engine.samplings] == [used, used]


def test_a_two_turn_openai_program_leaves_exact_trajectories(native, tokenizer):
    group, gateway, engine = run_agent(
        native, tokenizer, agent("chat2.py", "{prompt_file}", network="host"), record(), n=2
    )
    assert [t.sample_index for t in group] == [0, 1] and len(engine.outputs) == 4
    sampled = sorted(out for (out,) in engine.outputs)
    mine = []
    for t in group:
        assert (t.source, t.group_id, t.status) == ("bb", 7, Status.OK)
        program = t.metadata["program"]
        assert program["exit_code"] == 0 and program["signal"] is None and not program["timed_out"]
        assert "chat2 done" in program["stderr_tail"] and "chat2 finished" in program["stdout_tail"]
        assert program["network"] == "host" and program["wall_s"] > 0 and program["leftover_processes"] == 0
        assert t.metadata["record_index"] == 4 and len(t.metadata["turns"]) == 2
        assert t.prompt_ids == gateway.service.renderer.prompt([{"role": "user", "content": "2+2="}], None)
        # the model's tokens are trained on, the second user turn between them is not
        turns = t.metadata["turns"]
        cut = len(t.prompt_ids)
        for turn in turns:
            span = slice(turn["response_start"] - cut, turn["response_end"] - cut)
            assert set(t.loss_mask[span]) == {1}
            mine.append(t.response_ids[span])
        user = slice(turns[0]["response_end"] - cut, turns[1]["response_start"] - cut)
        assert user.stop > user.start and set(t.loss_mask[user]) == {0} and set(t.versions[user]) == {-1}
        assert sum(t.loss_mask) == sum(turn["response_end"] - turn["response_start"] for turn in turns)
    assert sorted(mine) == sampled  # exactly the engine's tokens, never re-tokenized


def test_a_program_without_chat_requests_yields_a_failed_trajectory(native, tokenizer):
    (t,), _, _ = run_agent(native, tokenizer, agent("silent.py", network="host"), record())
    assert t.status is Status.FAILED and t.response_ids == [] and t.sample_index == 0
    assert "no chat request" in t.metadata["failure"] and "exit code 3" in t.metadata["failure"]
    assert t.metadata["program"]["exit_code"] == 3 and "nothing to say" in t.metadata["program"]["stdout_tail"]


def test_max_concurrency_bounds_the_programs_running_at_once(native, tokenizer, tmp_path):
    script = (
        "import os, sys, time; start = time.time(); time.sleep(0.3)\n"
        "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').write(f'{start} {time.time()}')"
    )
    serial = CommandAgent(command=[sys.executable, "-c", script, str(tmp_path)], network="host", max_concurrency=1)
    group, _, _ = run_agent(native, tokenizer, serial, record(), n=3)
    assert [t.sample_index for t in group] == [0, 1, 2] and {t.status for t in group} == {Status.FAILED}
    spans = sorted(tuple(map(float, p.read_text().split())) for p in tmp_path.iterdir())
    assert len(spans) == 3 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_missing_program_is_a_failed_trajectory_not_a_crash(native, tokenizer):
    bad = CommandAgent(command=["/nonexistent/agent-program"], network="host")
    (t,), _, _ = run_agent(native, tokenizer, bad, record())
    assert t.status is Status.FAILED and "could not start" in t.metadata["failure"]


# ---------------------------------------------------------------------------------- hostile
@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("script", ["sleeper.py", "forker.py", "flooder.py"])
def test_hostile_programs_are_killed_at_the_timeout_and_leave_nothing(
    native, tokenizer, tmp_path, tag, script, network
):
    pids, logs = tmp_path / "pids", tmp_path / "logs"
    pids.mkdir()
    hostile = agent(
        script,
        network=network,
        timeout_s=1.5,
        grace_s=0.5,
        max_output_bytes=10_000,
        log_dir=str(logs),
        env={"LOONGSAGE_TEST_TAG": tag, "PIDS_DIR": str(pids)},
    )
    start = time.monotonic()
    (t,), _, _ = run_agent(native, tokenizer, hostile, record())
    elapsed = time.monotonic() - start
    program = t.metadata["program"]
    assert program["timed_out"] and program["exit_code"] is None and program["signal"] in (15, 9)
    assert t.status is Status.FAILED and "timed out True" in t.metadata["failure"]
    assert elapsed < 1.5 + 0.5 + 8, elapsed
    started = sorted(p.name.split("-")[0] for p in pids.iterdir())
    assert started == {"sleeper.py": ["sleeper"], "forker.py": ["daemon", "parent"], "flooder.py": ["flooder"]}[script]
    assert survivors(tag) == []
    if network == "host":  # the pids the programs wrote are this machine's (inside the jail: its own)
        for p in pids.iterdir():
            with pytest.raises(ProcessLookupError):
                os.kill(int(p.name.split("-")[1]), 0)
    kept = (logs / (Path(program["logs"]).name + ".stdout")).read_bytes()
    if script == "flooder.py":
        assert program["stdout_bytes"] > 10_000 and len(kept) == 10_000 and set(kept) == {ord("x")}
        assert "flooding" in program["stderr_tail"]
    if script == "forker.py":
        assert program["leftover_processes"] >= 2  # the program and its daemon, still alive at the timeout


@pytest.mark.parametrize("network", NETWORKS)
def test_a_program_that_kills_its_supervisor_is_still_ended(native, tokenizer, tmp_path, tag, network):
    pids = tmp_path / "pids"
    pids.mkdir()
    hostile = agent(
        "parricide.py",
        network=network,
        timeout_s=30,
        grace_s=0.5,
        env={"LOONGSAGE_TEST_TAG": tag, "PIDS_DIR": str(pids)},
    )
    start = time.monotonic()
    (t,), _, _ = run_agent(native, tokenizer, hostile, record())
    assert time.monotonic() - start < 10  # ended with its supervisor, not at the timeout
    assert t.status is Status.FAILED and "supervisor lost" in t.metadata["failure"]
    assert len(list(pids.iterdir())) == 1 and survivors(tag) == []
    if network == "host":  # outside the jail the runner's sweep by the episode's marker ended it
        assert t.metadata["program"]["leftover_processes"] == 1


@pytest.mark.parametrize("network", NETWORKS)
def test_an_episode_cancelled_at_any_moment_leaves_no_process(native, tokenizer, tmp_path, tag, network):
    """Cancelled while its supervisor starts, while the program starts, or while it runs."""
    pids = tmp_path / "pids"
    pids.mkdir()
    sleeper = agent("sleeper.py", network=network, env={"LOONGSAGE_TEST_TAG": tag, "PIDS_DIR": str(pids)})

    async def go():
        gateway = Gateway(ChatService(DirectEngine(native), tokenizer, parser=Qwen3ChatParser()))
        await gateway.start()
        ctx = AgentContext(
            engine=None, tokenizer=tokenizer, sampling=SamplingParams(n=2), group_id=9, services={"gateway": gateway}
        )
        try:
            for delay in (
                0.0,
                0.002,
                0.005,
                0.01,
                0.02,
                0.05,
                0.1,
                0.2,
                0.4,
                1.5,
            ):  # the last: started even on a loaded machine
                group = asyncio.ensure_future(sleeper.run(record(), ctx))
                await asyncio.sleep(delay)
                group.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await group
                assert lasting(tag, within=5.0) == [], f"cancelled after {delay} s"
        finally:
            await gateway.stop()

    asyncio.run(go())
    assert list(pids.iterdir())  # some programs had started when their episode was cancelled


# ------------------------------------------------------------------------------------- jail
def _host_ip() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.1", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@needs_jail
def test_the_jail_reaches_the_gateway_and_nothing_else(native, tokenizer):
    host_ip = _host_ip()
    probe = agent("jail_probe.py", network="loopback_only", env={"HOST_IP": host_ip or ""})
    (t,), _, _ = run_agent(native, tokenizer, probe, record())
    program = t.metadata["program"]
    assert program["exit_code"] == 0 and program["network"] == "loopback_only", program["stderr_tail"]
    assert t.status is Status.OK and len(t.metadata["turns"]) == 1  # through the forwarded port
    result = json.loads(program["stdout_tail"].strip().splitlines()[-1])
    assert result["reply"] and result["interfaces"] == ["lo"]
    expected = ["10.255.255.1"] + ([host_ip] if host_ip else [])
    assert sorted(result["connect"]) == sorted(expected)
    for ip, (outcome, seconds) in result["connect"].items():
        assert outcome == errno.errorcode[errno.ENETUNREACH] and seconds < 1.0, (ip, outcome, seconds)


@needs_jail
def test_a_jailed_program_holds_at_most_its_share_of_connections(native, tokenizer):
    """Each connection through the jail costs the runner three descriptors: past its limit, a
    program's connections are closed as they come, and its turns go on once it lets go."""
    hoarder = agent("hoarder.py", network="loopback_only")
    (t,), _, _ = run_agent(native, tokenizer, hoarder, record())
    program = t.metadata["program"]
    assert program["exit_code"] == 0, program["stderr_tail"]
    result = json.loads(program["stdout_tail"].strip().splitlines()[-1])
    assert result["closed"] == 100 - jail.MAX_CONNECTIONS
    assert t.status is Status.OK and len(t.metadata["turns"]) == 1


@needs_jail
def test_hidden_paths_are_empty_to_a_jailed_program_and_its_workdir_stays_its_own(native, tokenizer, tmp_path):
    """The run's data (its labels) hidden from the program: a folder it hides is empty, a file of
    the run's data sources is empty, while a file beside them and the working directory, inside
    the hidden folder, are as they are; the framework's code is read-only."""
    import loongsage.algos.rewards

    data = tmp_path / "data"
    (data / "work").mkdir(parents=True)
    (data / "secret.txt").write_text("the answer is 42")
    labels, visible = tmp_path / "labels.jsonl", tmp_path / "visible.txt"
    labels.write_text('{"label": "42"}')
    visible.write_text("seen")
    code = os.path.dirname(loongsage.algos.rewards.__file__)
    peeker = CommandAgent(
        command=[sys.executable, str(PROGRAMS / "peeker.py"), str(data), str(labels), str(visible), "{workdir}", code],
        network="loopback_only",
        hide=[str(data)],
        workdir_root=str(data / "work"),
        keep_workdir=True,
    )
    # the labels file as the run hands its data sources' files to every agent
    (t,), _, _ = run_agent(native, tokenizer, peeker, record(), private=[str(labels), str(tmp_path / "not yet")])
    program = t.metadata["program"]
    assert program["exit_code"] == 0, program["stderr_tail"]
    seen = json.loads(program["stdout_tail"].strip().splitlines()[-1])
    assert seen == {
        "secret": "FileNotFoundError",
        "file": "",
        "visible": "seen",
        "mine": "written",
        "code": "Read-only file system",  # the framework's code, the reward's among it
    }, seen
    assert (data / "secret.txt").read_text() == "the answer is 42"  # hidden, not touched
    assert not os.path.exists(os.path.join(code, "planted.py"))


@needs_jail
@pytest.mark.parametrize("own_root", [False, True])
def test_a_jailed_program_cannot_reach_other_episodes_files(native, tokenizer, tmp_path, own_root):
    """Another episode's working and control directories (its ``reward`` file, its solution) are out
    of a jailed program's sight: the folders that hold them are empty to it but for its own."""
    from loongsage.agentflow.agents import blackbox

    root = str(tmp_path / "work") if own_root else None
    if root:
        os.mkdir(root)
    victim = os.path.join(blackbox._episodes_root(root), "other-episode")
    victim_control = os.path.join(blackbox._episodes_root(None), "lsg-other")
    for folder in (victim, victim_control):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "reward"), "w") as f:
            f.write("0.0")
    forger = agent("forger.py", "{workdir}", victim, victim_control, network="loopback_only", workdir_root=root)
    try:
        (t,), _, _ = run_agent(native, tokenizer, forger, record())
        program = t.metadata["program"]
        assert program["exit_code"] == 0, program["stderr_tail"]
        seen = json.loads(program["stdout_tail"].strip().splitlines()[-1])
        assert seen["victim"] == seen["victim_control"] == "FileNotFoundError", seen
        assert len(seen["beside_workdir"]) == 1 + (not own_root), seen  # its own (and its control dir)
        for folder in (victim, victim_control):
            with open(os.path.join(folder, "reward")) as f:
                assert f.read() == "0.0"
    finally:
        shutil.rmtree(victim, ignore_errors=True)
        shutil.rmtree(victim_control, ignore_errors=True)


def test_hide_needs_the_jail_and_paths_that_exist(tmp_path):
    with pytest.raises(ValueError, match="set network: loopback_only"):
        CommandAgent(command=["true"], network="host", hide=[str(tmp_path)])
    if JAIL_PROBLEM is None:
        with pytest.raises(ValueError, match="does not exist"):
            CommandAgent(command=["true"], network="loopback_only", hide=[str(tmp_path / "nope")])


def test_loopback_only_without_bubblewrap_fails_at_config_time(monkeypatch, caplog):
    registry = load_registry()
    monkeypatch.setattr(jail.shutil, "which", lambda name: None)
    jail.bwrap_problem.cache_clear()
    try:
        with pytest.raises(ConfigError) as exc:
            registry.create(
                "agent",
                {"name": "command", "params": {"command": ["x"], "network": "loopback_only"}},
                "data_sources[0].agent",
            )
        assert "\n" not in str(exc.value) and "bubblewrap" in str(exc.value)
        assert str(exc.value).startswith("data_sources[0].agent.params.network='loopback_only': ")
        with caplog.at_level(logging.WARNING, logger="loongsage.agentflow"):
            auto = registry.create("agent", {"name": "command", "params": {"command": ["x"]}}, "a")
        assert not auto.jailed and "may reach the network" in caplog.text and "bubblewrap" in caplog.text
    finally:
        jail.bwrap_problem.cache_clear()


def test_host_network_warns_that_the_program_may_reach_the_network(caplog):
    with caplog.at_level(logging.WARNING, logger="loongsage.agentflow"):
        CommandAgent(command=["x"], network="host")
    assert "network=host" in caplog.text and "may reach the network" in caplog.text


@pytest.mark.parametrize(
    "params, message",
    [
        ({"command": []}, "params.command=[]: must be a non-empty list"),
        ({"command": ["a", ""]}, "params.command=['a', '']: must be a non-empty list"),
        ({"command": ["a"], "timeout_s": 0}, "params.timeout_s=0.0: must be > 0"),
        ({"command": ["a"], "timeout_s": -5}, "params.timeout_s=-5.0: must be > 0"),
        ({"command": ["a"], "grace_s": -1}, "params.grace_s=-1.0: must be >= 0"),
        ({"command": ["a"], "max_concurrency": 0}, "params.max_concurrency=0: must be >= 1"),
        ({"command": ["a"], "network": "none"}, "params.network: got 'none'; allowed: 'auto', 'loopback_only', 'host'"),
        ({"command": ["a"], "env": {"A=B": "1"}}, "params.env="),
        ({}, "command"),
    ],
)
def test_bad_params_fail_at_config_time_in_one_line(params, message):
    with pytest.raises(ConfigError) as exc:
        load_registry().create("agent", {"name": "command", "params": {"network": "host", **params}}, "agent")
    assert "\n" not in str(exc.value) and message in str(exc.value), str(exc.value)


# ----------------------------------------------------------------------------------- reward
def test_reward_file_is_read_by_file_reward(native, tokenizer):
    rewarded = agent("reward.py", "{workdir}", network="host", reward_file=True)
    (t,), _, _ = run_agent(native, tokenizer, rewarded, record())
    assert t.status is Status.OK and t.metadata["reward_file"] == 0.75 and t.metadata["reward_file_error"] is None
    reward = load_registry().create("reward", {"name": "file_reward"}, "reward")
    assert reward(t, record()) == 0.75
    t.metadata.update(reward_file=None, reward_file_error="the program wrote no reward file")
    with pytest.raises(RewardInfraError, match="no reward file"):
        reward(t, record())
    assert FileReward(default=0.0)(t, record()) == 0.0


@pytest.mark.parametrize(
    ("trap", "error"),
    [
        ("fifo", "reward file is not a regular file"),
        ("zero", "reward file unreadable (a regular file, not a link, is read)"),
        ("sparse", "reward file holds '1.0 \\x00"),  # its first 100 bytes, not 64 GiB
    ],
)
def test_a_reward_file_that_is_no_file_is_refused_at_once(native, tokenizer, trap, error):
    """A FIFO would block the read for ever, a link to /dev/zero and a sparse file of gigabytes
    would fill the memory: only a regular file is read, and only its first bytes."""
    rewarded = agent("reward_trap.py", "{workdir}", trap, network="host", reward_file=True)
    started = time.monotonic()
    (t,), _, _ = run_agent(native, tokenizer, rewarded, record())
    assert time.monotonic() - started < 60
    assert t.metadata["reward_file"] is None and t.metadata["reward_file_error"].startswith(error), t.metadata
