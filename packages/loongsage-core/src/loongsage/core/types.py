"""Typed records that cross component boundaries.

Everything is explicit: a trajectory carries its prompt and response token ids, loss mask, the
rollout log-probs and the weight version of every response token. Nothing is re-derived from
text after generation (token-in, token-out).

Per-token tensors of a training batch are laid out over the *whole* sequence (prompt + response,
right-padded to ``T``): position ``t`` holds the value for token ``t`` (its log-prob given tokens
``< t``). ``response_mask`` is 1 on response tokens that count for the loss, 0 on prompt tokens,
tool/user tokens and padding.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor


class Status(str, enum.Enum):
    """Outcome of one trajectory."""

    OK = "ok"  # finished by a stop token (or the agent ended it)
    TRUNCATED = "truncated"  # hit the response length limit
    ABORTED = "aborted"  # interrupted (weight update, shutdown) and not resumed
    FAILED = "failed"  # infrastructure failure: excluded from group statistics, never scored 0


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RewardInfraError(RuntimeError):
    """Raised by a reward when the scorer itself failed, not the trajectory."""


class EngineUnavailable(RuntimeError):
    """Raised by an engine that cannot serve any request (the server behind it is gone), from
    ``generate`` and ``health``: the run then replaces the replica and sends its requests again,
    where an error of one request (a ``ValueError``) fails that request alone."""


@dataclass(frozen=True)
class Check:
    """One thing a run on this machine needs, as ``loongsage doctor`` reports it: ``ok`` or not,
    what was found (a version, a count, the reason it is missing) and, when not ok, the fix. An
    ``optional`` check names something that makes a backend faster or fuller, never required."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    optional: bool = False


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key and what is allowed."""


class BadRecordError(ValueError):
    """A malformed dataset row; the message names the source, the row index and what is wrong."""


@dataclass
class SamplingParams:
    """Sampling settings of one generation request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError with one line naming the bad field and the allowed range."""
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling.min_p={self.min_p}: must be in [0, 1)")
        if self.max_new_tokens <= 0:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}: must be > 0")
        if self.n < 1:
            raise ValueError(f"sampling.n={self.n}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    """One sample of a request: the engine's token-in, token-out answer."""

    request_id: str
    output_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the policy distribution
    versions: list[int]  # weight version that produced each token
    finish_reason: FinishReason
    # with an engine recording routes (mixture of experts, R3): the experts each MoE layer chose for
    # every token fed to the model (the prompt's and the output's but the last), [tokens, layers, topk]
    routed_experts: Any = None


@dataclass
class GenerationRequest:
    """Token ids in; ``sampling.n`` samples out.

    ``resume_from`` continues one sample that was aborted (partial rollout across a weight update):
    its ``output_ids`` are appended to the prompt, generation goes on with the current weights for
    the remaining ``max_new_tokens - len(output_ids)``, and the result holds the old tokens followed
    by the new ones, each with its own log-prob and weight version.
    """

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    resume_from: GenerationResult | None = None


def check_request(request: GenerationRequest, *, released: bool = False) -> list[int]:
    """What every engine checks of a request, as one-line errors that name it: its memory not
    released, valid sampling, a prompt, a ``resume_from`` that can be continued. Returns the ids the
    engine starts from (the prompt, then the resumed sample's tokens)."""
    prefix = f"request {request.request_id!r}: "
    if released:
        raise RuntimeError(prefix + "the engine's memory is released; call resume_memory() first")
    try:
        request.sampling.validate()
    except ValueError as exc:
        raise ValueError(prefix + str(exc)) from None
    if len(request.input_ids) == 0:
        raise ValueError(prefix + "input_ids is empty")
    prior = request.resume_from
    if prior is None:
        return list(request.input_ids)
    check_resumable(prefix, request, prior)
    return list(request.input_ids) + list(prior.output_ids)


def abort_targets(request_ids: list[str] | str | None, in_flight: Iterable[str]) -> list[str]:
    """The ids an ``abort(request_ids)`` ends: all in flight for ``None``, else the given ones once
    each, every one of them in flight (else one line naming those that are not)."""
    live = list(in_flight)
    if request_ids is None:
        return live
    ids = list(dict.fromkeys([request_ids] if isinstance(request_ids, str) else request_ids))
    known = set(live)
    unknown = [rid for rid in ids if rid not in known]
    if unknown:
        raise ValueError(f"abort: unknown request id(s) {unknown}: not waiting or running")
    return ids


