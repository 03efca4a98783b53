"""The contracts of the backends that hold, serve or move a model's weights.

The trainer (one DP rank; :class:`Critic` when it also gives values), the rollout engine (one
replica), the MOPD teacher, the weight transport with its receiving half, and the model builder
that makes an HF model folder offline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from torch import Tensor

from loongsage.core.contracts.algorithms import LossFunction
from loongsage.core.metrics import Metrics
from loongsage.core.types import Check, GenerationRequest, GenerationResult, TrainBatch


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
    doctor: ClassVar[Callable[[], list[Check]] | None] = None
    """Optional staticmethod ``doctor()``: what this backend needs on this machine (its libraries and
    their versions, a device, a system tool), one :class:`~loongsage.core.types.Check` each; read by
    ``loongsage doctor``, never during a run."""
    add_teacher: ClassVar[Callable[..., None] | None] = None
    """Optional ``add_teacher(sources, model_path)``, with ``teacher_logprobs(batch, token_budget)``:
    hold the MOPD teacher of these data sources (``teacher: {name: trainer}``), a frozen model
    built and split like the policy. ``teacher_logprobs`` gives each row's teacher's log-probs of
    its tokens; in ``train_step`` a loss that reads a distribution gets the teachers' own,
    computed in each micro-batch. Every rank calls both, rows or not."""
    data_parallel: tuple[int, int, bool] | None = None
    """Optional: ``(data-parallel rank, data-parallel size, leader)`` of this rank (None: every rank
    is a data-parallel rank of its own). With model parallelism (the ``megatron`` trainer's
    tensor parallelism) the ranks of one model-parallel group share a data-parallel rank: they all
    get its rows, and its leader's log-probs and metrics are the ones read."""

    def setup_optimizer(
        self, lr: float, betas: list[float], eps: float, weight_decay: float, grad_clip: float, warmup_steps: int
    ) -> None: ...

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

    def offload(self, weights: bool = True) -> None:
        """Free the device for a colocated engine: optimizer state (and, unless ``weights`` is
        False, the weights: a weight push still reads them) to host memory."""
        ...

    def onload(self) -> None:
        """Back on the device what :meth:`offload` moved."""
        ...

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
    doctor: ClassVar[Callable[[], list[Check]] | None] = None
    """Optional staticmethod ``doctor()``: what this backend needs on this machine (its libraries and
    their versions, a device, a system tool), one :class:`~loongsage.core.types.Check` each; read by
    ``loongsage doctor``, never during a run."""
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


class ModelBuilder(Protocol):
    """A ``model_builder`` backend: makes an HF model folder offline (the tiny embedded model).

    Runs in the driver before any actor starts, once per run per spec (``model.builder``, a
    teacher's ``builder``); an implementation caches what it builds.
    """

    kind: ClassVar[Literal["model_builder"]] = "model_builder"

    def build(self) -> str | Path: ...
