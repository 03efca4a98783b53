"""The twelve extension points of LoongSage.

Every hook takes no arguments and returns a mapping ``name -> factory``. The plugin manager
(:mod:`loongsage.core.plugins`) merges the mappings of all plugins, refuses a name that two
plugins provide (naming both), and on a miss lists the names it knows. A recipe selects an
entry by name only, with its parameters beside it::

    algorithm:
      advantage: {name: grpo, params: {std_normalize: true}}

A *factory* is any callable whose keyword parameters are the entry's parameters (a dataclass is
the usual choice): its signature is the schema the recipe's ``params`` are validated against
before any Ray actor starts, and calling it returns the implementation. What the implementation
must provide is a ``typing.Protocol`` of :mod:`loongsage.core.contracts`, named under each hook
below (the spec is the contract): its methods, its capability flags with their defaults, the
process it runs in and how often it is called. The registry checks every entry against it when it
loads (a class) or builds (what a factory function returns) the entry. The record types live in
:mod:`loongsage.core.types`.

Plugins register by the entry-point group ``loongsage`` (one module per distribution holding
``@hookimpl`` functions named after these specs) or by listing a module under ``plugins:`` in the
config. Load order: built-ins, then entry points, then ``plugins:`` modules. No hook is
``firstresult``: every plugin contributes.

Each spec is declared once, below, with the registry *category* its entries go to and the name of
its contract; :data:`HOOKS` collects them as the specs are defined, and everything else that names
a hook (the registry's tables, the contracts' index, ``loongsage plugins``, the checks on plugin
modules) reads :data:`HOOKS` or the views of it here (:data:`HOOK_NAMES`, :data:`CATEGORIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

PROJECT = "loongsage"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Factories = Mapping[str, Callable[..., Any]]

BACKEND = "backend"
"""The category of ``loongsage_backends``: each of its entries goes to the table of the ``kind`` it
declares (:data:`loongsage.core.contracts.BACKENDS`), not to one table of the hook's."""


@dataclass(frozen=True)
class Hook:
    """One extension point as the registry sees it."""

    name: str  # the spec's name, which a plugin's @hookimpl function takes
    category: str  # the registry table its entries go to (BACKEND: the table of each entry's kind)
    contract: str | None  # the Protocol of loongsage.core.contracts its entries implement (backends: per kind)


HOOKS: dict[str, Hook] = {}
"""Every hook by name, in the order the specs are declared; filled by :func:`_spec`."""


