"""AgentFlow's entry point (group ``loongsage``): the ``qwen3`` chat parser and the ``gateway`` run service."""

from __future__ import annotations

from loongsage.agentflow.blackbox import CommandAgent, FileReward
from loongsage.agentflow.parsers import Qwen3ChatParser
from loongsage.agentflow.run_service import GatewayService
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_backends() -> Factories:
    return {"qwen3": Qwen3ChatParser, "gateway": GatewayService}


# the black-box program runner (agent "command") and the reward its programs may write (blackbox.py)
@hookimpl
def loongsage_agents() -> Factories:
    return {"command": CommandAgent}


@hookimpl
def loongsage_rewards() -> Factories:
    return {"file_reward": FileReward}
