"""The CPU weight transport (``cpu``): buckets through Ray's shared-memory object store.

The sender packs each bucket into a flat byte buffer (:mod:`loongsage.core.buckets`) and ships it
once with ``ray.put``; every receiver on the node maps the same buffer zero-copy and copies the
tensors out into its engine's staging area. The last bucket commits: the engine swaps the staged
weights in atomically between decode steps, so no request sees half an update. A producer buffer
is never reused: each bucket is a fresh object that lives until every receiver has answered.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loongsage.core.buckets import TensorMeta, bucket_bytes, pack, plan_buckets, unpack
from loongsage.core.contracts import Transport, TransportReceiver


class CpuReceiver(TransportReceiver):
    def receive(self, metas: list[TensorMeta], buffer: np.ndarray) -> list[tuple[str, Tensor]]:
        with warnings.catch_warnings():
            # A shared-memory view is read-only; it is only read here and every tensor is copied out.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(buffer), dtype=torch.uint8) if buffer.size else torch.empty(0, dtype=torch.uint8)
        return unpack(metas, flat, copy=True)


def push_in_buckets(buckets: Iterable[Any], receivers: list, send) -> tuple[list[int], int, int]:
    """Drive a push: ``send(bucket, first, commit) -> versions`` for each bucket, the last one
    committing (an empty push still commits, so every receiver moves to the next version).
    Returns the receivers' versions, the bytes and the buckets sent."""
    import ray

    total, count, pending = 0, 0, None
    for bucket in buckets:  # one bucket ahead: the last one is known only when the next is not there
        if pending is not None:
            send(pending, count == 1, False)
        pending = bucket
        count += 1
        total += int(bucket[1].nbytes)
    if pending is None:
        return ray.get([r.receive_bucket.remote(first=True, commit=True) for r in receivers]), 0, 0
    return send(pending, count == 1, True), total, count


@dataclass
class CpuTransport(Transport):
    """``cpu``: buckets of ``bucket_mb`` MiB through the object store (receivers on the trainer's node
    map them; on other nodes Ray copies them over)."""

    kind = "transport"

    bucket_mb: float = 64.0

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("cpu", self.bucket_mb)

    def receiver(self) -> CpuReceiver:
        return CpuReceiver()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray

        def send(bucket, first: bool, commit: bool) -> list[int]:
            metas, flat = bucket
            ref = ray.put(flat.numpy())  # one shared-memory copy that every receiver on the node maps
            return ray.get([r.receive_bucket.remote(metas, ref, first=first, commit=commit) for r in receivers])

        buckets = (pack(b, device="cpu") for b in plan_buckets(((n, t.cpu()) for n, t in named_tensors),
                                                               self.bucket_bytes))
        versions, total, count = push_in_buckets(buckets, receivers, send)
        return {"sync/bytes": float(total), "sync/buckets": float(count), "sync/version": float(max(versions))}