def _spec(category: str, contract: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a function as a hookspec and enter it in :data:`HOOKS`."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        HOOKS[fn.__name__] = Hook(fn.__name__, category, contract)
        return hookspec(fn)

    return mark


@_spec("agent", "Agent")
def loongsage_agents() -> Factories:
    """Agents: turn one data record into its group of trajectories.

    Contract: :class:`loongsage.core.contracts.Agent` (``async run(record, ctx)``).
    """


@_spec("reward", "Reward")
def loongsage_rewards() -> Factories:
    """Rewards: score one finished trajectory (a wrapper reward builds and binds the reward it wraps).

    Contract: :class:`loongsage.core.contracts.Reward` (``__call__(trajectory, record)``; ``takes_context``,
    ``nested``, ``bind``).
    """


@_spec("data_source", "DataSource")
def loongsage_data_sources() -> Factories:
    """Data sources: map-style dataset readers and synthetic task generators.

    Contract: :class:`loongsage.core.contracts.DataSource` (``__len__``, ``__getitem__(index)``).
    """


@_spec("advantage", "AdvantageEstimator")
def loongsage_advantage_estimators() -> Factories:
    """Advantage estimators (GRPO, RLOO, REINFORCE++, GAE, ...): per-token advantages of a step.

    Contract: :class:`loongsage.core.contracts.AdvantageEstimator` (``__call__(inp)``; ``needs_values``, ...).
    """


@_spec("policy_loss", "PolicyLoss")
def loongsage_policy_losses() -> Factories:
    """Policy losses (PPO-clip with clip-higher and dual-clip, GSPO, CISPO, NLL for SFT), unreduced.

    Contract: :class:`loongsage.core.contracts.PolicyLoss` (``__call__(inp)``; ``needs_old_logprobs``, ...).
    """


@_spec("kl", "KLEstimator")
def loongsage_kl_estimators() -> Factories:
    """KL estimators (k1, k2, k3, low-var, unbiased) and MOPD's distribution divergences (top-k, JSD).

    Contract: :class:`loongsage.core.contracts.KLEstimator` (``__call__(logprobs, ref_logprobs)``; ``consumes``).
    """


@_spec("correction", "Correction")
def loongsage_corrections() -> Factories:
    """Train-inference consistency corrections (IS token/seq/geo x clip/mask, M2PO, OPSM).

    Contract: :class:`loongsage.core.contracts.Correction` (``__call__(inp)``; ``needs_logprobs``).
    """


@_spec("data_filter", "DataFilter")
def loongsage_data_filters() -> Factories:
    """Group filters applied after rewards (dynamic sampling, status, overlong sample masks).

    Contract: :class:`loongsage.core.contracts.DataFilter` (``__call__(group)``; ``excludes_from_loss``).
    """


@_spec("rollout_scheduler", "RolloutScheduler")
def loongsage_rollout_schedulers() -> Factories:
    """Rollout schedulers: when to dispatch groups (sync, one-step-off, fully async windows).

    Contract: :class:`loongsage.core.contracts.RolloutScheduler` (``groups_to_dispatch(state)``).
    """


@_spec("sandbox", "Sandbox")
def loongsage_sandboxes() -> Factories:
    """Sandbox backends for agents and rewards (``local``: a bubblewrap jail per sandbox; ``docker``:
    a container per sandbox over any Docker Engine API).

    Contract: :class:`loongsage.core.contracts.Sandbox`: ``create(owner, deadline) -> id``,
    ``exec(id, cmd, timeout) -> ExecResult`` (exit code or signal, capped output, ``truncated``,
    ``timed_out``, wall time), ``put``/``get`` of bytes confined to the work directory, ``delete``
    (every process killed, everything removed); optionally ``reset`` for reuse (``reusable``) and
    ``close`` (every sandbox it still holds, when the run ends).
    loongsage-sandbox ships both and the pool that keeps sandboxes warm and reaps orphans.
    """


@_spec("gateway_middleware", "GatewayMiddleware")
def loongsage_gateway_middlewares() -> Factories:
    """Middlewares of the chat-completion gateway (request/response rewriting, logging, limits).

    Contract: :class:`loongsage.core.contracts.GatewayMiddleware` (``async __call__(request, call_next)``).
    """


@_spec(BACKEND)
def loongsage_backends() -> Factories:
    """Infrastructure backends, each factory declaring its ``kind`` (a class attribute, or an attribute
    of a factory function; :class:`~loongsage.core.contracts.Backend`).

    Kinds and contracts: ``trainer`` (torch, torch_critic, megatron;
    :class:`~loongsage.core.contracts.Trainer`, as the critic :class:`~loongsage.core.contracts.Critic`),
    ``engine`` (native, sglang; :class:`~loongsage.core.contracts.Engine`), ``teacher`` (embedded,
    megatron; :class:`~loongsage.core.contracts.Teacher`), ``transport`` (cpu; ipc and broadcast from
    loongsage-sync; :class:`~loongsage.core.contracts.Transport`), ``tracker`` (jsonl, tensorboard,
    wandb; :class:`~loongsage.core.contracts.Tracker`), ``chat_parser`` (qwen3;
    :class:`~loongsage.core.contracts.ChatParser`), ``model_builder`` (builds an HF model folder
    offline: tiny_arith, random_init, ...; :class:`~loongsage.core.contracts.ModelBuilder`) and
    ``service`` (lives as long as the run and is handed to agents: the chat gateway, the sandbox
    pool; :class:`~loongsage.core.contracts.RunService`). Names are unique within a kind.
    """


HOOK_NAMES: tuple[str, ...] = tuple(HOOKS)
"""The twelve hook names, in declaration order."""

CATEGORIES: dict[str, str] = {h.category: h.name for h in HOOKS.values() if h.category != BACKEND}
"""``{category: hook name}`` of the hooks whose entries share one table (every hook but the backends')."""