def check_resumable(prefix: str, request: GenerationRequest, prior: GenerationResult) -> None:
    """One-line errors (``prefix`` first) for a ``resume_from`` that cannot be continued."""
    if prior.finish_reason is not FinishReason.ABORT:
        raise ValueError(
            prefix + f"resume_from has finish_reason={prior.finish_reason.value!r}: "
            "only an aborted sample can be resumed"
        )
    if request.sampling.n != 1:
        raise ValueError(prefix + f"sampling.n={request.sampling.n}: a resumed request continues one sample (n=1)")
    lengths = {len(prior.output_ids), len(prior.logprobs), len(prior.versions)}
    if len(lengths) != 1:
        raise ValueError(prefix + "resume_from.output_ids, logprobs and versions must have equal lengths")
    if len(prior.output_ids) >= request.sampling.max_new_tokens:
        raise ValueError(
            prefix + f"resume_from already holds {len(prior.output_ids)} tokens: nothing left of "
            f"sampling.max_new_tokens={request.sampling.max_new_tokens}"
        )


@dataclass
class DataRecord:
    """One prompt of a data source."""

    source: str  # name of the data source in the config
    index: int  # position in that source (exact data position on resume)
    prompt: str | list[dict[str, Any]]  # raw text or chat messages
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DataSource(Protocol):
    """``loongsage_data_sources``: a map-style data set (a file reader, a synthetic task generator).

    Runs in the driver, where each source's cursor reads it: ``__len__`` once per epoch, ``__getitem__``
    once per prompt drawn (training, refills and evaluation). Map-style access is what makes the data
    position exact on resume. A malformed row raises :class:`BadRecordError` naming its index; the
    source's ``on_bad_row`` policy skips or rejects it. One of the contracts of
    :mod:`loongsage.core.contracts`.
    """

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> DataRecord: ...


@dataclass
class Segment:
    """A contiguous span of one trajectory's tokens rendered from one prompt (multi-turn)."""

    start: int  # offset into prompt_ids + response_ids
    end: int
    kind: str = "turn"  # turn | compaction | rewritten


@dataclass
class Trajectory:
    source: str
    group_id: int  # unique per prompt within a run
    sample_index: int  # position within its group
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 = generated by the model and trained on
    rollout_logprobs: list[float]  # per response token (0 where loss_mask is 0)
    versions: list[int]  # per response token (-1 where not generated by the model)
    status: Status = Status.OK
    response_text: str = ""
    reward: float | None = None
    token_rewards: list[float] | None = None
    segments: list[Segment] = field(default_factory=list)
    # R3: the experts each MoE layer chose for the tokens fed to the engine ([tokens, layers, topk]
    # from the first token), or with several segments a list of such records, one per segment
    # (each from the segment's first token); None: none recorded
    routed_experts: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.loss_mask) == len(self.rollout_logprobs) == len(self.versions) == n):
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: response_ids, loss_mask, "
                f"rollout_logprobs and versions must have equal lengths, got {n}, "
                f"{len(self.loss_mask)}, {len(self.rollout_logprobs)}, {len(self.versions)}"
            )


