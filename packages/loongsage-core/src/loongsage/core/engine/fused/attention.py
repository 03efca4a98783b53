"""Decode attention over the slot KV cache in Triton: one query token per row, each row reading
exactly its own filled columns.

The torch path attends over a bucket of columns with a boolean mask, so every row reads the
longest row's keys and the query heads that share a kv head (2 for Qwen3-1.7B) fill 2 of a
fused-attention kernel's 64 query rows. Decode attention is bandwidth-bound (it reads each cached
key and value once per step); this kernel reads each row's ``length`` columns once, with the query
heads of one kv head as the rows of one small matrix product (padded to 16, the tensor cores'
smallest tile), an online softmax in float32 and, when the batch alone cannot fill the GPU, the
columns split over several programs whose partial results a second kernel merges (flash decoding).

Shared prefixes (cascade decoding): the ``n`` samples of one request decode over one prompt, each
slot holding its own copy of the prompt's keys and values. Given :class:`SharedPrefixes`, a tile
of up to ``16 // group`` such rows reads the prompt's whole blocks of 64 columns once, from one
member's slot, the query heads of all its members the rows of one matrix product, while each row
reads its columns after those by itself; the merge kernel combines the two partial results. A GRPO
group of 8 samples over a 128-token prompt then reads the prompt's keys once where it read them 8
times. The batch-invariant mode shares prefixes too, without a merge: the tile stops at the end
of the prompt's last whole block of columns and stores each row's online-softmax state (float32),
from which the row's own program carries on. Every row then computes exactly the blocks, in the
order, that a row reading its whole cache in one program computes: the same bits. Its tiles are
exactly as tall as a decode program's (:func:`tile_members`), which leaves no room to share past 8
query heads a kv head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_BLOCK_N = 64
_PAD_HEADS = 16


@triton.jit
def _attend(
    q,
    k_ptr,
    v_ptr,
    base,
    start,
    stop,
    row_stop,
    c_col,
    scale_log2,
    acc,
    m_i,
    l_i,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax of the query rows ``q`` ``[PAD, DIM]`` over cache columns ``[start, stop)``
    from ``base``, row ``r`` over those before ``row_stop[r]`` (``<= stop``), carried on from the
    state ``acc, m_i, l_i`` (:func:`_fresh` before any column): the unnormalised output, the
    running max and sum (base 2), in float32.

    A row's numbers depend only on its own query and columns: a block of columns past its
    ``row_stop`` leaves them exactly as they were (max unchanged, ``exp2(0) = 1``, zeros added),
    so rows with different stops can share the reads of one program (:func:`causal_attention`).
    A state stored in float32 and loaded again carries on bit for bit as if the program had never
    stopped: the batch-invariant path's shared prefixes (see the module docstring)."""
    d = tl.arange(0, DIM)
    for n in range(start, stop, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        inside = cols < stop
        at = base + cols[:, None] * c_col + d[None, :]
        k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(cols[None, :] < row_stop[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fresh(PAD: tl.constexpr, DIM: tl.constexpr):
    """The online softmax's state before any column: no output, max -inf, sum 0."""
    return tl.zeros([PAD, DIM], tl.float32), tl.full([PAD], float("-inf"), tl.float32), tl.zeros([PAD], tl.float32)


@triton.jit
def _store_partial(part_ptr, at, acc, m_i, l_i, real, DIM: tl.constexpr):
    """Partials ``[rows, heads, splits, DIM + 2]``: the unnormalised output, then max and sum."""
    d = tl.arange(0, DIM)
    tl.store(part_ptr + at[:, None] + d[None, :], acc, mask=real[:, None])
    tl.store(part_ptr + at + DIM, m_i, mask=real)
    tl.store(part_ptr + at + DIM + 1, l_i, mask=real)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    crow_ptr,
    first_ptr,
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
    PREFIX_SPLITS: tl.constexpr,
    PAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_ROWS: tl.constexpr,
    RESUME: tl.constexpr,
):
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + row)
    cache_row = tl.load(crow_ptr + row).to(tl.int64) if CACHE_ROWS else row
    # a row of a shared-prefix tile starts after the prefix, which its tile reads (0: no tile)
    first = tl.load(first_ptr + row) if PREFIX_SPLITS > 0 else 0
    first -= first % BLOCK_N  # a tile reads whole blocks: the batch-invariant path's blocks start there
    start = first + split * split_len
    stop = tl.minimum(start + split_len, length)
    h = tl.arange(0, PAD)
    d = tl.arange(0, DIM)
    heads = kv * GROUP + h
    real = h < GROUP
    q = tl.load(q_ptr + row * q_row + heads[:, None] * q_head + d[None, :], mask=real[:, None], other=0.0)
    base = cache_row * c_row + kv * c_head
    acc, m_i, l_i = _fresh(PAD, DIM)
    if RESUME:  # carry on from the state the row's prefix tile stored (a row of no tile: a fresh one)
        at = (row * HEADS + heads) * (PREFIX_SPLITS + SPLITS) * (DIM + 2)  # _prefix_kernel's split 0
        tiled = real & (h * 0 + first > 0)
        acc = tl.load(part_ptr + at[:, None] + d[None, :], mask=tiled[:, None], other=0.0)
        m_i = tl.load(part_ptr + at + DIM, mask=tiled, other=float("-inf"))
        l_i = tl.load(part_ptr + at + DIM + 1, mask=tiled, other=0.0)
    ends = h * 0 + stop
    acc, m_i, l_i = _attend(q, k_ptr, v_ptr, base, start, stop, ends, c_col, scale_log2, acc, m_i, l_i, DIM, BLOCK_N)
    if RESUME or (SPLITS == 1 and PREFIX_SPLITS == 0):
        out = acc / l_i[:, None]
        tl.store(out_ptr + (row * HEADS + heads[:, None]) * DIM + d[None, :], out.to(q.dtype), mask=real[:, None])
    else:
        total = PREFIX_SPLITS + SPLITS  # the prefix tiles' partials first
        at = ((row * HEADS + heads) * total + PREFIX_SPLITS + split) * (DIM + 2)
        _store_partial(part_ptr, at, acc, m_i, l_i, real, DIM)
        if PREFIX_SPLITS > 0:  # a row of no tile: its prefix partials are empty (the merge skips them)
            # (first and split are >= 0) compared as a vector: Triton's interpreter refuses a mask
            # made with a scalar condition
            alone = real & (h * 0 + first + split == 0)
            no_acc, no_max = tl.zeros([PAD, DIM], tl.float32), tl.full([PAD], float("-inf"), tl.float32)
            no_sum = tl.zeros([PAD], tl.float32)
            for p in tl.static_range(PREFIX_SPLITS):
                at = ((row * HEADS + heads) * total + p) * (DIM + 2)
                _store_partial(part_ptr, at, no_acc, no_max, no_sum, alone, DIM)


@triton.jit
def _prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tiles_ptr,
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
    PREFIX_SPLITS: tl.constexpr,
    MEMBERS: tl.constexpr,
    PAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One tile's shared prefix for one kv head and one split of its columns: the query heads of
    every member row are the rows of one matrix product over the tile's source cache row."""
    tile = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    entry = tiles_ptr + tile * (MEMBERS + 2)
    source = tl.load(entry).to(tl.int64)
    prefix = tl.load(entry + 1)
    prefix -= prefix % BLOCK_N  # whole blocks (see _decode_kernel)
    t = tl.arange(0, PAD)
    member, head = t // GROUP, t % GROUP
    row = tl.load(entry + 2 + member, mask=member < MEMBERS, other=-1)
    real = row >= 0
    row = tl.where(real, row, 0).to(tl.int64)
    heads = kv * GROUP + head
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + row[:, None] * q_row + heads[:, None] * q_head + d[None, :], mask=real[:, None], other=0.0)
    start = split * split_len
    stop = tl.minimum(start + split_len, prefix)
    base = source * c_row + kv * c_head
    acc, m_i, l_i = _fresh(PAD, DIM)
    ends = t * 0 + stop
    acc, m_i, l_i = _attend(q, k_ptr, v_ptr, base, start, stop, ends, c_col, scale_log2, acc, m_i, l_i, DIM, BLOCK_N)
    at = ((row * HEADS + heads) * (PREFIX_SPLITS + SPLITS) + split) * (DIM + 2)
    _store_partial(part_ptr, at, acc, m_i, l_i, real, DIM)


