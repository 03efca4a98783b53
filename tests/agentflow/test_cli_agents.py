"""The ``mini_swe_agent`` and ``opencode`` agents: what they write for their programs, their
config-time errors, and the network audit that proves a program tried to reach nothing but its
gateway (a program that phones home is caught; so is OpenCode when it is not prepared).

The full episodes of both programs through the launcher are in tests/e2e/test_cli_agents_tiny.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from loongsage.agentflow.agents.blackbox import CommandAgent
from loongsage.agentflow.agents.mini_swe import MiniSweAgent
from loongsage.agentflow.agents.opencode import OpenCodeAgent
from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.gateway.engines import DirectEngine
from loongsage.agentflow.gateway.server import Gateway
from loongsage.agentflow.gateway.service import ChatService
from loongsage.agentflow.programs import jail, netaudit
from loongsage.agentflow.trajectories.store import Budget
from loongsage.core.plugins import load_registry
from loongsage.core.rollout import AgentContext
from loongsage.core.types import ConfigError, DataRecord, SamplingParams, Status

pytestmark = pytest.mark.timeout(180)

PROGRAMS = Path(__file__).parent / "programs"
_MISSING = jail.bwrap_problem() or netaudit.strace_problem()
needs_audit = pytest.mark.skipif(_MISSING is not None, reason=f"no jail or no strace here: {_MISSING}")
SESSION_ENV = {
    "OPENAI_BASE_URL": "http://127.0.0.1:9/t/0/v1",
    "OPENAI_API_KEY": "sk-session",
    "LOONGSAGE_PROMPT_FILE": "/w/prompt.txt",
}


@pytest.fixture(scope="module")
def long_engine(tiny):
    """The tiny model with room for OpenCode's prompt (its bash tool alone is ~4.5k tokens)."""
    from loongsage.core.engine.native import NativeEngine

    return NativeEngine(tiny[0], max_model_len=8192, max_batch_size=4)


def run_group(engine, tokenizer, agent, prompt="2+2=", n=1):
    async def go():
        gateway = Gateway(
            ChatService(
                DirectEngine(engine), tokenizer, parser=Qwen3ChatParser(), budget=Budget(max_context_tokens=8192)
            )
        )
        await gateway.start()
        try:
            ctx = AgentContext(
                engine=None,
                tokenizer=tokenizer,
                sampling=SamplingParams(n=n),
                group_id=1,
                services={"gateway": gateway},
            )
            return await agent.run(DataRecord(source="cli", index=0, prompt=prompt), ctx)
        finally:
            await gateway.stop()

    return asyncio.run(go())


def fake_opencode(root: Path) -> Path:
    """An install's layout (the binary a stub): enough for the agent to be built and prepare episodes."""
    for name in ("opencode-linux-x64", "opencode-linux-x64-baseline", "opencode-linux-arm64"):
        binary = root / "node_modules" / name / "bin" / "opencode"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    (root / "config" / "node_modules" / "@opencode-ai" / "plugin").mkdir(parents=True)
    for name in ("package.json", "package-lock.json"):
        (root / "config" / name).write_text("{}")
    return root


# ---------------------------------------------------------------------------------- config time
def test_both_agents_are_registered():
    registry = load_registry()
    for name, cls in (("mini_swe_agent", MiniSweAgent), ("opencode", OpenCodeAgent)):
        assert registry.entry("agent", name).factory is cls and issubclass(cls, CommandAgent)
        assert cls.required_services == ("gateway",)


