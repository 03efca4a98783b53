"""AgentFlow's entry point (group ``loongsage``): the ``qwen3`` chat parser, the ``gateway`` run
service, its middlewares, the agents that reach the policy through it, and the calculator task
(data source and reward ``tool_calc``, model builder ``tiny_tool_calc``)."""

from __future__ import annotations

from loongsage.agentflow.agents.blackbox import CommandAgent, FileReward
from loongsage.agentflow.agents.chat_agent import ChatAgent
from loongsage.agentflow.agents.mini_swe import MiniSweAgent
from loongsage.agentflow.agents.opencode import OpenCodeAgent
from loongsage.agentflow.agents.tool_agent import ToolAgent
from loongsage.agentflow.chat.parsers import Qwen3ChatParser
from loongsage.agentflow.gateway.middlewares import MIDDLEWARES
from loongsage.agentflow.gateway.run_service import GatewayService
from loongsage.agentflow.tasks.tool_calc import ToolCalcReward, ToolCalcTask
from loongsage.agentflow.tasks.warmstart import TinyToolCalcModel
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_backends() -> Factories:
    return {"qwen3": Qwen3ChatParser, "gateway": GatewayService, "tiny_tool_calc": TinyToolCalcModel}


@hookimpl
def loongsage_agents() -> Factories:
    # chat: one chat completion per group; tool_agent: multi-turn tool calling (agents/tool_agent.py);
    # command: any program, black box (agents/blackbox.py); mini_swe_agent, opencode: those CLIs
    # unmodified, configured for the gateway (agents/mini_swe.py, agents/opencode.py)
    return {
        "chat": ChatAgent,
        "tool_agent": ToolAgent,
        "command": CommandAgent,
        "mini_swe_agent": MiniSweAgent,
        "opencode": OpenCodeAgent,
    }


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
