"""``ipc``: buckets shared by CUDA IPC handle, for engines on the trainer's GPU (colocated).

The sender packs each bucket into a flat CUDA buffer (:mod:`loongsage.core.buckets`), exports it
with torch's CUDA IPC reduction (:func:`torch.multiprocessing.reductions.reduce_tensor`: a handle
to the allocation, its offset and size) and sends only that handle and the bucket's metadata. Each
receiver opens the same memory in its own process and copies the tensors out on the GPU: the bytes
never leave the card. Two buffers alternate, so the sender packs bucket k+1 while the receivers
copy bucket k, and a buffer is refilled only after every receiver of its previous bucket answered
(never before the consumer is done with it). The receiving engine stages the copies; the last
bucket commits them all at once.

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

from loongsage.core.buckets import TensorMeta, bucket_bytes, layout, pack, plan_buckets, unpack
from loongsage.core.contracts import Transport, TransportReceiver


class IpcReceiver(TransportReceiver):
    def receive(self, metas: list[TensorMeta], handle: tuple[Any, tuple]) -> list[tuple[str, Tensor]]:
        rebuild, args = handle
        flat = rebuild(*args)  # the sender's buffer, opened in this process
        out = unpack(metas, flat, copy=True)
        torch.cuda.current_stream(flat.device).synchronize()  # copied before the sender may refill it
        del flat
        return out


@dataclass
class IpcTransport(Transport):
    """``ipc``: same-GPU weight sync through CUDA IPC handles, ``bucket_mb`` MiB per bucket."""

    kind = "transport"

    bucket_mb: float = 512.0

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("ipc", self.bucket_mb)
        self._buffers: list[Tensor | None] = [None, None]

    def receiver(self) -> IpcReceiver:
        return IpcReceiver()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        if not torch.cuda.is_available():
            raise RuntimeError("transport 'ipc' needs CUDA (trainer and engines on one GPU); use 'cpu' or 'broadcast'")
        device = torch.device("cuda", torch.cuda.current_device())
        in_flight: list[list | None] = [None, None]  # the receivers' answers for what each buffer holds
        start, total, count, versions = time.perf_counter(), 0, 0, None
        buckets = plan_buckets(named_tensors, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            following = next(buckets, None)
            slot = count % 2
            if in_flight[slot] is not None:
                ray.get(in_flight[slot])  # the buffer's previous bucket is copied out everywhere
            _, size = layout(bucket)
            if self._buffers[slot] is None or self._buffers[slot].numel() < size:
                self._buffers[slot] = None
                self._buffers[slot] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=device)
            metas, flat = pack(bucket, out=self._buffers[slot])
            torch.cuda.current_stream(device).synchronize()  # packed before another process reads it
            handle = reduce_tensor(flat)
            in_flight[slot] = [r.receive_bucket.remote(metas, handle, first=count == 0, commit=following is None)
                               for r in receivers]
            total, count, bucket = total + size, count + 1, following
        for answers in in_flight:
            if answers is not None:
                versions = ray.get(answers)
        if versions is None:  # nothing to send still moves every receiver to the next version
            versions = ray.get([r.receive_bucket.remote(first=True, commit=True) for r in receivers])
        torch.cuda.ipc_collect()
        seconds = time.perf_counter() - start
        return {"sync/bytes": float(total), "sync/buckets": float(count), "sync/version": float(max(versions)),
                "sync/seconds": seconds, "sync/gb_per_s": total / seconds / 1e9 if seconds > 0 else 0.0}

    def release(self) -> None:
        """Free the two bucket buffers (a colocated trainer gives the GPU to the engine)."""
        self._buffers = [None, None]