def test_opencode_without_its_install_fails_at_config_time_naming_the_set_up_step(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_registry().create("agent", {"name": "opencode", "params": {"install_dir": str(tmp_path)}}, "agent")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("agent.params.install_dir=")
    assert "python -m loongsage.agentflow.opencode_install --dir" in message


def test_mini_without_its_program_fails_at_config_time():
    with pytest.raises(ConfigError) as exc:
        load_registry().create("agent", {"name": "mini_swe_agent", "params": {"program": "/nonexistent/mini"}}, "a")
    assert "\n" not in str(exc.value) and "mini-swe-agent" in str(exc.value)


def test_command_is_not_a_param_of_the_specialised_agents(tmp_path):
    with pytest.raises(ConfigError, match="command"):
        load_registry().create("agent", {"name": "mini_swe_agent", "params": {"command": ["x"]}}, "a")


def test_the_audit_without_strace_fails_at_config_time(monkeypatch):
    monkeypatch.setattr(netaudit.shutil, "which", lambda name: None)
    netaudit.strace_problem.cache_clear()
    try:
        with pytest.raises(ConfigError) as exc:
            load_registry().create(
                "agent",
                {"name": "command", "params": {"command": ["x"], "network": "host", "audit_network": True}},
                "a",
            )
        assert "\n" not in str(exc.value) and "apt-get install -y strace" in str(exc.value)
    finally:
        netaudit.strace_problem.cache_clear()


# ------------------------------------------------------------------------- what they write
def test_opencode_is_pointed_at_its_session_with_every_fetch_switched_off(tmp_path):
    install = fake_opencode(tmp_path / "install")
    agent = OpenCodeAgent(
        install_dir=str(install),
        network="host",
        max_tokens=16,
        context_tokens=2048,
        max_steps=2,
        tools=["bash"],
        system_prompt="Be brief.",
        config={"share": "manual"},
    )
    workdir, env = tmp_path / "ep", dict(SESSION_ENV)
    workdir.mkdir()
    argv = agent.prepare(workdir, [{"role": "user", "content": "-2+2="}], list(agent.command), env)
    assert argv[:2] == [agent.command[0], "run"] and argv[-2:] == ["--", "-2+2="]  # a task may start with '-'
    assert argv[argv.index("--dir") + 1] == str(workdir / "project") and (workdir / "project").is_dir()
    assert argv[argv.index("--model") + 1] == "loongsage/loongsage" and "--title" in argv
    config_dir = workdir / "home" / ".config" / "opencode"
    assert env["HOME"] == str(workdir / "home") and env["XDG_CONFIG_HOME"] == str(workdir / "home" / ".config")
    assert env["TMPDIR"] == str(workdir / "home" / "tmp") and Path(env["TMPDIR"]).is_dir()
    config = json.loads((config_dir / "opencode.json").read_text())
    provider = config["provider"]["loongsage"]
    assert provider["options"] == {"baseURL": SESSION_ENV["OPENAI_BASE_URL"], "apiKey": "sk-session"}
    assert provider["models"]["loongsage"]["limit"] == {"context": 2048, "output": 16}
    assert config["enabled_providers"] == ["loongsage"] and config["model"] == config["small_model"]
    assert config["autoupdate"] is False and config["share"] == "manual"  # `config` merged over the defaults
    assert config["lsp"] is False and config["plugin"] == [] and config["mcp"] == {}
    assert config["tools"] == {"*": False, "bash": True, "webfetch": False, "websearch": False, "codesearch": False}
    assert config["agent"] == {"build": {"prompt": "Be brief.", "steps": 2}}
    for switch in ("AUTOUPDATE", "MODELS_FETCH", "SHARE", "LSP_DOWNLOAD", "DEFAULT_PLUGINS", "PROJECT_CONFIG"):
        assert env[f"OPENCODE_DISABLE_{switch}"] == "true"
    # the plugin package OpenCode would npm-install into its configuration folder is already there
    assert (config_dir / "node_modules").resolve() == (install / "config" / "node_modules").resolve()
    assert (config_dir / "package.json").is_file() and (config_dir / "package-lock.json").is_file()


def test_opencode_keeps_the_web_tools_off_with_its_own_tool_set(tmp_path):
    agent = OpenCodeAgent(install_dir=str(fake_opencode(tmp_path / "install")), network="host")
    config = agent.opencode_config("http://127.0.0.1:1/v1", "k")
    assert config["tools"] == {"webfetch": False, "websearch": False, "codesearch": False} and config["agent"] == {}


def test_mini_is_configured_for_its_session_by_its_own_files(tmp_path):
    agent = MiniSweAgent(
        program=sys.executable,
        network="host",
        step_limit=3,
        cost_limit=0.5,
        max_tokens=12,
        temperature=0.7,
        config={"agent": {"instance_template": "{{task}}"}},
    )
    workdir, env = tmp_path / "ep", dict(SESSION_ENV)
    workdir.mkdir()
    argv = agent.prepare(workdir, "12+34=", list(agent.command), env)
    home = workdir / "home"
    assert argv == [
        sys.executable,
        "-c",
        "mini.yaml",
        "-c",
        str(home / "loongsage.yaml"),
        "-o",
        str(home / "trajectory.json"),
    ]
    overlay = json.loads((home / "loongsage.yaml").read_text())
    assert overlay["run"] == {"task": "12+34="}
    assert overlay["agent"] == {
        "agent_class": "default",
        "step_limit": 3,
        "cost_limit": 0.5,
        "instance_template": "{{task}}",
    }
    assert overlay["environment"] == {"environment_class": "local", "cwd": str(workdir / "project"), "timeout": 60}
    model = overlay["model"]
    assert model["model_name"] == "openai/loongsage" and model["model_class"] == "litellm"
    assert model["model_kwargs"] == {
        "api_base": SESSION_ENV["OPENAI_BASE_URL"],
        "api_key": "sk-session",
        "drop_params": True,
        "max_tokens": 12,
        "temperature": 0.7,
    }
    registry = json.loads(Path(model["litellm_model_registry"]).read_text())
    assert registry["openai/loongsage"]["litellm_provider"] == "openai"
    assert registry["openai/loongsage"]["input_cost_per_token"] > 0  # mini refuses a cost of 0 without a flag
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["LITELLM_OFFLINE_MODE"] == "true"
    assert env["MSWEA_CONFIGURED"] == "true" and env["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] == "1"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(str(home)) and env["HOME"] == str(home)


# --------------------------------------------------------------------------------- the audit
def test_the_audit_reads_destinations_by_kind(tmp_path):
    log = tmp_path / "trace"
    log.write_text(
        "\n".join(
            [
                '7 connect(5, {sa_family=AF_INET, sin_port=htons(41234), sin_addr=inet_addr("127.0.0.1")}, 16)'
                " = -1 EINPROGRESS (Operation now in progress)",
                '7 connect(5, {sa_family=AF_INET, sin_port=htons(41234), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
                '8 connect(6, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.53")}, 16)'
                " = -1 ENETUNREACH (Network is unreachable)",
                '8 sendto(6, "\\x12", 30, MSG_NOSIGNAL, {sa_family=AF_INET, sin_port=htons(53), '
                'sin_addr=inet_addr("127.0.0.53")}, 16) = -1 ECONNREFUSED (Connection refused)',
                "9 connect(7, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), "
                'inet_pton(AF_INET6, "2606:4700::1", &sin6_addr), sin6_scope_id=0}, 28 <unfinished ...>',
                "9 connect(8, {sa_family=AF_INET6, sin6_port=htons(80), sin6_flowinfo=htonl(0), "
                'inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 0',
                '9 connect(9, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT (No such file)',
                '9 sendto(10, "GET / HTTP/1.1"..., 14, 0, NULL, 0) = 14',
                "9 sendmsg(11, {msg_name={sa_family=AF_NETLINK, nl_pid=0, nl_groups=00000000}, ...}, 0) = 20",
            ]
        )
    )
    assert netaudit.report(log) == {
        "outside": {
            "10.0.0.53:53": {"calls": 1, "result": "ENETUNREACH"},
            "127.0.0.53:53": {"calls": 1, "result": "ECONNREFUSED"},  # a lookup, even through loopback
            "[2606:4700::1]:443": {"calls": 1, "result": None},
        },
        "loopback": {
            "127.0.0.1:41234": {"calls": 2, "result": "ok"},
            "[::ffff:127.0.0.1]:80": {"calls": 1, "result": "ok"},
        },
        "unix": {"/var/run/nscd/socket": {"calls": 1, "result": "ENOENT"}},
    }
    assert netaudit.report(tmp_path / "missing")["error"].startswith("no strace log")


@needs_audit
def test_the_audit_catches_a_program_that_phones_home(long_engine, tokenizer, tmp_path):
    agent = CommandAgent(
        command=[sys.executable, str(PROGRAMS / "phone_home.py")],
        network="loopback_only",
        audit_network=True,
        log_dir=str(tmp_path),
    )
    (t,) = run_group(long_engine, tokenizer, agent)
    program = t.metadata["program"]
    assert t.status is Status.OK and program["exit_code"] == 0, program["stderr_tail"]
    tried = json.loads(program["stdout_tail"].strip().splitlines()[-1])["tried"]
    assert tried == {"lookup": "gaierror", "connect": "OSError"}
    audit = program["network_audit"]
    assert audit["outside"]["10.255.255.1:443"]["result"] == "ENETUNREACH"
    assert len(audit["loopback"]) == 1 and next(iter(audit["loopback"])).startswith("127.0.0.1:")  # the relay
    # the episode's summary in log_dir carries the same audit
    summary = json.loads((tmp_path / (Path(program["logs"]).name + ".json")).read_text())
    assert summary["network_audit"] == audit and "stderr_tail" not in summary


@needs_audit
def test_opencode_unprepared_tries_npm_and_the_audit_sees_it(long_engine, tokenizer, opencode_dir):
    class Unprepared(OpenCodeAgent):
        def prepare(self, workdir, prompt, argv, env):
            argv = super().prepare(workdir, prompt, argv, env)
            os.unlink(workdir / "home" / ".config" / "opencode" / "node_modules")  # as OpenCode left to itself
            return argv

    params = dict(
        install_dir=str(opencode_dir),
        max_tokens=4,
        context_tokens=8192,
        tools=["bash"],
        system_prompt="Be brief.",
        audit_network=True,
        timeout_s=120,
    )
    prepared, unprepared = OpenCodeAgent(**params), Unprepared(**params)
    (good,) = run_group(long_engine, tokenizer, prepared)
    (bad,) = run_group(long_engine, tokenizer, unprepared)
    for t in (good, bad):
        assert t.status is Status.OK and t.metadata["program"]["exit_code"] == 0, t.metadata["program"]
    assert good.metadata["program"]["network_audit"]["outside"] == {}
    # its npm install of @opencode-ai/plugin starts with a name lookup, refused at once in the jail
    outside = bad.metadata["program"]["network_audit"]["outside"]
    assert outside and all(key.endswith(":53") or key.endswith(":443") for key in outside), outside
