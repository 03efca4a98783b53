"""The registry's index of the contracts: the Protocol of each hook category (:data:`HOOKS`) and
backend kind (:data:`BACKENDS`), and the members a flag makes required (:data:`REQUIRED_WHEN`,
:class:`When`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongsage.core.contracts.algorithms import AdvantageEstimator, Correction, DataFilter, KLEstimator, PolicyLoss
from loongsage.core.contracts.models import Engine, ModelBuilder, Teacher, Trainer, Transport
from loongsage.core.contracts.rollout import Agent, ChatParser, GatewayMiddleware, Reward, Sandbox
from loongsage.core.contracts.run import RunService, Tracker
from loongsage.core.types import DataSource, RolloutScheduler

HOOKS: dict[str, type] = {
    "agent": Agent,
    "reward": Reward,
    "data_source": DataSource,
    "advantage": AdvantageEstimator,
    "policy_loss": PolicyLoss,
    "kl": KLEstimator,
    "correction": Correction,
    "data_filter": DataFilter,
    "rollout_scheduler": RolloutScheduler,
    "sandbox": Sandbox,
    "gateway_middleware": GatewayMiddleware,
}
"""The Protocol each hook's entries implement, by registry category."""


BACKENDS: dict[str, type] = {
    "trainer": Trainer,
    "engine": Engine,
    "teacher": Teacher,
    "transport": Transport,
    "tracker": Tracker,
    "chat_parser": ChatParser,
    "model_builder": ModelBuilder,
    "service": RunService,
}
"""The Protocol each backend kind implements, by kind."""


@dataclass(frozen=True)
class When:
    """A member required only while ``flag`` holds ``value`` (``None``: while the flag is truthy)."""

    flag: str
    value: Any = None

    def holds(self, flag_value: Any) -> bool:
        return bool(flag_value) if self.value is None else flag_value == self.value


REQUIRED_WHEN: dict[type, dict[str, When]] = {
    AdvantageEstimator: {"returns": When("needs_values")},
    Reward: {"bind": When("nested")},
    KLEstimator: {"k": When("consumes", "topk")},
    Sandbox: {"reset": When("reusable")},
}
"""Members required only while a flag asks for them: ``{Protocol: {member: When(flag, value)}}``
(an optional method must then not be None)."""
