"""Decode attention over the slot KV cache in Triton: one query token per row, each row reading
exactly its own filled columns.

The torch path attends over a bucket of columns with a boolean mask, so every row reads the
longest row's keys and the query heads that share a kv head (2 for Qwen3-1.7B) fill 2 of a
fused-attention kernel's 64 query rows. Decode attention is bandwidth-bound (it reads each cached
key and value once per step); this kernel reads each row's ``length`` columns once, with the query
heads of one kv head as the rows of one small matrix product (padded to 16, the tensor cores'
smallest tile), an online softmax in float32 and, when the batch alone cannot fill the GPU, the
columns split over several programs whose partial results a second kernel merges (flash decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_BLOCK_N = 64
_PAD_HEADS = 16


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    crow_ptr,
    out_ptr,
    part_ptr,
    scale_log2,
    split_len,
    q_row,
    q_head,
    c_row,
    c_head,
    c_col,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    PAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_ROWS: tl.constexpr,
):
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + row)
    cache_row = tl.load(crow_ptr + row).to(tl.int64) if CACHE_ROWS else row
    start = split * split_len
    stop = tl.minimum(start + split_len, length)
    h = tl.arange(0, PAD)
    d = tl.arange(0, DIM)
    heads = kv * GROUP + h
    real = h < GROUP
    q = tl.load(q_ptr + row * q_row + heads[:, None] * q_head + d[None, :], mask=real[:, None], other=0.0)
    m_i = tl.full([PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([PAD], tl.float32)
    acc = tl.zeros([PAD, DIM], tl.float32)
    base = cache_row * c_row + kv * c_head
    for n in range(start, stop, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        inside = cols < stop
        at = base + cols[:, None] * c_col + d[None, :]
        k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (row * HEADS + heads[:, None]) * DIM + d[None, :], out.to(q.dtype), mask=real[:, None])
    else:
        # partials [rows, HEADS, SPLITS, DIM + 2]: the unnormalised output, then max and sum (base 2)
        at = ((row * HEADS + heads) * SPLITS + split) * (DIM + 2)
        tl.store(part_ptr + at[:, None] + d[None, :], acc, mask=real[:, None])
        tl.store(part_ptr + at + DIM, m_i, mask=real)
        tl.store(part_ptr + at + DIM + 1, l_i, mask=real)


@triton.jit
def _merge_kernel(part_ptr, out_ptr, HEADS: tl.constexpr, SPLITS: tl.constexpr, DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM)
    at = ((row * HEADS + head) * SPLITS + s) * (DIM + 2)
    m = tl.load(part_ptr + at + DIM)
    l_s = tl.load(part_ptr + at + DIM + 1)
    top = tl.max(m, axis=0)
    w = tl.where(l_s > 0, tl.exp2(m - top), 0.0)  # a split past the row's length holds nothing
    acc = tl.load(part_ptr + at[:, None] + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + (row * HEADS + head) * DIM + d, out.to(out_ptr.dtype.element_ty))


def splits_for(rows: int, kv_heads: int, columns: int, programs: int) -> int:
    """Column splits per (row, kv head): enough programs to fill ``programs`` slots, each split at
    least two blocks long; a power of two (the merge kernel's range)."""
    want = max(1, -(-programs // (rows * kv_heads)))
    most = max(1, columns // (2 * _BLOCK_N))
    return 1 << (min(want, most).bit_length() - 1)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    scale: float,
    columns: int,
    *,
    cache_rows: Tensor | None = None,
    splits: int | None = None,
) -> Tensor:
    """Attention of ``q`` ``[B, heads, d]`` over columns ``[0, lengths[b])`` of cache row ``b``
    (of cache row ``cache_rows[b]`` where given: the tokens of one sequence, each a query row).

    ``k_cache``/``v_cache``: ``[>= B, kv_heads, L, d]`` with unit stride on ``d``; ``columns`` bounds
    every length (it sizes the column splits, so it must not vary within one captured graph).
    ``splits=1`` keeps each row's columns in one program, in order: a row's result is then the same
    whatever else runs (the batch-invariant mode). Returns ``[B, heads * d]`` in the query dtype.
    """
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits = splits_for(rows, kv_heads, columns, 2 * sms)
    split_len = -(-columns // (splits * _BLOCK_N)) * _BLOCK_N
    out = q.new_empty(rows, heads, dim)
    part = q.new_empty((rows, heads, splits, dim + 2) if splits > 1 else (1,), dtype=torch.float32)
    _decode_kernel[(rows, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        lengths,
        lengths if cache_rows is None else cache_rows,
        out,
        part,
        scale * _LOG2E,
        split_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        HEADS=heads,
        SPLITS=splits,
        PAD=max(_PAD_HEADS, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_N=_BLOCK_N,
        CACHE_ROWS=cache_rows is not None,
    )
    if splits > 1:
        _merge_kernel[(rows, heads)](part, out, HEADS=heads, SPLITS=splits, DIM=dim)
    return out.view(rows, heads * dim)
