"""The rollout side of a run, split by concern.

``router``      least-loaded routing over engine replicas, sticky per session
``agents``      what an agent sees (:class:`AgentContext`) and the single-turn agent
``seeds``       per-group sampling seeds that follow the data stream
``replay``      per-group call logs: groups in flight saved with checkpoints and carried on exactly
``schedulers``  when to dispatch (pure decisions over counters)
``service``     the rollout service: dispatch, scoring, filters, refill, the next training batch
"""

from loongsage.core.rollout.agents import AgentContext, SingleTurnAgent, encode_prompt, gather_groups
from loongsage.core.rollout.router import EngineRouter
from loongsage.core.rollout.schedulers import SyncScheduler
from loongsage.core.rollout.seeds import request_seed
from loongsage.core.rollout.service import RolloutService, rollout_metrics

__all__ = [
    "AgentContext",
    "EngineRouter",
    "RolloutService",
    "SingleTurnAgent",
    "SyncScheduler",
    "encode_prompt",
    "gather_groups",
    "request_seed",
    "rollout_metrics",
]
