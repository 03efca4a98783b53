"""The contracts: what every plugin's product and every backend must provide.

One :class:`typing.Protocol` per extension point (what a hook's factory returns) and per backend
kind. Each says in which process its implementation runs and how often the framework calls it,
and declares its *capability flags*: attributes with a default that tell the framework what an
entry needs or offers (an advantage estimator's ``needs_values``, a KL estimator's ``consumes``).
The registry (:mod:`loongsage.core.plugins`) checks every entry against its Protocol when it loads
and when it builds it (:mod:`loongsage.core.contract_check`), setting the flags an entry leaves out
to their defaults, and refuses a problem in one line naming the entry, its provider and the member::

    advantage 'my_adv' (from config plugins: my_pkg.plugin): missing __call__(inp) of AdvantageEstimator

So the framework reads the flags directly: a capability is declared as a flag, never found by
reading an implementation's parameter names or probing for an attribute. The flags the registry
needs before anything is built (a backend's ``kind``, which picks its Protocol, its ``preflight``, a
tracker's ``receives``) are read off the factory itself (:data:`FACTORY_FLAGS`, :class:`Backend`).
A few reads in the core still go through ``getattr`` with a default: a trainer's ``data_parallel``
(:mod:`loongsage.core.workers`) and its class's ``add_teacher`` (:mod:`loongsage.core.distill`), an
engine's ``weight_receiver`` (:mod:`loongsage.core.workers`) and a divergence's ``partial``
(:mod:`loongsage.core.loss`); in the plugin packages, the loss closure's ``reads_vocab_shards`` (the
megatron trainer).

Kinds of member, as written in the Protocols:

* ``def name(...)``: a method, required (called with the Protocol's required parameters);
* ``name: ClassVar[T] = default``: a flag, fixed per implementation;
* ``name: T = default``: a flag that may depend on the entry's params (a property, or a field);
* ``name: ClassVar[Callable[[A], R] | None] = None``: an optional method (``None``: not offered;
  a method when it is, called with the listed arguments);
* ``name: T`` without a default, or a property: an attribute the built object must have.

Some members are required only when a flag asks for them (:data:`REQUIRED_WHEN`): an advantage
estimator that ``needs_values`` also gives the critic its targets (``returns``), say; and a flag
may add keyword arguments to a call (:data:`CALLED_WITH`): a reward that ``takes_context`` is
called with ``ctx=``.

An implementation may subclass its Protocol to inherit the defaults (the built-ins do) or not;
either way it is checked structurally. The data source and rollout scheduler Protocols live in
:mod:`loongsage.core.types` beside the records they exchange and are re-exported here.

The Protocols are split by concern; import them from here, where every name is re-exported:

* :mod:`~loongsage.core.contracts.rollout`: agents, rewards (:class:`RewardContext`), sandboxes
  (:class:`SandboxOwner`, :class:`ExecResult`), the chat gateway's middlewares and parsers;
* :mod:`~loongsage.core.contracts.algorithms`: advantage estimators, policy losses, KL estimators,
  corrections, data filters and the loss closure a trainer is handed (:class:`LossFunction`);
* :mod:`~loongsage.core.contracts.models`: trainers (:class:`Critic`), engines, teachers, weight
  transports (:class:`TransportReceiver`) and model builders;
* :mod:`~loongsage.core.contracts.run`: trackers and run services;
* :mod:`~loongsage.core.contracts.tables`: the registry's index (:data:`HOOKS`, :data:`BACKENDS`,
  :class:`Backend`, :data:`FACTORY_FLAGS`, :data:`REQUIRED_WHEN`, :data:`CALLED_WITH`, :class:`When`), derived from the
  hookspecs and the Protocols' ``kind``.
"""

from __future__ import annotations

from loongsage.core.contracts.algorithms import (
    AdvantageEstimator,
    Correction,
    DataFilter,
    KLEstimator,
    LossFunction,
    PolicyLoss,
)
from loongsage.core.contracts.models import (
    Critic,
    Engine,
    ModelBuilder,
    Teacher,
    Trainer,
    Transport,
    TransportReceiver,
)
from loongsage.core.contracts.rollout import (
    Agent,
    ChatParser,
    ExecResult,
    GatewayMiddleware,
    Reward,
    RewardContext,
    Sandbox,
    SandboxOwner,
)
from loongsage.core.contracts.run import RunService, Tracker, TrackerArg
from loongsage.core.contracts.tables import (
    BACKENDS,
    CALLED_WITH,
    FACTORY_FLAGS,
    HOOKS,
    REQUIRED_WHEN,
    Backend,
    When,
)
from loongsage.core.types import DataSource, RolloutScheduler

__all__ = [
    "AdvantageEstimator",
    "Agent",
    "BACKENDS",
    "Backend",
    "CALLED_WITH",
    "ChatParser",
    "Correction",
    "Critic",
    "DataFilter",
    "DataSource",
    "Engine",
    "ExecResult",
    "FACTORY_FLAGS",
    "GatewayMiddleware",
    "HOOKS",
    "KLEstimator",
    "LossFunction",
    "ModelBuilder",
    "PolicyLoss",
    "REQUIRED_WHEN",
    "Reward",
    "RewardContext",
    "RolloutScheduler",
    "RunService",
    "Sandbox",
    "SandboxOwner",
    "Teacher",
    "Tracker",
    "TrackerArg",
    "Trainer",
    "Transport",
    "TransportReceiver",
    "When",
]
