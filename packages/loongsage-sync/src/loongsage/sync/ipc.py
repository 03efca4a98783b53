"""``ipc``: buckets shared by CUDA IPC handle, for engines on the trainer's GPU (colocated).

The sender packs each bucket into a flat CUDA buffer (:mod:`loongsage.core.buckets`), exports it
with torch's CUDA IPC reduction (:func:`torch.multiprocessing.reductions.reduce_tensor`: a handle
to the allocation, its offset and size) and sends only that handle and the bucket's metadata. Each
receiver opens the same memory in its own process and stages views of it: the bytes never leave the
card and are copied once more, into the model, when the last bucket commits them all at once. The
sender sends a bucket once the next one is queued for packing behind it (the GPU packs while the
host waits and sends), and keeps every bucket of
the push until the commit answered (no buffer is reused before its consumer is done with it): a
push holds one copy of the weights in buckets on the sender's side for its duration.

Both ends must see the same GPU (colocated placement, or processes sharing one card). Across GPUs
use ``broadcast``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loongsage.core.buckets import TensorMeta, bucket_bytes, flag_last, pack, plan_buckets, unpack
from loongsage.core.embedded.transport import commit_nothing, push_stats
from loongsage.core.contracts import Transport, TransportReceiver


class IpcReceiver(TransportReceiver):
    def receive(self, metas: list[TensorMeta], handle: tuple[Any, tuple]) -> list[tuple[str, Tensor]]:
        rebuild, args = handle
        flat = rebuild(*args)  # the sender's buffer, opened in this process
        # views, no copy: the sender keeps every bucket until the commit has copied them into the model
        return unpack(metas, flat, copy=False)


@dataclass
class IpcTransport(Transport):
    """``ipc``: same-GPU weight sync through CUDA IPC handles, ``bucket_mb`` MiB per bucket."""

    kind = "transport"

    bucket_mb: float = 512.0

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("ipc", self.bucket_mb)

    def receiver(self) -> IpcReceiver:
        return IpcReceiver()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        if not torch.cuda.is_available():
            raise RuntimeError("transport 'ipc' needs CUDA (trainer and engines on one GPU); use 'cpu' or 'broadcast'")
        device = torch.device("cuda", torch.cuda.current_device())
        start, total, count, answers, earlier = time.perf_counter(), 0, 0, [], []
        held: list[Tensor] = []  # every bucket of this push, until the engines committed it
        packed = None  # the bucket packed last: sent once the next one is queued behind it

        def send(metas: list[TensorMeta], flat: Tensor, ready: torch.cuda.Event, first: bool, last: bool) -> list:
            ready.synchronize()  # packed before another process reads it
            return [r.receive_bucket.remote(metas, reduce_tensor(flat), first=first, commit=last) for r in receivers]

        try:
            for count, (bucket, last) in enumerate(flag_last(plan_buckets(named_tensors, self.bucket_bytes)), 1):
                metas, flat = pack(bucket, device=device)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
                held.append(flat)
                total += flat.numel()
                if packed is not None:  # the GPU packs this bucket while the previous one is sent
                    earlier += answers
                    answers = send(*packed)
                    if count == 2:
                        # an engine worker may run calls of one caller concurrently: the first bucket
                        # (which drops what an earlier push left staged) is staged before any other
                        ray.get(answers)
                packed = (metas, flat, ready, count == 1, last)
            if packed is not None:
                earlier += answers
                ray.get(earlier)  # ... and every other bucket before the commit
                answers = send(*packed)
            # a receiver that failed an earlier bucket refuses the commit; the first error is raised
            versions = ray.get(answers) if count else commit_nothing(receivers)
        finally:
            held.clear()
            torch.cuda.ipc_collect()
        return push_stats(total, count, versions, time.perf_counter() - start)
