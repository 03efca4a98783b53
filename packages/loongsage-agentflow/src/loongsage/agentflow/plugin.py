"""AgentFlow's entry point (group ``loongsage``): the ``qwen3`` chat parser, the ``gateway`` run
service, its middlewares, and the agents that reach the policy through it."""

from __future__ import annotations

from loongsage.agentflow.blackbox import CommandAgent, FileReward
from loongsage.agentflow.chat_agent import ChatAgent
from loongsage.agentflow.middlewares import MIDDLEWARES
from loongsage.agentflow.mini_swe import MiniSweAgent
from loongsage.agentflow.opencode import OpenCodeAgent
from loongsage.agentflow.parsers import Qwen3ChatParser
from loongsage.agentflow.run_service import GatewayService
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_backends() -> Factories:
    return {"qwen3": Qwen3ChatParser, "gateway": GatewayService}


@hookimpl
def loongsage_agents() -> Factories:
    # chat: one chat completion per group; command: any program, black box (blackbox.py)
    # mini_swe_agent, opencode: those CLIs unmodified, configured for the gateway (mini_swe.py, opencode.py)
    return {"chat": ChatAgent, "command": CommandAgent, "mini_swe_agent": MiniSweAgent, "opencode": OpenCodeAgent}


@hookimpl
def loongsage_rewards() -> Factories:
    return {"file_reward": FileReward}  # what a command agent's program wrote to {workdir}/reward


@hookimpl
def loongsage_gateway_middlewares() -> Factories:
    return dict(MIDDLEWARES)
