"""The contracts: what every plugin's product and every backend must provide.

One :class:`typing.Protocol` per extension point (what a hook's factory returns) and per backend
kind. Each says in which process its implementation runs and how often the framework calls it,
and declares its *capability flags*: attributes with a default that tell the framework what an
entry needs or offers (an advantage estimator's ``needs_values``, a KL estimator's ``consumes``).
The framework reads them directly, never probing with ``getattr``; the registry
(:mod:`loongsage.core.plugins`) makes that safe by checking every entry against its Protocol:

* a class factory when the registry loads it: every method present and callable as the Protocol
  calls it, every flag the class declares of the right type, every flag it leaves out set on the
  class to the Protocol's default;
* what any factory builds, when it is built: the same, on the object (flags that depend on the
  entry's params, attributes set by ``__init__``), flags left out set to their default.

A problem is one line naming the entry, its provider and the member::

    advantage 'my_adv' (from config plugins: my_pkg.plugin): missing __call__(inp) of AdvantageEstimator

Kinds of member, as written below:

* ``def name(...)``: a method, required (called with the Protocol's required parameters);
* ``name: ClassVar[T] = default``: a flag, fixed per implementation;
* ``name: T = default``: a flag that may depend on the entry's params (a property, or a field);
* ``name: ClassVar[Callable[[A], R] | None] = None``: an optional method (``None``: not offered;
  a method when it is, called with the listed arguments);
* ``name: T`` without a default, or a property: an attribute the built object must have.

Some members are required only when a flag asks for them (:data:`REQUIRED_WHEN`): an advantage
estimator that ``needs_values`` also gives the critic its targets (``returns``), say.

An implementation may subclass its Protocol to inherit the defaults (the built-ins do) or not;
either way it is checked structurally. The data source and rollout scheduler Protocols live in
:mod:`loongsage.core.types` beside the records they exchange and are re-exported here.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from torch import Tensor

from loongsage.core.types import (
    AdvantageInput,
    CorrectionInput,
    CorrectionOutput,
    DataRecord,
    DataSource,
    GenerationRequest,
    GenerationResult,
    LossOutput,
    PolicyLossInput,
    RolloutScheduler,
    TrainBatch,
    Trajectory,
)

MetricSums = dict[str, tuple[float, float]]  # name -> (sum, count): summed over micro-batches and ranks


# ================================================================================== hooks
class Agent(Protocol):
    """``loongsage_agents``: turns one data record into its group of trajectories.

    Runs in the driver (the controller's process, on the rollout's event loop), concurrently with
    the other prompts of the step. Called once per prompt: the step's, every refill round's, and
    (as a source's ``eval_agent``) every evaluation prompt's.
    """

    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        """The group of ``record``; ``ctx`` (:class:`~loongsage.core.rollout.AgentContext`) holds
        the engine client (token-in, token-out), the tokenizer, the sampling and the group id."""
        ...


class Reward(Protocol):
    """``loongsage_rewards``: scores one finished trajectory.

    Runs in the reward worker actor; called once per trajectory (concurrently when it returns an
    awaitable). Raises :class:`~loongsage.core.types.RewardInfraError` when the scorer itself
    failed: the trajectory is then marked ``failed`` instead of scored 0.
    """

    nested: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    """Wrapped entries: ``{param: category}``. The registry builds the ``{name, params}`` spec each
    such param holds (validated like any entry) and hands it to ``bind``."""
    bind: ClassVar[Callable[..., Reward] | None] = None
    """``bind(**built) -> Reward``: a copy that calls the built entries (required with ``nested``)."""

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float | Awaitable[float]: ...


class AdvantageEstimator(Protocol):
    """``loongsage_advantage_estimators``: per-token advantages of the whole step batch.

    Runs in the driver, once per step, over every trained row (group and batch statistics need no
    collective). Returns ``[B, T]``, zero outside ``inp.response_mask``.
    """

    needs_values: ClassVar[bool] = False
    """Reads critic values (``inp.values``): the run trains a critic, and ``returns`` is required."""
    uses_token_rewards: ClassVar[bool] = False
    """Reads ``inp.token_rewards`` (what ``algorithm.kl_in_reward`` fills)."""
    returns: ClassVar[Callable[[AdvantageInput], Tensor] | None] = None
    """``returns(inp) -> Tensor [B, T]``: the critic's targets for the same input (required with
    ``needs_values``), called once per step right after the advantages."""

    def __call__(self, inp: AdvantageInput) -> Tensor: ...


class PolicyLoss(Protocol):
    """``loongsage_policy_losses``: the unreduced per-token policy loss and its metrics.

    Runs in every trainer rank, once per micro-batch of every optimizer step. The framework
    aggregates with global denominators, so the loss returns ``[B, T]`` and reduces nothing.
    """

    needs_old_logprobs: ClassVar[bool] = True
    """Compares with the pre-update policy: old log-probs are recomputed when a step takes several
    mini-batches (an NLL loss sets False)."""
    supported_aggregations: ClassVar[tuple[str, ...] | None] = None
    """The ``algorithm.aggregation`` modes it is defined for; None: every mode."""

    def __call__(self, inp: PolicyLossInput) -> LossOutput: ...


class KLEstimator(Protocol):
    """``loongsage_kl_estimators``: a per-token divergence, for the reference KL or MOPD's GKD term.

    With ``consumes = "logprobs"`` it reads sampled-token log-probs ``[B, T]`` (an estimate of
    KL(pi || ref)); with ``"topk"`` or ``"full_vocab"`` it reads the student's and the teacher's
    log-probs over a support ``[B, T, K]`` (the teacher's top-``k`` tokens, or the vocabulary).
    Runs in every trainer rank once per micro-batch (KL in the loss, GKD), and in the driver once
    per step (``algorithm.kl_in_reward``).
    """

    consumes: ClassVar[Literal["logprobs", "topk", "full_vocab"]] = "logprobs"
    """What the trainer and the teachers fetch for it; the reference KL takes ``logprobs`` only."""
    needs_old_logprobs: bool = False
    """Pass ``old_logprobs=`` (the unbiased, ratio-weighted forms; may follow the params)."""
    k: int
    """Teacher tokens per position (only with ``consumes = "topk"``)."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, *, old_logprobs: Tensor | None = None) -> Tensor:
        """``[B, T]``; ``old_logprobs`` is passed only when ``needs_old_logprobs``."""
        ...


class Correction(Protocol):
    """``loongsage_corrections``: train-inference consistency weights and masks (no gradient).

    With ``needs_logprobs`` False it runs in the driver once per optimizer mini-batch, over the
    mini-batch of every DP rank, and may change the mask (so the loss denominator); with True it
    runs in every trainer rank once per micro-batch and sets weights only.
    """

    needs_logprobs: ClassVar[bool] = False
    """Reads the current policy's log-probs (``inp.logprobs``), so it is applied per micro-batch."""

    def __call__(self, inp: CorrectionInput) -> CorrectionOutput: ...


class DataFilter(Protocol):
    """``loongsage_data_filters``: keeps or drops a scored group (dynamic sampling, status, overlong).

    Runs in the driver, once per group after rewards (refilled groups included); a dropped group
    may be replaced by a refill. ``excludes_from_loss``, when offered, is called once per trained
    trajectory of the step.
    """

    excludes_from_loss: ClassVar[Callable[[Trajectory], bool] | None] = None
    """Optional ``excludes_from_loss(trajectory) -> bool``: such a sample stays in its group's
    advantage statistics but leaves the loss (DAPO's overlong filtering)."""

    def __call__(self, group: list[Trajectory]) -> bool: ...


class Sandbox(Protocol):
    """``loongsage_sandboxes`` (no backend ships yet; this is the contract one will meet): isolated
    execution for agents and rewards.

    Runs in the actor that owns the sandbox pool; ``create``/``delete`` once per sandbox (one per
    trajectory that needs one), ``exec``/``put``/``get`` once per tool call or file transfer. Every
    sandbox has an owner and a deadline; the pool reaps orphans.
    """

    async def create(self) -> str: ...

    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> tuple[int, str, str]:
        """``(exit code, stdout, stderr)``."""
        ...

    async def put(self, sandbox_id: str, path: str, data: bytes) -> None: ...

    async def get(self, sandbox_id: str, path: str) -> bytes: ...

    async def delete(self, sandbox_id: str) -> None: ...


class GatewayMiddleware(Protocol):
    """``loongsage_gateway_middlewares`` (no gateway ships yet; this is the contract one will
    meet): rewrites, logs or limits chat-completion traffic.

    Runs in the gateway service, once per chat-completion request: it may change the request,
    call ``call_next`` (the rest of the chain) and change the response.
    """

    async def __call__(self, request: dict[str, Any],
                       call_next: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> dict[str, Any]: ...


# ================================================================================ backends
@runtime_checkable
class LossFunction(Protocol):
    """What a trainer's ``train_step`` is handed: the framework's loss closure
    (:class:`~loongsage.core.loss.LossPipeline` for the policy, ``ValueLoss`` for a critic).

    Called in the trainer rank once per micro-batch with the forward's per-token output (log-probs
    or values) ``[B, T]``; returns the weighted loss *sum* and metric sums. A bare callable (a
    test's closure) is no ``LossFunction`` (``isinstance`` tells) and is called without
    ``student_dist``.
    """

    needs_student_distribution: bool = False
    """Pass ``student_dist=``: the policy's log-probs on the teacher's support (MOPD's GKD term)."""

    def __call__(self, logprobs: Tensor, mb: TrainBatch) -> tuple[Tensor, MetricSums]: ...


class Trainer(Protocol):
    """A ``trainer`` backend: one data-parallel rank of the policy (or the critic).

    Built in a trainer worker actor (one per DP rank; the critic in an actor of its own) with the
    framework's ``model_path``, ``dtype`` and ``fp32_lm_head`` plus its ``params``. Per step it is
    asked for log-probs once (when the step needs old or reference log-probs), takes one
    ``train_step`` per mini-batch and exports its weights once; ``save``/``load`` run per
    checkpoint and on resume, ``export_hf`` at the end.
    """

    kind: ClassVar[Literal["trainer"]] = "trainer"
    supports_lora: ClassVar[bool] = False
    """Accepts a ``lora`` param (adapters trained, merged weights exported)."""
    holds_reference: bool = False
    """:meth:`reference_logprobs` answers from this backend (LoRA: the adapters switched off), so
    the KL reference needs no second model; may follow the params."""
    preflight: ClassVar[Callable[..., None] | None] = None
    """Optional classmethod ``preflight(params, model_path, *, world_size)``, run in the driver
    before any actor starts; raises ``ValueError`` naming the param (a LoRA target, say)."""

    def setup_optimizer(self, lr: float, betas: list[float], eps: float, weight_decay: float,
                        grad_clip: float, warmup_steps: int) -> None: ...

    def logprobs(self, batch: TrainBatch, token_budget: int) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies ``[B, T]`` under the current weights (no grad); a
        critic returns its values here (and entropies it ignores)."""
        ...

    def reference_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor | None:
        """The frozen starting policy's log-probs when ``holds_reference``, else None."""
        ...

    def train_step(self, mini_batch: TrainBatch, loss_fn: LossFunction, token_budget: int) -> dict[str, float]:
        """One optimizer step over ``mini_batch`` (every rank calls, an empty batch included):
        metrics, with ``<name>_sum`` / ``<name>_count`` pairs for the loss's metric sums."""
        ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (what an engine loads); every rank calls."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def export_hf(self, path: str, tokenizer: Any) -> None: ...

    def offload(self) -> None:
        """Free the device for a colocated engine (parameters and optimizer state to host)."""
        ...

    def onload(self) -> None: ...

    def param_checksum(self) -> float:
        """A number that changes with the weights (sum of |w|); the first call is the readiness check."""
        ...


class Critic(Trainer, Protocol):
    """A ``trainer`` backend used as PPO's critic (``trainer.critic.backend``): also gives values.

    ``values`` runs in the critic actor once per step, before the advantages.
    """

    def values(self, batch: TrainBatch, token_budget: int) -> Tensor:
        """Per-token values ``[B, T]``, aligned like log-probs (position t: V before token t)."""
        ...


class Engine(Protocol):
    """An ``engine`` backend: one rollout engine replica, token-in, token-out, async per request.

    Built in an engine worker actor (one per replica) with the framework's ``model_path``,
    ``dtype``, ``fp32_lm_head`` and ``seed``. ``generate`` is called once per request (a group's
    ``n`` samples), concurrently; ``update_weights`` once per step (version += 1); the rest around
    weight updates, colocation and evaluation (see docs/plugins.md, "The engine contract").
    """

    kind: ClassVar[Literal["engine"]] = "engine"

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]: ...

    async def abort(self, request_ids: list[str] | None) -> list[GenerationResult]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> int:
        """Forget retained prefix caches; returns how many entries were dropped."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Swap the weights in atomically between steps; returns the new version."""
        ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    @property
    def version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def health(self) -> dict[str, Any]: ...


class Teacher(Protocol):
    """A ``teacher`` backend: a frozen model scoring the student's tokens (MOPD).

    Built in a teacher worker actor (one per distinct teacher spec) with the framework's
    ``model_path`` plus its ``params``; ``score`` is called once per step with the rows of the
    sources it serves.
    """

    kind: ClassVar[Literal["teacher"]] = "teacher"

    def score(self, batch: TrainBatch, topk: int = 0, full_vocab: bool = False) -> dict[str, Tensor | None]:
        """``logprobs`` ``[B, T]`` of the student's tokens, and ``dist_ids`` / ``dist_logprobs``
        (top-k ``[B, T, k]``, or ids None and the full log-softmax) or both None."""
        ...


class Transport(Protocol):
    """A ``transport`` backend: the sender side of the weight sync.

    Built in trainer rank 0's actor; ``push`` is called once per step with the trainer's exported
    tensors and the engine worker handles (which receive buckets and commit the last one).
    """

    kind: ClassVar[Literal["transport"]] = "transport"

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list[Any]) -> dict[str, float]:
        """Send every tensor to every receiver; returns ``sync/*`` statistics."""
        ...


