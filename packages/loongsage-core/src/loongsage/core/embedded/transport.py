"""The CPU weight transport: HF-named tensors bucketed into flat byte buffers.

The sender packs tensors into buckets of at most ``bucket_bytes`` (one tensor larger than that gets
a bucket of its own) and ships each bucket once through Ray's shared-memory object store; every
receiver on the node maps the same buffer zero-copy and copies the tensors out into a staging
area. The engine swaps the staged weights in atomically between decode steps with the last bucket
(the commit), so no request sees half an update. A producer buffer is never reused: each bucket is
a fresh object that lives until every receiver has answered.
"""

from __future__ import annotations

import warnings

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loongsage.core.contracts import Transport


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket
    nbytes: int


def pack_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[tuple[list[TensorMeta], np.ndarray]]:
    """Yield ``(metadata, flat uint8 buffer)`` buckets holding the given tensors in order."""
    pending: list[tuple[str, Tensor]] = []
    size = 0

    def flush() -> tuple[list[TensorMeta], np.ndarray]:
        buffer = np.empty(size, dtype=np.uint8)
        metas, offset = [], 0
        for name, tensor in pending:
            raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            buffer[offset:offset + raw.size] = raw
            metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, raw.size))
            offset += raw.size
        return metas, buffer

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield flush()


def unpack_bucket(metas: list[TensorMeta], buffer: np.ndarray) -> Iterator[tuple[str, Tensor]]:
    """Tensors of one bucket, copied out of ``buffer`` (which may be a read-only shared view)."""
    with warnings.catch_warnings():
        # A shared-memory view is read-only; it is only read here and every tensor is cloned out.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(memoryview(buffer), dtype=torch.uint8) if buffer.size else torch.empty(0, dtype=torch.uint8)
    for m in metas:
        dtype = getattr(torch, m.dtype)
        yield m.name, flat[m.offset:m.offset + m.nbytes].view(dtype).reshape(m.shape).clone()


@dataclass
class CpuTransport(Transport):
    """Sender side of the CPU transport; receivers expose ``receive_bucket`` and ``commit_weights``."""

    kind = "transport"

    bucket_mb: int = 64

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        """Send every tensor to every receiver (Ray actor handles); return transfer statistics.

        The last bucket's call also commits, so an update costs one round trip per bucket.
        """
        import ray

        total, buckets, versions = 0, 0, [0]
        pending = None
        for bucket in pack_buckets(named_tensors, self.bucket_mb << 20):
            if pending is not None:
                self._send(pending, receivers, commit=False)
            pending = bucket
            total += bucket[1].nbytes
            buckets += 1
        if pending is None:  # nothing to send still moves every receiver to the next version
            versions = ray.get([r.commit_weights.remote() for r in receivers])
        else:
            versions = self._send(pending, receivers, commit=True)
        return {"sync/bytes": float(total), "sync/buckets": float(buckets), "sync/version": float(max(versions))}

    @staticmethod
    def _send(bucket: tuple[list[TensorMeta], np.ndarray], receivers: list, *, commit: bool) -> list:
        import ray

        metas, buffer = bucket
        ref = ray.put(buffer)  # one shared-memory copy that every receiver on the node maps
        return ray.get([r.receive_bucket.remote(metas, ref, commit) for r in receivers])