@dataclass
class TrainBatch:
    """Right-padded token batch; every per-token tensor is ``[B, T]`` over prompt + response.

    Rows are trajectories (in the order :func:`~loongsage.core.batching.to_batch` was given them);
    what identifies and describes a row travels with it: its source, group and sample index, the
    policy version of every token, its segments. :meth:`select` keeps all of it together.
    """

    input_ids: Tensor  # long
    attention_mask: Tensor  # long, 1 on real tokens
    response_mask: Tensor  # float, 1 on trained response tokens
    rollout_logprobs: Tensor  # float
    advantages: Tensor  # float
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B] long
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    loss_weights: Tensor | None = None  # aggregation weights with global denominators
    values: Tensor | None = None  # critic values before the update (PPO with a critic)
    returns: Tensor | None = None  # critic targets
    # MOPD: the source's teacher on the student's tokens. teacher_logprobs [B, T] (log-prob of each
    # token); teacher_dist_logprobs [B, T, K] its log-probs over a support per position, the top-k
    # tokens named by teacher_dist_ids [B, T, K] or, with teacher_dist_ids None, the full vocabulary
    teacher_logprobs: Tensor | None = None
    teacher_dist_ids: Tensor | None = None
    teacher_dist_logprobs: Tensor | None = None
    # the policy version that produced each token, int32 (-1: prompt, teacher-forced, tool or user
    # token, padding); the trainer reads which tokens an engine sampled from it
    versions: Tensor | None = None
    token_rewards: Tensor | None = None  # the trajectories' own per-token rewards (None: no row has any)
    sample_indices: Tensor | None = None  # [B] long: each row's position in its group
    sources: list[str] = field(default_factory=list)
    segments: list[list[Segment]] = field(default_factory=list)  # per row (multi-turn spans), offsets into the row
    routed_experts: list[Any] = field(default_factory=list)  # per row, as the engine returned them (empty: none)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trajectory_ids(self) -> list[tuple[int, int]]:
        """``(group id, sample index)`` of every row: unique within a run."""
        if self.sample_indices is None:
            raise ValueError("trajectory_ids: this batch carries no sample_indices")
        return list(zip(self.group_ids.tolist(), self.sample_indices.tolist()))

    def select(self, rows: Tensor | list[int]) -> TrainBatch:
        """The batch of ``rows`` (in that order): every tensor and per-row list sliced alike."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        out: dict[str, Any] = {}
        for name in self.tensor_fields():
            value = getattr(self, name)
            out[name] = None if value is None else value.index_select(0, idx)
        picked = idx.tolist()
        for name in self.row_fields():
            value = getattr(self, name)
            out[name] = [value[i] for i in picked] if value else []
        return TrainBatch(**out)

    def to(self, device: Any) -> TrainBatch:
        """The batch with every tensor on ``device`` (itself when nothing has to move)."""
        device = torch.device(device)
        moved = {
            name: value.to(device)
            for name in self.tensor_fields()
            if (value := getattr(self, name)) is not None and value.device != device
        }
        return dataclasses.replace(self, **moved) if moved else self

    @staticmethod
    def tensor_fields() -> tuple[str, ...]:
        return (
            "input_ids",
            "attention_mask",
            "response_mask",
            "rollout_logprobs",
            "advantages",
            "rewards",
            "group_ids",
            "old_logprobs",
            "ref_logprobs",
            "loss_weights",
            "values",
            "returns",
            "teacher_logprobs",
            "teacher_dist_ids",
            "teacher_dist_logprobs",
            "versions",
            "token_rewards",
            "sample_indices",
        )

    @staticmethod
    def row_fields() -> tuple[str, ...]:
        """The per-row lists (empty when no row has the value)."""
        return ("sources", "segments", "routed_experts")


@dataclass
class AdvantageInput:
    rewards: Tensor  # [B] sequence rewards
    group_ids: Tensor  # [B] long; rows of one prompt share an id
    response_mask: Tensor  # [B, T]
    token_rewards: Tensor | None = None  # [B, T], e.g. KL-in-reward or process rewards
    values: Tensor | None = None  # [B, T] critic values (estimators with needs_values)


@dataclass
class PolicyLossInput:
    logprobs: Tensor  # [B, T] current policy (with grad)
    old_logprobs: Tensor  # [B, T] policy that the data is measured against (no grad)
    advantages: Tensor  # [B, T]
    response_mask: Tensor  # [B, T]
    rollout_logprobs: Tensor | None = None  # [B, T] behaviour policy (engine)


@dataclass
class LossOutput:
    loss: Tensor  # [B, T] unreduced per-token loss
    metrics: dict[str, Tensor] = field(default_factory=dict)  # per-token values, token-mean reported


@dataclass
class CorrectionInput:
    old_logprobs: Tensor  # [B, T]
    rollout_logprobs: Tensor  # [B, T]
    advantages: Tensor  # [B, T]
    response_mask: Tensor  # [B, T]
    logprobs: Tensor | None = None  # [B, T] current policy, where a correction needs it


@dataclass
class CorrectionOutput:
    token_weights: Tensor  # [B, T] multiplies the per-token loss (no gradient)
    response_mask: Tensor  # [B, T] possibly with tokens or sequences masked out
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class SchedulerState:
    """Counters a rollout scheduler decides from, in groups of one data source."""

    version: int  # current policy version
    groups_per_step: int  # B: the groups one training batch takes
    in_flight: int  # dispatched, not finished
    buffered: int  # finished and kept, not yet consumed by the trainer
    consumed: int  # consumed by the trainer so far
    dispatched: int = 0  # dispatched so far (groups get sequence numbers 0, 1, ... in dispatch order)
    oldest_unconsumed: int = 0  # sequence number of the oldest dispatched group not yet consumed or dropped


@runtime_checkable
class RolloutScheduler(Protocol):
    """``loongsage_rollout_schedulers``: when the rollout service dispatches (sync, one-step-off, async).

    Runs in the driver, inside the rollout service, per data source whenever it may dispatch (sync:
    once per step); a pure decision over :class:`SchedulerState`. One of the contracts of
    :mod:`loongsage.core.contracts`; the built-ins are in :mod:`loongsage.core.rollout.schedulers`.
    """

    asynchronous: ClassVar[bool] = False
    """Dispatches while the trainer trains (needs engines and trainers on separate resources)."""
    max_staleness: ClassVar[int] = 0
    """Versions a trained trajectory's oldest generated token may lag the policy that trains on it."""
    collectable: ClassVar[Callable[[int, SchedulerState], bool] | None] = None
    """``collectable(seq, state)``: may the finished group with this sequence number enter the next
    batch now (``None``: any finished group may)."""

    def groups_to_dispatch(self, state: SchedulerState) -> int: ...
