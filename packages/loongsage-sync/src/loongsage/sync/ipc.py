"""``ipc``: weights shared by CUDA IPC handle, for engines on the trainer's GPU (colocated).

Two ways, both committing every tensor at once with the last message:

* **in place** (``in_place: true``, the default): the engines read the trainer's own tensors. The
  sender shares the storages its exported tensors live in (torch's CUDA IPC reduction,
  :func:`torch.multiprocessing.reductions.reduce_tensor`: a handle to the allocation, its offset and
  size) with each tensor's place in them; every receiver opens them once and keeps the views. While
  a later push exports the very same tensors (a trainer's parameters are updated in place, so their
  addresses do not move), the sender sends only "the same as push ``n``" and each engine copies
  straight from the trainer's memory into its model: one copy of the weights per push, no buckets.
  The sender holds the shared tensors until it shares others, so an address seen again is the same
  memory. Tensors that are new at every push (LoRA's merged weights, a cast) go the packed way
  after two pushes without a repeat.
* **packed**: each bucket of ``bucket_mb`` MiB is packed into a flat CUDA buffer
  (:mod:`loongsage.core.buckets`) whose handle is sent with the bucket's metadata; each receiver
  stages views of it. A bucket is sent once the next one is queued for packing behind it (the GPU
  packs while the host waits and sends); every bucket of the push is kept until the commit answered.
  Two copies of the weights per push (the pack, the commit).

The trainer's pending work on its stream is finished before another process reads, and the push
returns only once every engine's copy is complete (the trainer may then write its tensors again).
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

from loongsage.core.buckets import (
    TensorMeta,
    bucket_bytes,
    flag_last,
    pack,
    plan_buckets,
    unpack,
    without_aliases,
)
from loongsage.core.contracts import Transport, TransportReceiver
from loongsage.core.transport import commit_nothing, push_stats

Handle = tuple[Any, tuple]  # torch's (rebuild function, arguments) of a CUDA tensor shared by IPC


def _opened(handle: Handle) -> Tensor:
    rebuild, args = handle
    return rebuild(*args)  # the sender's memory, opened in this process


class IpcReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._shared: tuple[int, list[tuple[str, Tensor]]] | None = None  # (share number, views) in place

    def receive(self, how: str, *parts: Any) -> list[tuple[str, Tensor]]:
        """``("bucket", metas, handle)``: views of one packed bucket (kept by the sender until the
        commit); ``("share", n, [(metas, handle), ...])``: views of the trainer's storages, kept;
        ``("same", n)``: the views of share ``n`` again."""
        if how == "bucket":
            self._shared = None  # the sender went the packed way: the trainer's memory is let go
            metas, handle = parts
            return unpack(metas, _opened(handle), copy=False)
        if how == "share":
            number, storages = parts
            self._shared = None  # the views of an earlier share go first: their memory is the sender's to free
            views = [view for metas, handle in storages for view in unpack(metas, _opened(handle), copy=False)]
            self._shared = (number, views)
            return views
        if how == "same":
            (number,) = parts
            if self._shared is None or self._shared[0] != number:
                held = "none" if self._shared is None else f"share {self._shared[0]}"
                raise RuntimeError(
                    f"ipc: the sender refers to its share {number}, this engine holds {held}; nothing was committed"
                )
            return self._shared[1]
        raise ValueError(f"ipc: unknown message {how!r}; allowed: bucket, share, same")


@dataclass
class IpcTransport(Transport):
    """``ipc``: same-GPU weight sync through CUDA IPC handles; in place (one copy) where the exported
    tensors persist, else packed buckets of ``bucket_mb`` MiB."""

    kind = "transport"

    bucket_mb: float = 512.0
    in_place: bool = True

    def __post_init__(self) -> None:
        self.bucket_bytes = bucket_bytes("ipc", self.bucket_mb)
        if not isinstance(self.in_place, bool):
            raise ValueError(f"ipc.in_place={self.in_place!r}: must be true or false")
        self._shares = 0  # shares sent so far; a share's number names it
        self._held: list[tuple[str, Tensor]] = []  # the tensors of the last share (their memory stays ours)
        self._key: tuple | None = None  # what the last share was: (tensors and addresses, receivers)
        self._misses = 0  # pushes in a row whose tensors were not the ones shared before

    def receiver(self) -> IpcReceiver:
        return IpcReceiver()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list) -> dict[str, float]:
        if not torch.cuda.is_available():
            raise RuntimeError("transport 'ipc' needs CUDA (trainer and engines on one GPU); use 'cpu' or 'broadcast'")
        device = torch.device("cuda", torch.cuda.current_device())
        start = time.perf_counter()
        if self.in_place and self._misses < 2:
            tensors = list(without_aliases(named_tensors))
            if tensors and all(t.device == device and t.is_contiguous() for _, t in tensors):
                return self._push_in_place(tensors, receivers, device, start)
            named_tensors = tensors
        self._drop_share()
        return self._push_packed(named_tensors, receivers, device, start)

    # ------------------------------------------------------------------ in place
    def _push_in_place(
        self, tensors: list[tuple[str, Tensor]], receivers: list, device: torch.device, start: float
    ) -> dict[str, float]:
        import ray

        key = (
            tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in tensors),
            tuple(r._actor_id.hex() for r in receivers),
        )
        torch.cuda.current_stream(device).synchronize()  # the trainer's last update is in memory before it is read
        if key == self._key:
            self._misses = 0
            message: tuple = ("same", self._shares)
        else:
            if self._key is not None and key[0] != self._key[0]:
                self._misses += 1  # the tensors shared last time were not exported again
            self._drop_share()
            self._shares += 1
            message = ("share", self._shares, _share(tensors))
            self._held = tensors
        versions = ray.get([r.receive_bucket.remote(*message, first=True, commit=True) for r in receivers])
        if message[0] == "share":
            self._key = key  # only a share every engine took is referred to later
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        return push_stats(total, 1, versions, time.perf_counter() - start)

    def _drop_share(self) -> None:
        self._held, self._key = [], None

    # ------------------------------------------------------------------ packed
    def _push_packed(
        self, named_tensors: Iterable[tuple[str, Tensor]], receivers: list, device: torch.device, start: float
    ) -> dict[str, float]:
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        total, count, answers, earlier = 0, 0, [], []
        held: list[Tensor] = []  # every bucket of this push, until the engines committed it
        packed = None  # the bucket packed last: sent once the next one is queued behind it

        def send(metas: list[TensorMeta], flat: Tensor, ready: torch.cuda.Event, first: bool, last: bool) -> list:
            ready.synchronize()  # packed before another process reads it
            return [
                r.receive_bucket.remote("bucket", metas, reduce_tensor(flat), first=first, commit=last)
                for r in receivers
            ]

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


def _share(tensors: list[tuple[str, Tensor]]) -> list[tuple[list[TensorMeta], Handle]]:
    """Each storage the tensors live in, shared whole, with the tensors' places in it (tensors in
    one storage, such as views of a flat parameter buffer, share one handle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    storages: dict[int, tuple[Any, list[TensorMeta]]] = {}
    for name, tensor in tensors:
        storage = tensor.untyped_storage()
        _, metas = storages.setdefault(storage.data_ptr(), (storage, []))
        metas.append(
            TensorMeta(
                name,
                str(tensor.dtype).removeprefix("torch."),
                tuple(tensor.shape),
                tensor.storage_offset() * tensor.element_size(),
                tensor.numel() * tensor.element_size(),
            )
        )
    return [
        (metas, reduce_tensor(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)))
        for storage, metas in storages.values()
    ]