@triton.jit
def _causal_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    scale_log2,
    width,
    q_row,
    q_head,
    c_row,
    c_head,
    c_col,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    PAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``TOKENS`` consecutive tokens of one sequence and one kv head: their query heads are the
    rows of the same ``[PAD, DIM]`` tile a decode program multiplies (one token's heads, padded),
    so each row's numbers are the decode kernel's, while the block reads its columns once."""
    seq = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    kv = tl.program_id(2)
    t = tl.arange(0, PAD)
    token, head = t // GROUP, t % GROUP
    pos = block * TOKENS + token
    real = (token < TOKENS) & (pos < width)
    row = seq * width + pos
    heads = kv * GROUP + head
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + row[:, None] * q_row + heads[:, None] * q_head + d[None, :], mask=real[:, None], other=0.0)
    stop = tl.minimum((block + 1) * TOKENS, width)
    # a padding row reads every column the block reads (it is never stored): no row of -inf alone
    row_stop = tl.where(real, pos + 1, stop)
    acc, m_i, l_i = _fresh(PAD, DIM)
    base = seq * c_row + kv * c_head
    acc, m_i, l_i = _attend(q, k_ptr, v_ptr, base, 0, stop, row_stop, c_col, scale_log2, acc, m_i, l_i, DIM, BLOCK_N)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (row[:, None] * HEADS + heads[:, None]) * DIM + d[None, :], out.to(q.dtype), mask=real[:, None])


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


class SharedPrefixes(NamedTuple):
    """Decode rows that share their first columns, in tiles (see the module docstring).

    ``tiles`` ``[T, 2 + members]`` int32: each tile's source cache row (any member's: each holds the
    same prefix), its prefix length, then its member rows (-1 past the last); a tile of prefix 0 is
    empty. ``first`` ``[rows]`` int32: the column each row reads from by itself (its tile's prefix
    length, 0 for a row in no tile). The kernels cut both to whole blocks of 64 columns, as
    :func:`shared_prefix_tiles` makes them. Both are read on the device, so a captured graph
    replays with whatever tiles they hold.
    """

    tiles: Tensor
    first: Tensor


def _decode_pad(group: int) -> int:
    """The rows of a decode program's query tile: one token's ``group`` heads, padded."""
    return max(_PAD_HEADS, triton.next_power_of_2(group))


def tile_members(group: int, invariant: bool = False) -> int:
    """Rows per shared-prefix tile: their query heads fill one 16-row tensor-core tile (at least
    two rows). On the batch-invariant path a tile must be exactly as tall as a decode program's,
    so its members' sums are those of a row alone (as :func:`causal_attention` keeps it): a group
    past 8 heads then leaves room for one row, and sharing does not apply (1)."""
    if invariant:
        return _decode_pad(group) // group
    return max(2, _PAD_HEADS // group)


def shared_prefix_tiles(groups: list[tuple[list[int], int]], members: int) -> list[tuple[int, list[int]]]:
    """``groups``: the rows decoding over one prefix and its length. Each group of at least two
    rows and a prefix of at least one block of columns, split into as few tiles of at most
    ``members`` rows as hold it, as even as can be; (prefix, rows) per tile, the prefix cut to whole
    blocks of columns (the rows read the rest alone: a row's blocks then begin where a row reading
    its whole cache begins them, which the batch-invariant path needs)."""
    tiles = []
    for rows, prefix in groups:
        prefix -= prefix % _BLOCK_N
        if len(rows) < 2 or prefix == 0:
            continue
        count = -(-len(rows) // members)
        size, extra = divmod(len(rows), count)
        at = 0
        for i in range(count):
            n = size + (i < extra)
            tiles.append((prefix, rows[at : at + n]))
            at += n
    return tiles


def tile_tables(groups: list[tuple[list[int], int]], members: int, tiles: int, rows: int) -> SharedPrefixes:
    """The host-side tables of :class:`SharedPrefixes` for ``groups`` (rows decoding over one
    prefix, and its length; see :func:`shared_prefix_tiles`): ``tiles`` entries, ``rows`` rows."""
    table = torch.full((tiles, 2 + members), -1, dtype=torch.int32)
    table[:, 1] = 0  # an empty tile
    first = torch.zeros(rows, dtype=torch.int32)
    for t, (prefix, members_of) in enumerate(shared_prefix_tiles(groups, members)):
        table[t, 0], table[t, 1] = members_of[0], prefix
        table[t, 2 : 2 + len(members_of)] = torch.tensor(members_of, dtype=torch.int32)
        first[members_of] = prefix
    return SharedPrefixes(table, first)


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
    shared: SharedPrefixes | None = None,
) -> Tensor:
    """Attention of ``q`` ``[B, heads, d]`` over columns ``[0, lengths[b])`` of cache row ``b``
    (of cache row ``cache_rows[b]`` where given: the tokens of one sequence, each a query row).

    ``k_cache``/``v_cache``: ``[>= B, kv_heads, L, d]`` with unit stride on ``d``; ``columns`` bounds
    every length (it sizes the column splits, so it must not vary within one captured graph).
    ``splits=1`` keeps each row's columns in one program, in order: a row's result is then the same
    whatever else runs (the batch-invariant mode). ``shared`` (decode rows only, no ``cache_rows``):
    tiles of rows whose common prefix is read once per tile; with ``splits=1`` each row carries on
    from its tile's state where the prefix ends, in the same program order, so the result stays
    the batch-invariant one bit for bit. Returns ``[B, heads * d]`` in the query dtype.
    """
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if shared is not None and cache_rows is not None:
        raise ValueError("decode_attention: shared prefixes are for decode rows, not a sequence's tokens (cache_rows)")
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits = splits_for(rows, kv_heads, columns, 2 * sms)
    resume = shared is not None and splits == 1  # the prefix's state carried on, not merged
    if resume and shared.tiles.shape[1] - 2 > tile_members(group, invariant=True):
        raise ValueError(
            f"decode_attention: a batch-invariant tile holds at most {tile_members(group, invariant=True)} rows "
            f"of {group} heads (the decode kernel's tile), got {shared.tiles.shape[1] - 2}"
        )
    prefix_splits = 0 if shared is None else splits  # the total stays a power of two
    split_len = -(-columns // (splits * _BLOCK_N)) * _BLOCK_N
    total = splits + prefix_splits
    out = q.new_empty(rows, heads, dim)
    part = q.new_empty((rows, heads, total, dim + 2) if total > 1 else (1,), dtype=torch.float32)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    common = {"GROUP": group, "HEADS": heads, "SPLITS": splits, "PREFIX_SPLITS": prefix_splits, "DIM": dim}
    common["BLOCK_N"] = _BLOCK_N
    if shared is not None:
        tiles, members = shared.tiles, shared.tiles.shape[1] - 2
        _prefix_kernel[(tiles.shape[0], kv_heads, prefix_splits)](
            q,
            k_cache,
            v_cache,
            tiles,
            part,
            scale * _LOG2E,
            split_len,
            *strides,
            MEMBERS=members,
            PAD=_decode_pad(members * group),
            **common,
        )
    _decode_kernel[(rows, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        lengths,
        lengths if cache_rows is None else cache_rows,
        lengths if shared is None else shared.first,
        out,
        part,
        scale * _LOG2E,
        split_len,
        *strides,
        PAD=_decode_pad(group),
        CACHE_ROWS=cache_rows is not None,
        RESUME=resume,
        **common,
    )
    if total > 1 and not resume:
        _merge_kernel[(rows, heads)](part, out, HEADS=heads, SPLITS=total, DIM=dim)
    return out.view(rows, heads * dim)


def causal_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
    """Causal attention of ``rows`` whole sequences: ``q`` ``[rows * width, heads, d]`` (token ``n``
    is sequence ``n // width`` at position ``n % width``) over caches ``[rows, kv_heads, width, d]``
    that hold every position. Bit for bit what :func:`decode_attention` with ``splits=1`` gives each
    token (its columns in one program, in order: the batch-invariant path), but a program takes
    ``16 // group`` tokens at once and reads their columns once. Returns ``[rows * width, heads * d]``."""
    tokens, heads, dim = q.shape
    rows, kv_heads, width, _ = k_cache.shape
    if v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("causal_attention: key and value caches of one layout, unit stride on d (and q)")
    group = heads // kv_heads
    pad = _decode_pad(group)  # the decode kernel's tile
    per_program = max(1, pad // group)
    out = q.new_empty(tokens, heads, dim)
    _causal_kernel[(rows, triton.cdiv(width, per_program), kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        scale * _LOG2E,
        width,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        HEADS=heads,
        TOKENS=per_program,
        PAD=pad,
        DIM=dim,
        BLOCK_N=_BLOCK_N,
    )
    return out.view(tokens, heads * dim)
