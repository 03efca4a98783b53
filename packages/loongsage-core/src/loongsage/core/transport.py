"""The CPU weight transport (``cpu``): buckets through Ray's shared-memory object store.

The sender packs each bucket into a flat byte buffer (:mod:`loongsage.core.buckets`) and ships it
once with ``ray.put``; every receiver on the node maps the same buffer zero-copy and copies the
tensors out into its engine's staging area. The last bucket commits: the engine swaps the staged
weights in atomically between decode steps, so no request sees half an update. The sender packs
every bucket into one buffer it keeps (``ray.put`` has copied the bytes out when it returns); each
bucket in the store is a fresh object that lives until every receiver has answered.

What every weight transport's push ends with is here too: :func:`commit_nothing` (a push with no
tensors still moves the receivers to the next version) and :func:`push_stats` (its ``sync/*``
statistics); the bucketing itself is :mod:`loongsage.core.buckets`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loongsage.core.buckets import PackBuffer, TensorMeta, bucket_bytes, flag_last, plan_buckets, unpack
from loongsage.core.contracts import Transport, TransportReceiver


class CpuReceiver(TransportReceiver):
    def receive(self, metas: list[TensorMeta], buffer: np.ndarray) -> list[tuple[str, Tensor]]:
        with warnings.catch_warnings():
            # A shared-memory view is read-only; it is only read here and every tensor is copied out.
            warnings.simplefilter("ignore", UserWarning)
            flat = (
                torch.frombuffer(memoryview(buffer), dtype=torch.uint8)
                if buffer.size
                else torch.empty(0, dtype=torch.uint8)
            )
        return unpack(metas, flat, copy=True)


def commit_nothing(receivers: list) -> list[int]:
    """The commit of a push with no tensors: every receiver still moves to the next version."""
    import ray

    return ray.get([r.receive_bucket.remote(first=True, commit=True) for r in receivers])


def push_stats(total: int, count: int, versions: list[int], seconds: float | None = None) -> dict[str, float]:
    """A push's ``sync/*`` statistics (with ``seconds``: its duration and throughput too)."""
    out = {"sync/bytes": float(total), "sync/buckets": float(count), "sync/version": float(max(versions))}
    if seconds is not None:
        out.update({"sync/seconds": seconds, "sync/gb_per_s": total / seconds / 1e9 if seconds > 0 else 0.0})
    return out


@dataclass
class CpuTransport(Transport):
    """``cpu``: buckets of ``bucket_mb`` MiB through the object store (receivers on the trainer's node
    map them; on other nodes Ray copies them over)."""

    kind = "transport"

    bucket_mb: float = 64.0

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("cpu", self.bucket_mb)
        # one buffer for every bucket of every push: ray.put has copied it when it returns
        self._pack_buffer = PackBuffer(self.bucket_bytes)

    def receiver(self) -> CpuReceiver:
        return CpuReceiver()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        import ray

        total, count, versions = 0, 0, None
        buckets = plan_buckets(((n, t.cpu()) for n, t in named_tensors), self.bucket_bytes)
        for count, (bucket, last) in enumerate(flag_last(buckets), 1):
            metas, flat = self._pack_buffer.pack(bucket)
            ref = ray.put(flat.numpy())  # one shared-memory copy that every receiver on the node maps
            versions = ray.get([r.receive_bucket.remote(metas, ref, first=count == 1, commit=last) for r in receivers])
            total += flat.numel()
        return push_stats(total, count, versions if versions is not None else commit_nothing(receivers))
