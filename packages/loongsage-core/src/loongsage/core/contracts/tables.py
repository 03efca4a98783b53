"""The registry's index of the contracts: the Protocol of each hook category (:data:`HOOKS`) and
backend kind (:data:`BACKENDS`), what a backend's factory declares to be routed (:class:`Backend`),
the flags read off a factory before it builds anything (:data:`FACTORY_FLAGS`), and the members a
flag makes required or adds to a call (:data:`REQUIRED_WHEN`, :data:`CALLED_WITH`, :class:`When`).

The hooks and their categories are declared once, with the specs (:data:`loongsage.core.hookspecs.HOOKS`);
a backend's kind once, as the ``kind`` flag of its Protocol. Both tables here are derived from those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from loongsage.core import hookspecs
from loongsage.core.contracts.algorithms import AdvantageEstimator, Correction, DataFilter, KLEstimator, PolicyLoss
from loongsage.core.contracts.models import Engine, ModelBuilder, Teacher, Trainer, Transport
from loongsage.core.contracts.rollout import Agent, ChatParser, GatewayMiddleware, Reward, Sandbox
from loongsage.core.contracts.run import RunService, Tracker
from loongsage.core.types import DataSource, RolloutScheduler

_HOOK_PROTOCOLS: dict[str, type] = {
    p.__name__: p
    for p in (
        Agent,
        Reward,
        DataSource,
        AdvantageEstimator,
        PolicyLoss,
        KLEstimator,
        Correction,
        DataFilter,
        RolloutScheduler,
        Sandbox,
        GatewayMiddleware,
    )
}

HOOKS: dict[str, type] = {
    h.category: _HOOK_PROTOCOLS[h.contract] for h in hookspecs.HOOKS.values() if h.contract is not None
}  # the backends hook: a Protocol per kind, below
"""The Protocol each hook's entries implement, by registry category (in the hooks' order)."""


BACKENDS: dict[str, type] = {
    p.kind: p
    for p in (
        Trainer,
        Engine,
        Teacher,
        Transport,
        Tracker,
        ChatParser,
        ModelBuilder,
        RunService,
    )
}
"""The Protocol each backend kind implements, by kind (the default of the Protocol's ``kind`` flag)."""


class Backend(Protocol):
    """What ``loongsage_backends`` maps a name to: a factory that declares the kind of backend it
    builds, as a class attribute (or an attribute of a factory function). Read by the registry
    when it loads the plugin, to pick the table and the Protocol (:data:`BACKENDS`) of the entry."""

    kind: ClassVar[str | None] = None
    """One of the keys of :data:`BACKENDS`; None (left out) is refused naming them."""


FACTORY_FLAGS: tuple[str, ...] = ("kind", "preflight", "receives", "doctor")
"""Flags the registry reads off a factory before it builds anything: declared as class attributes
of a class factory or as attributes of a factory function, checked and defaulted at load either
way (the Protocol's other flags are read off what the factory builds)."""


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


CALLED_WITH: dict[type, dict[str, tuple[When, tuple[str, ...]]]] = {
    Reward: {"__call__": (When("takes_context"), ("ctx",))},
}
"""Keyword arguments a method is also called with while a flag asks for them:
``{Protocol: {method: (When(flag, value), keywords)}}`` (a reward that ``takes_context`` is called
``__call__(trajectory, record, ctx=...)``, so its call must take ``ctx``)."""
