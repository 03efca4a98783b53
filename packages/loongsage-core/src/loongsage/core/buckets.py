"""Weights in flat buffers: the bucketing layer every weight transport shares.

A push exports HF-named tensors in order; :func:`plan_buckets` groups them into buckets of at most
``bucket_bytes`` (a tensor larger than that is a bucket of its own), :func:`pack` copies one bucket
into a flat ``uint8`` tensor on any device with a :class:`TensorMeta` (name, dtype, shape, byte
offset, size) per tensor, and :func:`unpack` gives the tensors back as views of (or copies from)
such a buffer. Offsets are aligned to :data:`ALIGN` bytes so that every view is aligned for its
dtype on any device. What travels is ``(metas, buffer)``; how the buffer travels is the transport's
business (shared memory, a CUDA IPC handle, a broadcast).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

ALIGN = 64  # bytes: at least every dtype's alignment, and a cache line
T = TypeVar("T")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket
    nbytes: int


def bucket_bytes(transport: str, bucket_mb: float) -> int:
    """``bucket_mb`` MiB as bytes, or one line saying what is allowed."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb <= 1 << 20:
        raise ValueError(f"{transport}.bucket_mb={bucket_mb!r}: must be a positive number of MiB (at most 1048576)")
    return max(ALIGN, int(bucket_mb * (1 << 20)))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """The tensors in order, grouped into buckets of at most ``bucket_bytes`` (aligned sizes).

    An alias of a tensor already planned (the same memory under another name: a tied embedding
    and output layer) is left out: the receiving model ties the same names, so updating one
    updates both, and sending it would move the same bytes twice.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    pending: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in without_aliases(named_tensors):
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if pending and size + nbytes > bucket_bytes:
            yield pending
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pending


def without_aliases(named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The tensors in order, each alias of one already given (the same memory under another name: a
    tied embedding and output layer) left out."""
    seen: set[tuple] = set()
    for name, tensor in named_tensors:
        key = _memory(tensor)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        yield name, tensor


def _memory(tensor: Tensor) -> tuple | None:
    """What identifies the memory a tensor views (None where it has none to compare: meta tensors);
    its address, not its storage's: cheaper, and the same for the same view."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    return tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


_END = object()


def flag_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last one (a push commits with its last bucket, known only
    once the next is found missing: one item of look-ahead)."""
    it = iter(items)
    current = next(it, _END)
    while current is not _END:
        following = next(it, _END)
        yield current, following is _END
        current = following


def layout(bucket: list[tuple[str, Tensor]]) -> tuple[list[TensorMeta], int]:
    """The metadata of a bucket and its buffer's size in bytes."""
    metas, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return metas, offset


def pack(
    bucket: list[tuple[str, Tensor]], out: Tensor | None = None, device: torch.device | str | None = None
) -> tuple[list[TensorMeta], Tensor]:
    """``(metas, flat uint8 buffer)`` of one bucket: into ``out`` (at least the bucket's size) or a
    new buffer on ``device`` (default: the first tensor's)."""
    metas, size = layout(bucket)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=device or (bucket[0][1].device if bucket else "cpu"))
    elif out.numel() < size or out.dtype != torch.uint8:
        raise ValueError(f"pack: the buffer holds {out.numel()} bytes of {out.dtype}; the bucket needs {size} of uint8")
    return metas, _fill(bucket, metas, out[:size])


def _fill(bucket: list[tuple[str, Tensor]], metas: list[TensorMeta], flat: Tensor) -> Tensor:
    dests, sources = [], []
    for meta, (_, tensor) in zip(metas, bucket):
        if meta.nbytes:
            # typed views (offsets are aligned): a copy of bf16 elements runs about twice as fast on
            # a GPU as the same bytes copied as uint8
            dests.append(flat[meta.offset : meta.offset + meta.nbytes].view(tensor.dtype))
            sources.append(tensor.detach().reshape(-1))
    if dests:
        torch._foreach_copy_(dests, sources, non_blocking=True)  # one batched copy, not one call per tensor
    return flat


class PackBuffer:
    """One pack buffer a sender keeps across buckets and pushes, grown when a bucket needs more.

    For senders whose bucket is consumed (copied out, or its broadcast ordered) before the next one
    is packed; fresh memory for every bucket costs more to fault in than the copy itself.
    """

    def __init__(self, min_bytes: int):
        self.min_bytes = min_bytes
        self.buffer: Tensor | None = None

    def pack(
        self, bucket: list[tuple[str, Tensor]], device: torch.device | str = "cpu"
    ) -> tuple[list[TensorMeta], Tensor]:
        metas, size = layout(bucket)
        device = torch.device(device)
        if self.buffer is None or self.buffer.numel() < size or self.buffer.device != device:
            self.buffer = torch.empty(max(size, self.min_bytes), dtype=torch.uint8, device=device)
        return metas, _fill(bucket, metas, self.buffer[:size])


def unpack(metas: list[TensorMeta], flat: Tensor, *, copy: bool = True) -> list[tuple[str, Tensor]]:
    """The tensors of a bucket; ``copy=False``: views of ``flat`` (valid while it is)."""
    out = []
    for m in metas:
        view = flat[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).reshape(m.shape)
        out.append((m.name, view.clone() if copy else view))
    return out


def checksums(named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, int]:
    """A per-tensor checksum of the exact bytes (to check that an update arrived bit for bit)."""
    out = {}
    for name, tensor in named_tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        # int64 sums of byte values weighted by position mod a prime: equal bytes give equal sums
        weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
        out[name] = int((raw.to(torch.int64) * weights).sum())
    return out