class Tracker(Protocol):
    """A ``tracker`` backend: where every step's metrics go.

    Runs in the driver: ``log`` once per step (and per evaluation), ``close`` once at the end.
    Built with whichever of ``run_dir``, ``run_name``, ``config`` and ``resume`` its signature names.
    """

    kind: ClassVar[Literal["tracker"]] = "tracker"
    preflight: ClassVar[Callable[..., None] | None] = None
    """Optional classmethod ``preflight(params)``, run at config validation; raises ``ValueError``
    with a one-line reason (a missing optional package)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class ChatParser(Protocol):
    """A ``chat_parser`` backend (none ships yet; this is the contract one will meet): splits a
    model family's completion text into the chat-completion message fields.

    Runs in the gateway, once per completion.
    """

    kind: ClassVar[Literal["chat_parser"]] = "chat_parser"

    def parse(self, text: str) -> dict[str, Any]:
        """``{"content", "reasoning_content", "tool_calls"}`` as in an OpenAI chat message."""
        ...


class ModelBuilder(Protocol):
    """A ``model_builder`` backend: makes an HF model folder offline (the tiny embedded model).

    Runs in the driver before any actor starts, once per run per spec (``model.builder``, a
    teacher's ``builder``); an implementation caches what it builds.
    """

    kind: ClassVar[Literal["model_builder"]] = "model_builder"

    def build(self) -> str | Path: ...


# ================================================================================= tables
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
}
"""Members required only while a flag asks for them: ``{Protocol: {member: When(flag, value)}}``
(an optional method must then not be None)."""


# ================================================================================ checking
@dataclass(frozen=True)
class Member:
    """One member of a Protocol, as the checker sees it."""

    name: str
    role: Literal["method", "flag", "attribute"]
    type: Any = Any  # flags and attributes: the declared type (ClassVar unwrapped)
    default: Any = None  # flags: the default
    class_level: bool = False  # flags: declared ClassVar (fixed per implementation)
    signature: inspect.Signature | None = None  # methods: without self

    @property
    def optional_method(self) -> bool:
        """A flag whose value is a method or None (``excludes_from_loss``, ``returns``)."""
        return self.role == "flag" and _callable_args(self.type) is not None

    def describe(self) -> str:
        if self.role == "method":
            return f"{self.name}{_plain(self.signature)}"
        args = _callable_args(self.type)
        if args is not None:
            return f"{self.name}({'...' if args is Ellipsis else ', '.join(_type_name(a) for a in args)})"
        return f"{self.name}: {_type_name(self.type)}"


_DUNDERS = ("__call__", "__len__", "__getitem__")
_INSTANCE_DESCRIPTORS = (property, functools.cached_property, types.MemberDescriptorType)


def _protocol_classes(protocol: type) -> list[type]:
    return [k for k in protocol.__mro__ if getattr(k, "_is_protocol", False) and k not in (Protocol, typing.Generic)]


@functools.cache
def members(protocol: type) -> tuple[Member, ...]:
    """The members of ``protocol`` (its Protocol bases included), in declaration order."""
    hints = typing.get_type_hints(protocol)
    found: dict[str, Member] = {}
    for klass in reversed(_protocol_classes(protocol)):
        for name in klass.__dict__.get("__annotations__", {}):
            hint = hints[name]
            class_level = typing.get_origin(hint) is ClassVar
            tp = typing.get_args(hint)[0] if class_level else hint
            if name in klass.__dict__:
                found[name] = Member(name, "flag", tp, klass.__dict__[name], class_level)
            else:
                found[name] = Member(name, "attribute", tp)
        for name, value in klass.__dict__.items():
            if name in found or not (name in _DUNDERS or not name.startswith("_")):
                continue
            if isinstance(value, property):
                found[name] = Member(name, "attribute", typing.get_type_hints(value.fget).get("return", Any))
            elif inspect.isfunction(value):
                sig = inspect.signature(value)
                found[name] = Member(name, "method", signature=sig.replace(parameters=list(sig.parameters.values())[1:]))
    return tuple(found.values())


def flags(protocol: type) -> dict[str, Any]:
    """``{flag: default}`` of ``protocol``."""
    return {m.name: m.default for m in members(protocol) if m.role == "flag"}


def check_class(cls: type, protocol: type) -> str | None:
    """Check a class factory against ``protocol`` before anything is built; set the flags it leaves
    out to their defaults on the class. Returns the first problem as one line, or None.

    Methods are looked up on the class; attributes, and flags that are properties (they follow the
    params), can only be judged on a built object (:func:`check_object`).
    """
    for m in members(protocol):
        if m.role != "flag":
            continue
        owner = _owner(cls, m.name, protocols=True)
        if owner is None:
            try:
                setattr(cls, m.name, m.default)
            except (AttributeError, TypeError):
                return _undeclared(m)
        elif m.class_level or not isinstance(owner.__dict__[m.name], _INSTANCE_DESCRIPTORS):
            if (problem := _flag_problem(m, getattr(cls, m.name), protocol)) is not None:
                return problem
    for m in members(protocol):
        if m.role == "attribute":
            continue
        condition = REQUIRED_WHEN.get(protocol, {}).get(m.name)
        flag_value = _class_value(cls, condition.flag) if condition else None
        if condition is not None and (isinstance(flag_value, _INSTANCE_DESCRIPTORS) or not condition.holds(flag_value)):
            continue
        if m.role == "flag":
            if condition is not None and getattr(cls, m.name) is None:
                return _missing(m, protocol, condition, flag_value)
            continue
        if _owner(cls, m.name) is None:
            return _missing(m, protocol, condition, flag_value)
        impl = inspect.getattr_static(cls, m.name)
        if not callable(impl) and not isinstance(impl, (staticmethod, classmethod)):
            return f"{m.name}={_short(impl)} is not a method; {protocol.__name__} calls {m.describe()}"
        if inspect.isfunction(impl) and (problem := _call_problem(m, _signature(impl, bound=False), protocol)):
            return problem
    return None


def check_object(obj: Any, protocol: type) -> str | None:
    """Check a built object against ``protocol``; set the flags it leaves out to their defaults
    (on its class when it has one of its own, else on the object). Returns the first problem."""
    for m in members(protocol):
        if m.role != "flag":
            continue
        if _owner_of(obj, m.name) is None:
            if (problem := _fill(obj, m)) is not None:
                return problem
        elif (problem := _flag_problem(m, getattr(obj, m.name), protocol)) is not None:
            return problem
    for m in members(protocol):
        condition = REQUIRED_WHEN.get(protocol, {}).get(m.name)
        flag_value = getattr(obj, condition.flag) if condition else None
        if condition is not None and not condition.holds(flag_value):
            continue
        if m.role == "flag":
            value = getattr(obj, m.name)
            if condition is not None and value is None:
                return _missing(m, protocol, condition, flag_value)
            if m.optional_method and value is not None and (problem := _call_problem(m, _signature(value), protocol)):
                return problem
            continue
        if _owner_of(obj, m.name, stubs=False) is None and not _dynamic(obj, m.name):
            return _missing(m, protocol, condition, flag_value)
        value = getattr(obj, m.name)
        if m.role == "attribute":
            if not _conforms(value, m.type):
                return f"{m.name}={_short(value)}: expected {_type_name(m.type)} ({protocol.__name__}.{m.name})"
        elif not callable(value):
            return f"{m.name}={_short(value)} is not a method; {protocol.__name__} calls {m.describe()}"
        elif problem := _call_problem(m, _signature(obj if m.name == "__call__" else value), protocol):
            return problem
    return None


def _owner(cls: type, name: str, *, protocols: bool = False) -> type | None:
    """The first class of ``cls``'s MRO that defines ``name``; None if none does or, unless
    ``protocols`` (flags: a Protocol's default counts), if that class is a Protocol (a stub)."""
    for klass in cls.__mro__:
        if klass is not object and name in klass.__dict__:
            return klass if protocols or not getattr(klass, "_is_protocol", False) else None
    return None


def _owner_of(obj: Any, name: str, *, stubs: bool = True) -> Any:
    """Where ``obj``'s ``name`` comes from: the object itself, a class, or None."""
    if name in getattr(obj, "__dict__", {}):
        return obj
    return _owner(type(obj), name, protocols=stubs)


def _dynamic(obj: Any, name: str) -> bool:
    """Whether ``name`` comes from a ``__getattr__`` of the object's class (a proxy)."""
    if _owner(type(obj), "__getattr__") is None:
        return False
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True


def _class_value(cls: type, name: str) -> Any:
    """A flag's value on the class (the property itself when the flag follows the params)."""
    owner = _owner(cls, name, protocols=True)
    if owner is None:
        return None
    raw = owner.__dict__[name]
    return raw if isinstance(raw, _INSTANCE_DESCRIPTORS) else getattr(cls, name)


def _fill(obj: Any, m: Member) -> str | None:
    """Set a flag the object leaves out: on its class if it has one of its own, else on itself."""
    heap_type = type(obj).__flags__ & (1 << 9)  # Py_TPFLAGS_HEAPTYPE: a class defined in Python
    try:
        setattr(type(obj) if heap_type else obj, m.name, m.default)
    except (AttributeError, TypeError):
        return _undeclared(m)
    return None


def _undeclared(m: Member) -> str:
    return f"cannot hold the default of flag {m.name}; declare it ({m.name}: {_type_name(m.type)} = {m.default!r})"


def _missing(m: Member, protocol: type, condition: When | None, flag_value: Any) -> str:
    why = f" ({condition.flag}={flag_value!r})" if condition is not None else ""
    return f"missing {m.describe()} of {protocol.__name__}{why}"


def _flag_problem(m: Member, value: Any, protocol: type) -> str | None:
    if _conforms(value, m.type):
        return None
    return f"{m.name}={_short(value)}: expected {_type_name(m.type)} ({protocol.__name__}.{m.name})"


def _call_problem(m: Member, sig: inspect.Signature | None, protocol: type) -> str | None:
    """Whether an implementation with ``sig`` accepts the call the Protocol describes for ``m``."""
    if sig is None:
        return None
    args: list[None] = []
    kwargs: dict[str, None] = {}
    if m.role == "method":
        for p in m.signature.parameters.values():
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind == p.KEYWORD_ONLY:
                kwargs[p.name] = None
            else:
                args.append(None)
    else:
        called = _callable_args(m.type)
        if called is Ellipsis:
            return None
        args = [None] * len(called)
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return f"{m.name}{_plain(sig)} does not take {m.describe()} of {protocol.__name__}"
    return None


def _signature(fn: Any, *, bound: bool = True) -> inspect.Signature | None:
    """``fn``'s signature (without ``self`` for a function found on a class: ``bound=False``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig if bound else sig.replace(parameters=list(sig.parameters.values())[1:])


def _callable_args(tp: Any) -> Any:
    """The parameter types of a ``Callable[[...], R]`` (or of ``Callable | None``); ``Ellipsis``
    for ``Callable[..., R]``; None when ``tp`` is no callable type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if (found := _callable_args(arm)) is not None:
                return found
        return None
    if typing.get_origin(tp) is not Callable:
        return None
    params = typing.get_args(tp)[0] if typing.get_args(tp) else Ellipsis
    return Ellipsis if params is Ellipsis else tuple(params)


def _plain(sig: inspect.Signature | None) -> str:
    """``(a, b, *, c=None)``: a signature without annotations."""
    if sig is None:
        return "(...)"
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _conforms(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of type ``tp`` (exactly: a bool is no int, an int no bool)."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple or tp is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(_conforms(v, a) for v, a in zip(value, args)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            return False
        key_tp, val_tp = args if len(args) == 2 else (Any, Any)
        return all(_conforms(k, key_tp) and _conforms(v, val_tp) for k, v in value.items())
    if origin is Callable or tp is Callable:
        return callable(value)
    if isinstance(origin, type):
        return isinstance(value, origin)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Callable:
        return "a callable"
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "AdvantageEstimator", "Agent", "BACKENDS", "ChatParser", "Correction", "Critic", "DataFilter", "DataSource",
    "Engine", "GatewayMiddleware", "HOOKS", "KLEstimator", "LossFunction", "Member",
    "ModelBuilder", "PolicyLoss", "REQUIRED_WHEN", "Reward", "RolloutScheduler", "Sandbox", "Teacher", "Tracker",
    "Trainer", "Transport", "When", "check_class", "check_object", "flags", "members",
]
