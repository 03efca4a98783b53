"""Pipeline parallelism: a replica's layers in consecutive stages on ``pipeline_parallel`` ranks.

The first stage holds the embedding, the last the final norm and the output layer (and, for a
model with tied embeddings, a copy of the embedding whose gradient is summed with the first
stage's). Every stage gets the same micro-batches; hidden states flow forward from stage to stage
and their gradients back.

* **The schedule** is one-forward-one-backward (Megatron's non-interleaved 1F1B): stage ``r`` of
  ``p`` runs ``p - r - 1`` forwards ahead, then alternates a forward and a backward, then drains
  its backwards; at most ``p - r`` micro-batches' activations are alive on it, whatever their
  number. A forward-only pass (log-probs) streams every micro-batch through.
* **Messages** are point-to-point in the pipeline group: a hidden state goes with its shape first
  (micro-batches differ in rows and length), a gradient has the shape of the output it answers.
  Sends never block (their handles are waited at the end of the step), so the order of blocking
  receives alone decides progress, which the schedule keeps deadlock-free.
* **Full state** for exports and checkpoints: each stage's HF-named tensors, its layers numbered
  globally, are sent to the first stage, which yields them in model order.

Megatron's own schedule is not used: it assumes CUDA (its token counters and stream syncs) and
equal shapes unless asked to exchange them, and the trainer's loop already knows every
micro-batch's shape.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_SHAPE, _DATA = 1, 2  # message tags: a hidden state's shape, then its values


@dataclass(frozen=True)
class Stage:
    """This rank's place in its pipeline: stage ``index`` of ``size``, the pipeline's process
    group, and the global ranks of the stages before and after it (None at the ends)."""

    index: int
    size: int
    group: Any
    prev: int | None
    next: int | None
    ranks: tuple[int, ...]  # the global rank of every stage, in order

    @classmethod
    def current(cls) -> Stage:
        """From Megatron's process groups."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        index, size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        ranks = tuple(dist.get_process_group_ranks(group)) if size > 1 else (dist.get_rank(),)
        return cls(
            index=index,
            size=size,
            group=group,
            prev=ranks[index - 1] if index > 0 else None,
            next=ranks[index + 1] if index < size - 1 else None,
            ranks=ranks,
        )

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1


class _Mailbox:
    """A stage's point-to-point messages of one pass; sends are kept until :meth:`flush`."""

    def __init__(self, stage: Stage, dtype: torch.dtype, device: torch.device | str) -> None:
        self.stage, self.dtype, self.device = stage, dtype, device
        self._sent: list[Any] = []

    def send_forward(self, hidden: Tensor) -> None:
        hidden = hidden.detach().contiguous()
        shape = torch.tensor(hidden.shape, dtype=torch.long, device=self.device)
        self._sent += [
            dist.isend(shape, self.stage.next, group=self.stage.group, tag=_SHAPE),
            dist.isend(hidden, self.stage.next, group=self.stage.group, tag=_DATA),
            (shape, hidden),
        ]

    def receive_forward(self) -> Tensor:
        shape = torch.empty(3, dtype=torch.long, device=self.device)
        dist.recv(shape, self.stage.prev, group=self.stage.group, tag=_SHAPE)
        hidden = torch.empty(*shape.tolist(), dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.stage.prev, group=self.stage.group, tag=_DATA)
        return hidden

    def send_backward(self, grad: Tensor) -> None:
        grad = grad.contiguous()
        self._sent += [dist.isend(grad, self.stage.prev, group=self.stage.group, tag=_DATA), grad]

    def receive_backward(self, like: Tensor) -> Tensor:
        grad = torch.empty_like(like)
        dist.recv(grad, self.stage.next, group=self.stage.group, tag=_DATA)
        return grad

    def flush(self) -> None:
        for item in self._sent:
            if hasattr(item, "wait"):
                item.wait()
        self._sent = []


# forward(i, input): micro-batch i's part on this stage, given the previous stage's output (None
# on the first stage); returns this stage's output, or on the last stage the loss (or nothing)
StageForward = Callable[[int, Tensor | None], Tensor | None]


def one_forward_one_backward(
    stage: Stage, count: int, forward: StageForward, *, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Forwards and backwards of ``count`` micro-batches on this stage in 1F1B order; the last
    stage's ``forward`` returns the loss to backward from."""
    mail = _Mailbox(stage, dtype, device)
    alive: deque[tuple[Tensor | None, Tensor]] = deque()

    def run_forward(i: int) -> None:
        received = None
        if not stage.first:
            received = mail.receive_forward().requires_grad_()
        out = forward(i, received)
        if not stage.last:
            mail.send_forward(out)
        alive.append((received, out))

    def run_backward() -> None:
        received, out = alive.popleft()
        if stage.last:
            out.backward()
        else:
            torch.autograd.backward(out, mail.receive_backward(out))
        if received is not None:
            mail.send_backward(received.grad)

    ahead = min(stage.size - stage.index - 1, count)
    for i in range(ahead):
        run_forward(i)
    for i in range(ahead, count):
        run_forward(i)
        run_backward()
    while alive:
        run_backward()
    mail.flush()


def forward_only(
    stage: Stage, count: int, forward: StageForward, *, dtype: torch.dtype, device: torch.device | str
) -> None:
    """``count`` micro-batches streamed through this stage without gradients."""
    mail = _Mailbox(stage, dtype, device)
    for i in range(count):
        out = forward(i, None if stage.first else mail.receive_forward())
        if not stage.last:
            mail.send_forward(out)
    mail.flush()


def to_first_stage(
    stage: Stage, own: Callable[[], Iterator[tuple[str, Tensor]]], device: torch.device | str
) -> Iterator[tuple[str, Tensor]]:
    """Every stage's named tensors, in stage order, on the first stage (nothing elsewhere): its
    own as ``own()`` yields them, the others' received one at a time. Every stage of the
    pipeline calls."""
    if stage.first:
        yield from own()
    for index in range(1, stage.size):
        if stage.index == index:
            tensors = list(own())
            # each tensor travels from where it is (host memory when the trainer is offloaded)
            listing = [[(name, tuple(t.shape), t.dtype, t.device.type == "cpu") for name, t in tensors]]
            dist.send_object_list(listing, stage.ranks[0], group=stage.group, device=device)
            for _, tensor in tensors:
                dist.send(tensor.contiguous(), stage.ranks[0], group=stage.group)
        elif stage.first:
            listing = [None]
            dist.recv_object_list(listing, stage.ranks[index], group=stage.group, device=device)
            for name, shape, dtype, on_host in listing[0]:
                tensor = torch.empty(shape, dtype=dtype, device="cpu" if on_host else device)
                dist.recv(tensor, stage.ranks[index], group=stage.group)
                yield name, tensor
