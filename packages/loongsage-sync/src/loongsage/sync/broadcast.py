"""``broadcast``: each bucket broadcast from trainer rank 0 to every engine over a private group.

The group is the sender (rank 0) and one rank per receiving engine (:mod:`.group`: formed as
SGLang's servers form theirs, so an engine whose server joins the group itself, SGLang's, takes
its weights straight from the trainer), made on first use; NCCL between GPUs, gloo on CPU. It is
made again when the set of engines changes (an engine replaced after a failure).

Per bucket the sender first tells every receiver the bucket's metadata and size
(``receive_bucket``, answered once its copy is complete), then broadcasts the flat buffer; each
receiver takes it into a fresh buffer of its own, so nothing is reused before it is consumed. The
last bucket commits. NCCL needs one GPU per rank (two ranks on one card are refused by NCCL: on a
single GPU use ``ipc``); gloo runs anywhere, which is how the CPU tests check the bucketing and the
sequencing of this path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from loongsage.core.buckets import PackBuffer, TensorMeta, bucket_bytes, flag_last, plan_buckets, unpack
from loongsage.core.contracts import Transport, TransportReceiver
from loongsage.core.placement import free_port
from loongsage.core.transport import commit_nothing, push_stats
from loongsage.sync.group import broadcast_from_sender, cuda_device, leave, weight_group


class BroadcastReceiver(TransportReceiver):
    def __init__(self) -> None:
        self.group, self.device = None, torch.device("cpu")
        # on the CPU, bucket i of every push lands in the buffer bucket i used last time: pages
        # faulted in once (the staged views are copied into the model before the next push starts;
        # on a GPU the caching allocator reuses its blocks anyway)
        self._host_buffers: dict[int, Tensor] = {}

    def setup(self, *, host: str, port: int, name: str, rank: int, world: int, backend: str, timeout_s: float) -> int:
        """Join the sender's group ``name`` as ``rank`` of ``world`` (leaving the one before)."""
        if self.group is not None:
            leave(self.group)
        self.group = None
        self.device = cuda_device() if backend == "nccl" else torch.device("cpu")
        self.group = weight_group(
            host=host, port=port, name=name, rank=rank, world=world, backend=backend, timeout_s=timeout_s
        )
        return rank

    def receive(self, metas: list[TensorMeta], size: int, index: int = 0) -> list[tuple[str, Tensor]]:
        if self.group is None:
            raise RuntimeError("broadcast receiver: no group (the sender's setup did not reach this engine)")
        flat = self._host_buffers.get(index) if self.device.type == "cpu" else None
        if flat is None or flat.numel() < size:  # a buffer of its own per bucket of the push
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":
                self._host_buffers[index] = flat
        flat = flat[:size]
        broadcast_from_sender(self.group, flat)
        return unpack(metas, flat, copy=False)


@dataclass
class BroadcastTransport(Transport):
    """``broadcast``: ``bucket_mb`` MiB buckets over a private group; ``backend`` ``auto`` picks NCCL
    when CUDA is there, else gloo."""

    kind = "transport"

    bucket_mb: float = 512.0
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("broadcast", self.bucket_mb)
        self._group: Any = None
        self._members: tuple[str, ...] = ()
        self._groups_made = 0
        # one pack buffer: the broadcast of a bucket is done (gloo) or ordered on the stream (NCCL)
        # before the next bucket is packed into it
        self._pack_buffer = PackBuffer(self.bucket_bytes)

    def receiver(self) -> BroadcastReceiver:
        return BroadcastReceiver()

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def _form(self, receivers: list) -> None:
        """The group of this sender and ``receivers`` (made again when they changed)."""
        import ray

        members = tuple(r._actor_id.hex() for r in receivers)
        if self._group is not None and members == self._members:
            return
        if self._group is not None:
            leave(self._group)
        self._group, self._members = None, ()
        ray.get([r.version.remote() for r in receivers])  # all started: joining is then a matter of seconds
        host = ray.util.get_node_ip_address()
        self._groups_made += 1
        # unique in every process that ever joins one (torch keeps group names per process)
        name = f"loongsage-sync-{uuid.uuid4().hex[:8]}-{self._groups_made}"
        world, backend, port = len(receivers) + 1, self.resolved_backend, free_port(host)
        joined = [
            r.transport_setup.remote(
                host=host, port=port, name=name, rank=i + 1, world=world, backend=backend, timeout_s=self.timeout_s
            )
            for i, r in enumerate(receivers)
        ]
        group = weight_group(
            host=host, port=port, name=name, rank=0, world=world, backend=backend, timeout_s=self.timeout_s
        )
        ray.get(joined)
        self._group, self._members = group, members

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray

        self._form(receivers)
        device = cuda_device() if self.resolved_backend == "nccl" else "cpu"
        start, total, count, versions = time.perf_counter(), 0, 0, None
        for count, (bucket, last) in enumerate(flag_last(plan_buckets(named_tensors, self.bucket_bytes)), 1):
            metas, flat = self._pack_buffer.pack(bucket, device)
            answers = [
                r.receive_bucket.remote(metas, flat.numel(), count - 1, first=count == 1, commit=last)
                for r in receivers
            ]
            broadcast_from_sender(self._group, flat)
            versions = ray.get(answers)
            total += flat.numel()
        versions = versions if versions is not None else commit_nothing(receivers)
        return push_stats(total, count, versions, time.perf_counter() - start)
