"""AgentFlow's entry point (group ``loongsage``): the ``qwen3`` chat parser, the ``gateway`` run
service, its middlewares, the agents that reach the policy through it, and the calculator task
(data source and reward ``tool_calc``, model builder ``tiny_tool_calc``)."""

from __future__ import annotations

from loongsage.agentflow.blackbox import CommandAgent, FileReward
from loongsage.agentflow.chat_agent import ChatAgent
from loongsage.agentflow.middlewares import MIDDLEWARES
from loongsage.agentflow.mini_swe import MiniSweAgent
from loongsage.agentflow.opencode import OpenCodeAgent
from loongsage.agentflow.parsers import Qwen3ChatParser
from loongsage.agentflow.run_service import GatewayService
from loongsage.agentflow.tool_agent import ToolAgent
from loongsage.agentflow.tool_calc import ToolCalcReward, ToolCalcTask
from loongsage.agentflow.warmstart import TinyToolCalcModel
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_backends() -> Factories:
    return {"qwen3": Qwen3ChatParser, "gateway": GatewayService, "tiny_tool_calc": TinyToolCalcModel}


@hookimpl
def loongsage_agents() -> Factories:
    # chat: one chat completion per group; tool_agent: multi-turn tool calling (tool_agent.py);
    # command: any program, black box (blackbox.py);
    # mini_swe_agent, opencode: those CLIs unmodified, configured for the gateway (mini_swe.py, opencode.py)
    return {"chat": ChatAgent, "tool_agent": ToolAgent, "command": CommandAgent, "mini_swe_agent": MiniSweAgent,
            "opencode": OpenCodeAgent}


@hookimpl
def loongsage_data_sources() -> Factories:
    return {"tool_calc": ToolCalcTask}


@hookimpl
def loongsage_rewards() -> Factories:
    # file_reward: what a command agent's program wrote to {workdir}/reward
    return {"file_reward": FileReward, "tool_calc": ToolCalcReward}


@hookimpl
def loongsage_gateway_middlewares() -> Factories:
    return dict(MIDDLEWARES)
