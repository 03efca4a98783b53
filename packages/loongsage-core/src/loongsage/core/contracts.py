"""The contracts: what every plugin's product and every backend must provide.

One :class:`typing.Protocol` per extension point (what a hook's factory returns) and per backend
kind. Each says in which process its implementation runs and how often the framework calls it,
and declares its *capability flags*: attributes with a default that tell the framework what an
entry needs or offers (an advantage estimator's ``needs_values``, a KL estimator's ``consumes``).
The framework reads them directly, never probing with ``getattr``; the registry
(:mod:`loongsage.core.plugins`) makes that safe by checking every entry against its Protocol when
it loads and when it builds it (:mod:`loongsage.core.contract_check`), and refuses a problem in one
line naming the entry, its provider and the member::

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

import types
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from torch import Tensor

from loongsage.core.metrics import Metrics
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


# ================================================================================== hooks
class Agent(Protocol):
    """``loongsage_agents``: turns one data record into its group of trajectories.

    Runs in the driver (the controller's process, on the rollout's event loop), concurrently with
    the other prompts of the step. Called once per prompt: the step's, every refill round's, and
    (as a source's ``eval_agent``) every evaluation prompt's.
    """

    required_services: ClassVar[tuple[str, ...]] = ()
    """Names of the run services (config ``services``) the agent reaches through ``ctx.services``;
    a config without one of them is refused at validation (an instance may compute it from its
    params)."""

    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        """The group of ``record``; ``ctx`` (:class:`~loongsage.core.rollout.AgentContext`) holds
        the engine client (token-in, token-out), the tokenizer, the sampling and the group id."""
        ...


@dataclass(frozen=True)
class RewardContext:
    """What a reward whose ``__call__`` takes a ``ctx`` parameter gets besides the trajectory and
    its record: the shared handles of the run's services (``RunService.share``) by service name,
    e.g. the sandbox service, through which a reward reaches the sandbox its trajectory worked in."""

    services: Mapping[str, Any]


class Reward(Protocol):
    """``loongsage_rewards``: scores one finished trajectory.

    Runs in the reward worker actor; called once per trajectory (concurrently when it returns an
    awaitable). Raises :class:`~loongsage.core.types.RewardInfraError` when the scorer itself
    failed: the trajectory is then marked ``failed`` instead of scored 0.

    A reward that declares a third parameter named ``ctx`` is called with a :class:`RewardContext`
    (``__call__(trajectory, record, ctx)``; see :func:`~loongsage.core.rewarding.call_reward`).
    Whatever the trajectory held (its sandbox) is kept until every reward of its batch has returned.
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


@dataclass(frozen=True)
class SandboxOwner:
    """Who a sandbox belongs to: the run, the trajectory and its attempt (a retried trajectory gets
    a fresh sandbox; a resumed one may get its kept sandbox back)."""

    run: str
    trajectory: str
    attempt: int = 0


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome in a sandbox.

    ``exit_code`` is set when the command exited, ``signal`` when a signal ended it (both None when
    it never ran, see ``error``). ``stdout``/``stderr`` are the captured bytes decoded as UTF-8 with
    undecodable bytes written ``\\xNN`` (binary output is kept, not lost); a stream beyond the
    backend's cap keeps its head and tail around a one-line marker and sets ``truncated``.
    ``timed_out``: the wall-clock timeout ended it (every process it started is then gone).
    ``error``: why the command could not run or finish normally (sandbox deleted meanwhile, say).
    """

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    wall_s: float
    error: str | None = None


class Sandbox(Protocol):
    """``loongsage_sandboxes``: isolated execution for agents and rewards (loongsage-sandbox ships
    ``local``, a bubblewrap jail per sandbox).

    Runs in the actor (a sandbox or reward worker) that owns the sandbox pool; ``create``/``delete``
    once per sandbox (one per trajectory that needs one), ``exec``/``put``/``get`` once per tool call
    or file transfer, any of them concurrently. Every sandbox has an owner and a deadline
    (``time.time()`` seconds) after which the backend may remove it; a backend marks what it
    creates so that the sandboxes of a process that died are found and removed (orphans). An
    unknown or deleted ``sandbox_id`` raises ``LookupError``; a bad ``path`` (absolute, ``..``,
    through a symlink, outside the work directory) raises ``ValueError``.
    """

    reusable: ClassVar[bool] = False
    """Offers ``reset``: a released sandbox can be emptied and handed to another owner."""
    reset: ClassVar[Callable[[str, SandboxOwner, float], Awaitable[None]] | None] = None
    """``reset(sandbox_id, owner, deadline)``: kill its processes, empty its work directory, give it
    to ``owner`` until ``deadline`` (required with ``reusable``)."""
    reap_orphans: ClassVar[Callable[[], Awaitable[int]] | None] = None
    """``reap_orphans() -> count``: remove the sandboxes whose creating process is gone (a pool
    calls it when it starts)."""
    put_archive: ClassVar[Callable[[str, str, bytes], Awaitable[int]] | None] = None
    """``put_archive(sandbox_id, path, tar_bytes) -> files``: unpack a tar archive under ``path``;
    links, devices and names leaving the directory refuse the whole archive."""
    host_path: ClassVar[Callable[[str], str] | None] = None
    """``host_path(sandbox_id) -> str``: the work directory as a path on the pool's machine, for a
    program that runs outside the sandbox but works in its directory (the command agent)."""
    adopt: ClassVar[Callable[[str], Awaitable[int]] | None] = None
    """``adopt(sandbox_id) -> count``: hand what such a program wrote there to the sandbox (owner,
    permissions), before commands inside change it (required with ``host_path``)."""

    async def create(self, owner: SandboxOwner, deadline: float) -> str:
        """A new empty sandbox for ``owner``; its id."""
        ...

    async def exec(self, sandbox_id: str, cmd: str, timeout: float) -> ExecResult:
        """Run ``cmd`` with ``/bin/sh -c`` in the work directory; after ``timeout`` seconds every
        process it started is killed. A failing command is a result, never an exception."""
        ...

    async def put(self, sandbox_id: str, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, relative to the work directory (parents are created)."""
        ...

    async def get(self, sandbox_id: str, path: str) -> bytes:
        """The bytes of the regular file ``path``, relative to the work directory."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox and remove everything it had; deleting twice is a no-op."""
        ...


class GatewayMiddleware(Protocol):
    """``loongsage_gateway_middlewares``: rewrites, logs or limits the chat gateway's traffic.

    Runs in the gateway service (loongsage-agentflow), once per chat request (OpenAI or Anthropic):
    ``request`` is ``{"protocol", "trajectory", "attempt", "body"}`` (the JSON body, which it may
    rewrite); it calls ``call_next`` (the rest of the chain) or answers by itself, and returns the
    reply ``{"status", "body"}`` (a streamed reply in its non-streamed form).
    """

    async def __call__(self, request: dict[str, Any],
                       call_next: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> dict[str, Any]: ...


# ================================================================================ backends
@runtime_checkable
class LossFunction(Protocol):
    """What a trainer's ``train_step`` is handed: the framework's loss closure
    (:class:`~loongsage.core.loss.LossPipeline` for the policy, ``ValueLoss`` for a critic).

    Called in the trainer rank once per micro-batch with the forward's per-token output (log-probs
    or values) ``[B, T]``; returns the weighted loss *sum* and its :class:`~loongsage.core.metrics.Metrics`
    (ratios that add up over micro-batches and ranks). A bare callable (a test's closure) is no
    ``LossFunction`` (``isinstance`` tells) and is called without ``student_dist``.
    """

    needs_student_distribution: bool = False
    """Pass ``student_dist=``: the policy's log-probs on the teacher's support (MOPD's GKD term)."""

    def __call__(self, logprobs: Tensor, mb: TrainBatch) -> tuple[Tensor, Metrics]: ...


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
        critic returns its values here (and entropies it ignores). A row with several segments
        (``batch.segments``) has each segment scored as a sequence of its own, positions from 0,
        attending only within it (:mod:`loongsage.core.segments`); ``train_step``'s forward too."""
        ...

    def reference_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor | None:
        """The frozen starting policy's log-probs when ``holds_reference``, else None."""
        ...

    def train_step(self, mini_batch: TrainBatch, loss_fn: LossFunction, token_budget: int) -> Metrics:
        """One optimizer step over ``mini_batch`` (every rank calls, an empty batch included): the
        loss's metrics summed over micro-batches, the weighted loss as the total ``train/loss``,
        and gauges such as ``train/grad_norm``."""
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
    named_weights: ClassVar[Callable[[], Iterable[tuple[str, Tensor]]] | None] = None
    """Optional ``named_weights()``: the HF-named tensors the engine serves now (the checks that a
    weight update arrived bit for bit use it)."""
    weight_receiver: ClassVar[Callable[[str], TransportReceiver | None] | None] = None
    """Optional ``weight_receiver(transport)``: a receiver of the engine's own for the transport
    named, or None to take the transport's (an engine whose server joins the ``broadcast`` group
    itself takes the weights straight from the trainer; its ``receive`` stages nothing, and the
    commit's ``update_weights([])`` only moves the version)."""

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
        (top-k ``[B, T, k]``, or ids None and the full log-softmax) or both None; each segment of
        a row scored alone, as for :meth:`Trainer.logprobs`."""
        ...


class Transport(Protocol):
    """A ``transport`` backend: how the weights go from trainer rank 0 to every engine.

    Two halves of one object built from ``rollout.transport``: the sender, in trainer rank 0's
    actor, where ``push`` is called once per weight update with the trainer's exported HF-named
    tensors and the engine worker handles; and in every engine worker ``receiver()``, called once,
    whose ``receive`` unpacks what the sender sent. The sender drives the receivers through the
    engine worker's ``receive_bucket(*parts, first=, commit=)`` (each bucket's tensors are staged;
    ``commit`` on the last swaps them all in at once, so no generation sees half an update, and a
    failure drops the staged tensors and keeps the previous version) and, for transports that
    must set something up first (a process group), ``transport_setup(**kwargs)``. The engine worker
    imports no transport. The bucketing layer is :mod:`loongsage.core.buckets`.
    """

    kind: ClassVar[Literal["transport"]] = "transport"

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list[Any]) -> dict[str, float]:
        """Send every tensor to every receiver; returns ``sync/*`` statistics, among them
        ``sync/version``: the receivers' weight version after the push."""
        ...

    def receiver(self) -> TransportReceiver:
        """The receiving half, built in an engine worker."""
        ...


class TransportReceiver(Protocol):
    """A transport's receiving half, in an engine worker (see :class:`Transport`)."""

    setup: ClassVar[Callable[..., Any] | None] = None
    """Optional ``setup(**kwargs)``: what the sender asks of every receiver before it sends (join a
    process group); reached through the engine worker's ``transport_setup``."""

    def receive(self, *parts: Any) -> Iterable[tuple[str, Tensor]]:
        """The HF-named tensors of one message of the sender (a bucket: its parts as the sender
        passed them to ``receive_bucket``); they must stay valid after the call (copies, not views
        of a buffer the sender reuses)."""
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
    """A ``chat_parser`` backend (loongsage-agentflow ships ``qwen3``): splits a model family's
    completion text into the chat-completion message fields.

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


class RunService(Protocol):
    """A ``service`` backend: lives as long as the run and is reached by agents (the chat gateway).

    Runs in the driver, on the event loop that runs the rollout (see :mod:`loongsage.core.services`):
    ``start`` once when the run starts, after the engines, ``stop`` once when it ends (also after an
    error). What ``start`` returns is what agents get as ``ctx.services[<name>]``.
    """

    kind: ClassVar[Literal["service"]] = "service"
    metrics: ClassVar[Callable[[], dict[str, float]] | None] = None
    """Optional method ``metrics()``: the service's counters, added to every step's metrics."""
    share: ClassVar[Callable[[], Any] | None] = None
    """Optional method ``share()``, called once after ``start``: a picklable handle for the run's
    other processes; rewards get it as ``ctx.services[<name>]`` (:class:`RewardContext`)."""
    finish: ClassVar[Callable[[list[Trajectory]], Awaitable[None]] | None] = None
    """Optional ``async finish(trajectories)``: the rollout is done with these trajectories (scored,
    or their scoring failed): free what they held (their sandboxes)."""

    async def start(self, ctx: Any) -> Any: ...

    async def stop(self) -> None: ...


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


__all__ = [
    "AdvantageEstimator", "Agent", "BACKENDS", "ChatParser", "Correction", "Critic", "DataFilter", "DataSource",
    "Engine", "GatewayMiddleware", "HOOKS", "KLEstimator", "LossFunction", "ModelBuilder", "PolicyLoss",
    "REQUIRED_WHEN", "Reward", "RolloutScheduler", "RunService", "Sandbox", "SandboxOwner", "ExecResult", "Teacher", "Tracker", "Trainer", "Transport", "When",
]
