"""The twelve extension points of LoongSage.

Every hook takes no arguments and returns a mapping ``name -> factory``. The plugin manager
(:mod:`loongsage.core.plugins`) merges the mappings of all plugins, refuses a name that two
plugins provide (naming both), and on a miss lists the names it knows. A recipe selects an
entry by name only, with its parameters beside it::

    algorithm:
      advantage: {name: grpo, params: {std_normalize: true}}

A *factory* is any callable whose keyword parameters are the entry's parameters (a dataclass is
the usual choice): its signature is the schema the recipe's ``params`` are validated against
before any Ray actor starts, and calling it returns the implementation. The contract each
implementation fulfils is written under its hook below; the record types live in
:mod:`loongsage.core.types`.

Plugins register by the entry-point group ``loongsage`` (one module per distribution holding
``@hookimpl`` functions named after these specs) or by listing a module under ``plugins:`` in the
config. Load order: built-ins, then entry points, then ``plugins:`` modules. No hook is
``firstresult``: every plugin contributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

PROJECT = "loongsage"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Factories = Mapping[str, Callable[..., Any]]


@hookspec
def loongsage_agents() -> Factories:
    """Agents: turn one data record into trajectories.

    The implementation is ``async run(record: DataRecord, ctx: AgentContext) -> list[Trajectory]``.
    ``ctx`` gives the engine client (token-in, token-out ``generate``), the tokenizer and the
    source's sampling parameters. A single-turn agent calls the engine directly with token ids; a
    chat agent talks to the gateway's chat-completion endpoint and the gateway rebuilds the tokens.
    Called once per prompt; returns the group of ``n`` trajectories of that prompt.
    """


@hookspec
def loongsage_rewards() -> Factories:
    """Rewards: score one finished trajectory.

    The implementation is ``__call__(trajectory: Trajectory, record: DataRecord) -> float`` (or an
    awaitable of one). ``trajectory.response_text`` holds the decoded response; the token ids stay
    the truth for training. A wrapper reward names the reward it wraps in its params as a
    ``{name, params}`` spec and declares ``nested = {param: "reward"}`` plus ``bind(**built)``: the
    registry builds the inner entry (validated like any other) and binds it. Raise :class:`loongsage.core.types.RewardInfraError` when the scorer
    itself failed (a sandbox died, a judge timed out): the trajectory is then marked ``failed``
    and kept out of group statistics instead of being scored 0.
    """


@hookspec
def loongsage_data_sources() -> Factories:
    """Data sources: dataset readers and synthetic task generators.

    The implementation is a map-style :class:`loongsage.core.types.DataSource`: ``__len__`` and
    ``__getitem__(i) -> DataRecord``. Map-style access is what makes the data position exact on
    resume. Malformed rows are reported by index and skipped or rejected by the reader's
    ``on_bad_row`` policy.
    """


@hookspec
def loongsage_advantage_estimators() -> Factories:
    """Advantage estimators (GRPO, RLOO, REINFORCE++, GAE, ...).

    The implementation is ``__call__(inp: AdvantageInput) -> Tensor[B, T]`` returning per-token
    advantages (zero outside ``inp.response_mask``). It sees the whole step's batch, so group and
    batch statistics need no collective. Class attribute ``needs_values: bool`` asks the trainer for
    critic values first.
    """


@hookspec
def loongsage_policy_losses() -> Factories:
    """Policy losses (PPO-clip with clip-higher and dual-clip, GSPO, CISPO, NLL for SFT).

    The implementation is ``__call__(inp: PolicyLossInput) -> LossOutput``: an *unreduced*
    per-token loss ``[B, T]`` plus per-token metric tensors. The trainer aggregates with global
    denominators (see :mod:`loongsage.core.aggregation`), so micro-batching and DP size cannot
    change the result. Class attribute ``needs_old_logprobs: bool`` (default True) tells the trainer
    whether to recompute old log-probs before the first update.
    """


@hookspec
def loongsage_kl_estimators() -> Factories:
    """KL estimators (k1, k2, k3, low-var, unbiased; top-k and full-vocab KL, JSD for MOPD).

    Class attribute ``consumes`` is one of ``"logprobs"``, ``"topk"``, ``"full_vocab"``: the
    trainer fetches only what the chosen estimator needs. With ``"logprobs"`` the implementation is
    ``__call__(logprobs, ref_logprobs, *, old_logprobs=None) -> Tensor [B, T]`` over sampled-token
    log-probs ``[B, T]``, an estimate of KL(pi || ref); ``old_logprobs`` is passed when the
    instance's ``needs_old_logprobs`` is true (the unbiased, ratio-weighted forms). With ``"topk"``
    (the instance's ``k`` says how many reference tokens per position) or ``"full_vocab"`` it is
    ``__call__(logprobs, ref_logprobs) -> Tensor [B, T]`` over distributions ``[B, T, K]``: the
    policy's and the reference's log-probs on the reference's top-k tokens, or on the whole
    vocabulary. The reference is a frozen copy of the start (``algorithm.kl``, log-prob entries
    only) or a data source's teacher (``algorithm.distill.divergence``, MOPD).
    """


@hookspec
def loongsage_corrections() -> Factories:
    """Train-inference consistency corrections (IS token/seq/geo x clip/mask, M2PO, OPSM).

    The implementation is ``__call__(inp: CorrectionInput) -> CorrectionOutput``: a per-token
    weight applied to the loss (no gradient), an updated loss mask, and per-token metrics. Masking
    corrections decide once per optimizer mini-batch across all DP ranks and document how they
    treat the loss denominator.
    """


@hookspec
def loongsage_data_filters() -> Factories:
    """Group filters applied after rewards (dynamic sampling, status, overlong).

    The implementation is ``__call__(group: list[Trajectory]) -> bool``: keep the group or drop it.
    Dropped groups may be refilled from oversampling by the scheduler. A filter may also define
    ``excludes_from_loss(trajectory) -> bool``: such a sample stays in its group's advantage
    statistics but leaves the loss (DAPO's overlong filtering masks truncated samples this way).
    """


@hookspec
def loongsage_rollout_schedulers() -> Factories:
    """Rollout schedulers: how many groups may be in flight (sync, one-step-off, fully async).

    The implementation is a :class:`loongsage.core.types.RolloutScheduler`: a pure decision over
    counters (``groups_to_dispatch``), so it is tested without Ray.
    """


@hookspec
def loongsage_sandboxes() -> Factories:
    """Sandbox backends (isolated local process, docker, k8s).

    The implementation offers ``create() -> id``, ``exec(id, cmd, timeout)``, ``put``/``get`` files
    and ``delete(id)``; every sandbox has an owner and a deadline, and the pool reaps orphans.
    """


@hookspec
def loongsage_gateway_middlewares() -> Factories:
    """Middlewares of the chat-completion gateway (request/response rewriting, logging, limits)."""


@hookspec
def loongsage_backends() -> Factories:
    """Infrastructure backends, each factory declaring its ``kind`` as a class attribute.

    Kinds: ``trainer`` (torch, megatron), ``engine`` (native, sglang), ``teacher``, ``transport``
    (cpu, ipc, nccl), ``tracker`` (jsonl, tensorboard, wandb), ``chat_parser`` and
    ``model_builder`` (builds an HF model folder offline, e.g. the tiny embedded model). Names are
    unique within a kind.
    """


HOOK_NAMES: tuple[str, ...] = (
    "loongsage_agents",
    "loongsage_rewards",
    "loongsage_data_sources",
    "loongsage_advantage_estimators",
    "loongsage_policy_losses",
    "loongsage_kl_estimators",
    "loongsage_corrections",
    "loongsage_data_filters",
    "loongsage_rollout_schedulers",
    "loongsage_sandboxes",
    "loongsage_gateway_middlewares",
    "loongsage_backends",
)
