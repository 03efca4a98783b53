"""``broadcast``: each bucket broadcast from trainer rank 0 to every engine over a private group.

The group is the sender (rank 0) and one rank per receiving engine, made on first use with a
``TCPStore`` on the sender's node and torch's process-group classes directly (NCCL between GPUs,
gloo on CPU): it is not the default group, so a trainer's own data-parallel group is untouched.
It is made again when the set of engines changes (an engine replaced after a failure).

Per bucket the sender first tells every receiver the bucket's metadata and size
(``receive_bucket``, answered once its copy is complete), then broadcasts the flat buffer; each
receiver takes it into a fresh buffer of its own, so nothing is reused before it is consumed. The
last bucket commits. NCCL needs one GPU per rank (two ranks on one card are refused by NCCL: on a
single GPU use ``ipc``); gloo runs anywhere, which is how the CPU tests check the bucketing and the
sequencing of this path.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.buckets import PackBuffer, TensorMeta, bucket_bytes, flag_last, plan_buckets, unpack
from loongsage.core.embedded.transport import commit_nothing, push_stats
from loongsage.core.contracts import Transport, TransportReceiver


def _group(backend: str, store: Any, rank: int, world: int, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _broadcast(group: Any, flat: Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()


class BroadcastReceiver(TransportReceiver):
    def __init__(self) -> None:
        self.group, self.device = None, torch.device("cpu")
        # on the CPU, bucket i of every push lands in the buffer bucket i used last time: pages
        # faulted in once (the staged views are copied into the model before the next push starts;
        # on a GPU the caching allocator reuses its blocks anyway)
        self._host_buffers: dict[int, Tensor] = {}

    def setup(self, *, host: str, port: int, name: str, rank: int, world: int, backend: str,
              timeout_s: float) -> int:
        """Join the sender's group ``name`` as ``rank`` of ``world``."""
        self.group = None
        store = dist.PrefixStore(name, dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.group = _group(backend, store, rank, world, timeout_s)
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
        _broadcast(self.group, flat)
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
        self._store: Any = None
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
        self._group, self._members = None, ()
        ray.get([r.version.remote() for r in receivers])  # all started: joining is then a matter of seconds
        host = ray.util.get_node_ip_address()
        if self._store is None:
            self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False)
        self._groups_made += 1
        name, world, backend = f"loongsage-sync-{self._groups_made}", len(receivers) + 1, self.resolved_backend
        joined = [r.transport_setup.remote(host=host, port=self._store.port, name=name, rank=i + 1, world=world,
                                           backend=backend, timeout_s=self.timeout_s)
                  for i, r in enumerate(receivers)]
        group = _group(backend, dist.PrefixStore(name, self._store), 0, world, self.timeout_s)
        ray.get(joined)
        if backend == "nccl":  # the communicator exists once a first collective ran on every rank
            answers = [r.receive_bucket.remote([], 1) for r in receivers]
            _broadcast(group, torch.zeros(1, dtype=torch.uint8, device="cuda"))
            ray.get(answers)
        self._group, self._members = group, members

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray

        self._form(receivers)
        device = torch.device("cuda", torch.cuda.current_device()) if self.resolved_backend == "nccl" else "cpu"
        start, total, count, versions = time.perf_counter(), 0, 0, None
        for count, (bucket, last) in enumerate(flag_last(plan_buckets(named_tensors, self.bucket_bytes)), 1):
            metas, flat = self._pack_buffer.pack(bucket, device)
            answers = [r.receive_bucket.remote(metas, flat.numel(), count - 1, first=count == 1, commit=last)
                       for r in receivers]
            _broadcast(self._group, flat)
            versions = ray.get(answers)
            total += flat.numel()
        versions = versions if versions is not None else commit_nothing(receivers)
        return push_stats(total, count, versions, time.perf_counter() - start)

