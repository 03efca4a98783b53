"""CUDA graphs for the native engine's decode step.

At small batch a decode step is launch-bound: a Qwen3-1.7B-shaped model issues about 25 kernels
per layer, each costing microseconds of Python and driver time, while the maths of the whole step
takes about a millisecond on an H200. A captured graph replays the whole decoder in one launch;
where the fused sampler applies, the graph holds the whole decode step: forward, sampling and the
per-slot bookkeeping (:mod:`loongsage.core.engine.continuous`), so nothing of a step runs outside it.

Graphs need static shapes and addresses. A decode step's shapes vary with the number of decoding
slots (rows) and the longest row (columns), so both are rounded up to buckets — rows to a power of
two (capped at the allocated slots), columns to a multiple of ``column_step`` (capped at
``max_model_len``) — and one graph is captured per bucket the first time it is needed. Extra rows
compute throw-away values, exactly as non-decoding slots below the highest decoding one already do
in the eager path, and extra columns are masked. The forward reads its inputs from the slot batch's
own per-slot tensors and KV buffers, which a graph captures by address: :meth:`DecodeGraphs.clear`
must be called whenever those are reallocated (the cache grew or was released).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (rows, columns) -> float32 logits [rows, vocab], or None for a whole decode step (forward, sampling
# and bookkeeping, whose results stay in the slot batch's tensors)
DecodeForward = Callable[[int, int], Tensor | None]


class DecodeGraphs:
    """Captured decode steps, one per (what, rows, columns) bucket, sharing one memory pool."""

    def __init__(self, max_model_len: int, column_step: int = 64):
        self.max_model_len, self.column_step = int(max_model_len), int(column_step)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor | None]] = {}
        self._pool = None
        self.captures = 0

    def bucket(self, rows: int, columns: int, allocated: int) -> tuple[int, int]:
        padded_rows = min(1 << (rows - 1).bit_length(), allocated)
        padded_cols = min(-(-columns // self.column_step) * self.column_step, self.max_model_len)
        return padded_rows, padded_cols

    def run(
        self, forward: DecodeForward, rows: int, columns: int, allocated: int, keep: tuple[Tensor, ...] = ()
    ) -> Tensor | None:
        """``forward``'s output for the first ``rows`` slots (later rows of the bucket are
        throw-away); a forward is captured once per bucket and told apart by its name. ``keep``:
        tensors the eager warm-up run before a capture must leave as they were (a whole decode step
        advances its rows; only the replay may)."""
        padded = self.bucket(rows, columns, allocated)
        key = (forward.__name__, *padded)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(forward, *padded, keep)
        graph, out = entry
        graph.replay()
        return None if out is None else out[:rows]

    def _capture(
        self, forward: DecodeForward, rows: int, columns: int, keep: tuple[Tensor, ...]
    ) -> tuple[torch.cuda.CUDAGraph, Tensor | None]:
        # One eager run on a side stream first: lazy initialisation (cuBLAS handles, autotuning,
        # Triton's compilation) must not happen inside the capture. It writes the same cache
        # columns and token columns the replay writes next; the state it advances is put back.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            saved = [t.clone() for t in keep]
            forward(rows, columns)
            for t, s in zip(keep, saved):
                t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Graphs replay one at a time and each output is consumed before the next replay, so
        # they can share one pool: memory is that of the largest bucket, not the sum.
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward(rows, columns)
        self._pool = graph.pool()
        self.captures += 1
        return graph, out

    def clear(self) -> None:
        """Forget every graph (the buffers they captured were reallocated)."""
        self._graphs.clear()
        self._pool = None
