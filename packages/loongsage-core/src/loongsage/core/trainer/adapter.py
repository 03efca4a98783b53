"""The model-adapter contract: what a trainer backend's model provides to the trainer skeleton.

A trainer is the skeleton (:mod:`.skeleton`: micro-batches, the loss per micro-batch, gradient
accumulation, the optimizer, held teachers, checkpoints) driving one :class:`ModelAdapter`, which
owns the model: how it is loaded and split over the ranks, its forward on rows that are whole
sequences, the order micro-batches run through it, which ranks hold its parameters alike (the
gradient sums and norms), and its weights in and out. The skeleton never looks inside the model,
and an adapter never sees the loss or the optimizer's state.

Two adapters implement it: :class:`~loongsage.core.trainer.torch_model.TorchModel` (an HF model,
FSDP2 or replicated data parallelism, LoRA, the FP32 head) and the ``megatron`` package's
``MegatronModel`` (tensor, pipeline, context and expert parallelism, packed rows, R3 routing replay,
divergences summed over vocabulary shards). Besides the Protocol, this module holds the few types
and helpers both use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.metrics import Metrics
from loongsage.core.types import TrainBatch

# One micro-batch as the skeleton plans it: its rows' indices in the batch and the micro-batch, or
# None for a zero-weight filler pass (a rank with fewer micro-batches than another, where the forward
# is a collective)
Planned = tuple[list[int], TrainBatch] | None
# What runs on one planned micro-batch: a step's loss (backward from it), or a forward whose
# outputs the caller keeps (None)
MicroBatchStep = Callable[[Planned], Tensor | None]


@dataclass(frozen=True)
class VocabSplit:
    """A vocabulary split over ranks (tensor parallelism): ``sum`` adds per-position values over the
    ranks' shards (forward all-reduce, identity backward); ``own`` takes this rank's columns of a
    whole-vocabulary tensor ``[..., V]``."""

    sum: Callable[[Tensor], Tensor]
    own: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class OptimizerFile:
    """A checkpoint file of this rank's optimizer shard (``name``), written by one of the ranks
    holding the same shard (``writes``) and read by all of them."""

    name: str
    writes: bool


class ModelAdapter(Protocol):
    """A trainer's model as the skeleton drives it. Every rank holds one adapter; members that
    communicate say so, and every rank calls them in the same order."""

    model: torch.nn.Module
    """The module whose parameters the optimizer steps (those with ``requires_grad``) and whose
    tensors an offload moves; ``eval()``/``train()`` around a scoring pass."""

    sharded: bool
    """The data-parallel ranks each hold a shard of every parameter (FSDP2's DTensors): the
    backward reduces the gradients, the optimizer steps the shards in their own dtype (no float32
    masters), the optimizer's whole state is gathered by torch's distributed-checkpoint functions,
    and the shards cannot move to host memory. False: every data-parallel rank holds its replica's
    parameters, and the skeleton sums their gradients."""

    data_parallel: tuple[int, int, bool]
    """``(data-parallel rank, data-parallel size, leader)`` (the trainer contract's): with model
    parallelism the ranks of one replica share a data-parallel rank, and one of them answers."""

    vocab_split: VocabSplit | None
    """The vocabulary's split over this rank's group, when the model splits it (a divergence summed
    over the shards then reads this rank's only); None: every rank holds the whole vocabulary."""

    optimizer_file: OptimizerFile | None
    """Where this rank's optimizer state (and float32 masters) goes in a checkpoint when the ranks
    hold different shards of the model; None: in ``trainer.pt``, whole, as every rank holds it."""

    shares_prompts: bool
    """The forward computes a prompt once for the rows of a micro-batch that begin with it
    (:mod:`.shared_prompts`): the skeleton plans micro-batches that keep such rows together."""

    reference: Callable[[], AbstractContextManager[None]] | None
    """Optional: the model switched to the frozen starting policy for the forwards inside (LoRA's
    adapters off), so the KL reference needs no second model; None: not held."""

    # ------------------------------------------------------------------ the forward
    def forwarding(self, mb: TrainBatch) -> AbstractContextManager[None]:
        """Entered around each micro-batch's forward, with its rows as planned (before rows of
        several segments are split): what the model reads besides the rows, e.g. the routes an
        engine recorded, replayed by the MoE layers."""
        ...

    def sequence_logprobs(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs ``[b, t]`` of rows that are whole sequences (zeros before the
        micro-batch's first trained position), and their entropies when asked (no gradient); a
        value model gives its values and no entropy."""
        ...

    def sequence_distribution(self, mb: TrainBatch, *, shards: bool) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`sequence_logprobs` with entropies, and the log-probs over the support named by
        ``mb.teacher_dist_ids`` (a teacher's top-k; None: the whole vocabulary) from the first
        trained position on, ``[b, t - first, k]``. ``shards`` (only with :attr:`vocab_split`):
        the whole-vocabulary log-softmax as this rank's shard."""
        ...

    def filler_logits(self) -> Tensor:
        """The forward of a two-token filler input (:func:`filler_input`), for a pass without rows
        where the forward is a collective; only a zero-weight loss reads it."""
        ...

    def run_micro_batches(self, plans: list[Planned], step: MicroBatchStep, *, backward: bool) -> None:
        """Run ``step`` on each planned micro-batch, backward from the loss it returns when
        ``backward``: in order (:func:`run_in_order`), or in a pipeline's schedule, where ranks
        holding early layers run those instead of ``step``."""
        ...

    def stepping(self, metrics: Metrics) -> AbstractContextManager[None]:
        """Entered around a whole train step (its forwards, backwards and optimizer step); adds
        the model's own totals to ``metrics`` (R3's replayed tokens) when the step succeeds."""
        ...

    # ------------------------------------------------------------------ as a held teacher
    def run_ahead(self, plans: list[Planned]) -> None:
        """As a held teacher, before a step: the part of its forward on the step's micro-batches
        (its rows of each) that can run first (a pipeline's stages before the last run their
        layers; the last keeps their outputs); nothing for a model in one piece."""
        ...

    def ahead_input(self) -> AbstractContextManager[None]:
        """As a held teacher, around each of its forwards in the step: the input :meth:`run_ahead`
        kept for it, in order."""
        ...

    # ------------------------------------------------------------------ gradients
    def optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """``params`` grouped by the process group whose ranks hold them alike (None: every rank):
        the groups their gradients are summed over and the distributed optimizer's buckets."""
        ...

    def sum_replica_grads(self, grad_of: Callable[[torch.nn.Parameter], Tensor | None]) -> None:
        """Sum, within a replica split over ranks, the gradients of what several ranks hold whole
        but compute on a part of the work (``grad_of(param)``: where the step's gradient is held),
        before the data-parallel sum; nothing for a replica on one rank."""
        ...

    def clip_grad_norm(self, params: list[Tensor], max_norm: float, dist_opt: Any) -> Tensor:
        """Scale the step's gradients (on ``params``, or in the distributed optimizer ``dist_opt``
        when not None) to a global L2 norm of at most ``max_norm``, counting each parameter once
        over the ranks; returns the norm before, a plain tensor."""
        ...

    # ------------------------------------------------------------------ weights and state
    def checkpoint_state(self) -> dict[str, Tensor]:
        """The model's part of ``trainer.pt``: HF-named tensors (a collective where the model is
        split; the first rank's answer is written)."""
        ...

    def load_checkpoint_state(self, state: dict[str, Tensor]) -> None:
        """The model's weights from :meth:`checkpoint_state`'s tensors."""
        ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors an engine loads, lazily (a collective where the model is split)."""
        ...

    def hf_state(self) -> dict[str, Tensor]:
        """The whole HF state of the model for an HF folder (a collective where it is split)."""
        ...

    def write_hf(self, path: Path, state: dict[str, Tensor]) -> None:
        """Write :meth:`hf_state`'s tensors as an HF model folder (called on rank 0)."""
        ...


def world_size() -> int:
    """The trainer's ranks: the default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def filler_input(device: str | torch.device) -> Tensor:
    """A two-token input for a rank's zero-weight padding pass."""
    return torch.zeros(1, 2, dtype=torch.long, device=device)


def run_in_order(plans: list[Planned], step: MicroBatchStep, *, backward: bool) -> None:
    """A model in one piece runs the micro-batches one after another, each backward right after
    its forward."""
    for planned in plans:
        out = step(planned)
        if backward:
            out.backward()
