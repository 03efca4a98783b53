"""A batch-invariant GEMM: ``x @ weight.T`` whose every output element is computed the same way
whatever the number of rows ``M`` it runs among.

The consistency mode needs the rollout engine's batched decode (``M`` = the live rows), its prefill
(``M`` = the prompt's tokens) and the trainer's full-sequence forward (``M`` = all tokens of a
micro-batch) to give bit-identical numbers for one token's row. cuBLAS does not: it picks a
kernel, a tile shape and a split-K factor by shape, and each choice sums a row's products in a
different order, so a token's logits depend on the batch it ran in. Here the reduction order of an
output element is pinned, and depends on ``K`` alone:

* ONE ``BLOCK_K`` (64) for every shape, and no autotuning. An output element's value then depends
  only on its row of ``x`` and its row of ``weight``, never on where its tile lies or on what the
  other rows of the tile hold (a masked row is zeros and adds nothing to another row: an MMA's
  output element reads one row of A and one column of B). ``BLOCK_K`` sets the order of the
  float32 sums and may never follow the shape. The tile's rows and columns (``BLOCK_M`` x
  ``BLOCK_N``) set which program computes an element, and the N of the MMA instructions, not the
  order of its K products: 64 x 64, 64 x 128, 128 x 128 and 128 x 256 tiles give the same bits
  (measured on an H100 at every projection of the 1.7B shape;
  ``tests/gpu/test_invariant_matmul_gpu.py`` checks it on the card at hand, the CPU suite in
  Triton's interpreter);
* ``K`` is cut into chunks of 512 columns, or, past four of those, into at most four chunks of a
  multiple of 512 (:func:`_chunk_k`: 1,536 for a ``K`` of 6,144). Each chunk is summed from zero, in
  order, in steps of ``BLOCK_K``, each step's ``tl.dot`` into one float32 accumulator; then the
  chunks' sums are added in order, chunk 0 first. That order is a function of ``K`` only;
* how the work is laid out on the GPU is chosen by shape (:func:`_layout`), and never changes the
  numbers. With a trainer's or a prefill's rows (from 1,024) and tiles enough to fill the GPU
  twice, the tiles are large and one program walks its tile's chunks in order, adding them as it
  goes; on a Hopper GPU its operands come in by TMA and each program, one an SM, walks tiles until
  none is left (128 x 256 tiles, 128 x 128 for a float32 output), elsewhere the tiles are
  128 x 128, one program each. With fewer rows (a decode step's), the tiles are 64 x 128 where
  those alone keep two thirds of the SMs busy (the wide projections and the head), else 64 x 64;
  and with few of those (a decode step's ``M`` of a few dozen rows: a 2048-wide projection has 32
  column tiles for 132 SMs) each chunk is a program of its own, writing its float32 sum to a
  buffer that a second kernel adds up in chunk order. All run the same chunk code and the same
  additions in the same order, so a row's numbers are the same bits whichever ran: this is a
  fixed split-K, where cuBLAS' split factor follows the shape;
* ``M`` is not specialised (``do_not_specialize``): Triton would otherwise compile a second kernel
  for ``M == 1`` (and for ``M % 16 == 0``), and a decode step of one row must run the same code as
  the trainer's thousands;
* the bias, if any, is added to the float32 sum after the last chunk, and the result is rounded
  once, to the output dtype (float32 for the FP32 LM head: no rounding at all).

The fixed order costs speed where cuBLAS has more freedom (warp specialisation, split-K chosen by
shape). On an H100 at the trainer's 6,144 rows the kernel took 1.7-1.8x cuBLAS's time as a
program a tile (``bench/invariant_gemm_gpu.py``) and 1.13-1.18x on TMA (1.27x the FP32 head),
measured on a copy of the TMA kernel whose outputs equalled the others' bits at every projection.

``N`` is tiled too, so the columns of one projection computed alone equal the same columns of a
merged (q/k/v, gate/up) weight bit for bit, as long as the two calls see the same ``K`` and pointer
alignment (see ``invariant_matmul``): the engine runs its merged projections, the trainer its own
modules' weights.

The backward (:class:`InvariantLinear`) runs ordinary torch matmuls: gradients need not be invariant.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongsage.core.model_math.dtypes import HALF_DTYPES

# The order of the sums, for every shape (see the module docstring). Changing either changes the
# numbers: the engine and the trainer must run the same values.
_BLOCK_K = 64
_CHUNK_K = 512  # a multiple of _BLOCK_K: the shortest chunk
_MOST_CHUNKS = 4  # a longer K is cut into at most this many chunks of whole 512s


def _chunk_k(k: int) -> int:
    """The chunk length for a reduction of ``k``: 512 columns, or a multiple of 512 that cuts ``k``
    into at most ``_MOST_CHUNKS`` chunks. A function of ``k`` alone, so the engine and the trainer
    sum each projection alike. Fewer chunks, fewer float32 partial sums for the split layout to
    write and read back: the 1.7B shape's down projection (``K`` 6,144) at a decode step's 128
    rows took 0.0218 ms in 12 chunks, 0.0146 ms in 4 (cuBLAS 0.0130; an H100, one sweep over
    12, 6, 4 and 3 chunks, every layout giving the same bits in each)."""
    return _CHUNK_K * triton.cdiv(triton.cdiv(k, _CHUNK_K), _MOST_CHUNKS)


class Tiles(NamedTuple):
    """An output tile's rows and columns and the kernel's warps and pipeline stages: the layout,
    not the numbers."""

    block_m: int
    block_n: int
    warps: int
    stages: int


SMALL_TILES = Tiles(64, 64, 4, 3)  # decode and short prefills: more programs for the SMs
# decode rows times a wide weight (gate/up, the head; q/k/v from 256 rows), where 64 x 128 tiles
# still give two thirds of the SMs a program: each weight block read by half as many programs. At
# the 1.7B shape on an H100 (a sweep of tiles, warps and stages at 64, 128 and 256 rows, every one
# the same bits): gate/up 0.0243 ms against 0.0256 at 128 rows, 0.0353 against 0.0410 at 256; the
# FP32 head 0.265 against 0.284 and 0.436 against 0.545 (with 4 warps, which suit its float32 tile)
MEDIUM_TILES = Tiles(64, 128, 8, 4)
MEDIUM_WIDE_OUT_TILES = Tiles(64, 128, 4, 4)
LARGE_TILES = Tiles(128, 128, 8, 4)  # the trainer's forward and the head: 1.3-1.4x faster at M = 8192
# the large layout on Hopper's TMA loads, one program an SM walking the tiles (persistent): at the
# trainer's 6,144 rows on an H100, 1.13-1.18x cuBLAS's time against the pointer kernel's 1.7-1.8x
# with 128 x 256 tiles, and 1.27x against 1.68x for the FP32 head with 128 x 128 ones (a float32
# tile of 128 x 256 does not fit in shared memory beside three stages of operands)
TMA_TILES = Tiles(128, 256, 8, 3)
TMA_WIDE_OUT_TILES = Tiles(128, 128, 8, 4)
# rows from which large tiles may run: a decode step's few hundred rows keep the 64-row tiles they
# were measured with, where a 128-row tile would hold as many masked rows as real ones
_LARGE_TILES_FROM_ROWS = 1024
_GROUP_M = 8  # tiles of rows walked together for L2 reuse: the order programs run in, not the numbers
_REDUCE_BLOCK = 1024  # elements per program of the chunk-sum kernel (layout only)


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Output tile number ``tile`` -> its ``(row tile, column tile)``, grouped by ``GROUP_M`` row tiles
    (the Triton tutorial's ordering, for L2 reuse): which program computes a tile changes with M,
    how a tile is computed does not."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _sum_k(
    x_ptr,
    w_ptr,
    rm,
    rn,
    in_m,
    in_n,
    k_start,
    k_stop,
    stride_x,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """The float32 sum over columns ``[k_start, k_stop)`` of ``K`` (whole chunks, the last one cut at
    ``K``) for one output tile, the same way in every layout: each chunk summed from zero, in order,
    one ``tl.dot`` per ``BLOCK_K`` step, then added to the total as it ends, chunk 0 first. One loop
    over ``K`` rather than a loop per chunk, so Triton pipelines the loads across the chunks'
    boundaries (measured on an H100 at the trainer's rows: 5-25% faster, the same bits)."""
    rk = tl.arange(0, BLOCK_K)
    # 64-bit row offsets: the FP32 head's output (tokens x vocabulary) passes 2**31 elements
    a_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_x + (k_start + rk)[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_w + (k_start + rk)[:, None]  # [BLOCK_K, BLOCK_N]: weight.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_stop, BLOCK_K):
        a = tl.load(a_ptrs, mask=in_m & (rk[None, :] < k_stop - k), other=0.0)
        b = tl.load(b_ptrs, mask=in_n & (rk[:, None] < k_stop - k), other=0.0)
        acc = tl.dot(a, b, acc)
        if ((k + BLOCK_K) % CHUNK_K == 0) | (k + BLOCK_K >= k_stop):  # a chunk ends
            total += acc
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return total


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rm[:, None] < M
    in_n = rn[None, :] < N
    if SPLIT:  # this program's chunk to the buffer; _chunk_reduce_kernel adds the chunks in order
        chunk = tl.program_id(1)
        k0 = chunk * CHUNK_K
        k1 = tl.minimum(k0 + CHUNK_K, K)
        acc = _sum_k(x_ptr, w_ptr, rm, rn, in_m, in_n, k0, k1, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K)
        part = part_ptr + chunk.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=in_m & in_n)
    else:  # every chunk of the tile, added in order as they come
        total = _sum_k(x_ptr, w_ptr, rm, rn, in_m, in_n, 0, K, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K)
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_out + rn[None, :]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=in_m & in_n)  # the one rounding


@triton.jit(do_not_specialize=["M"])
def _tma_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    b_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
):
    """:func:`_sum_k`'s loop over all of ``K`` with the operands' blocks brought in by TMA (out of
    bounds: zeros, as the masked loads give), each program walking output tiles until none is left;
    the same products in the same order, so the same bits. The descriptors are made here, on the
    device."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_x, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_out, 1], block_shape=[BLOCK_M, BLOCK_N])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([pid_m * BLOCK_M, k])
            b = w_desc.load([pid_n * BLOCK_N, k])
            acc = tl.dot(a, b.T, acc)
            if ((k + BLOCK_K) % CHUNK_K == 0) | (k + BLOCK_K >= K):  # a chunk ends
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], total.to(out_ptr.dtype.element_ty))  # the one rounding


@triton.jit
def _chunk_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, CHUNKS, stride_out, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """``out = sum of the chunks' float32 sums, chunk 0 first (+ bias)``, rounded once: the same
    additions the one-program layout makes (the chunks contiguous ``[M, N]`` each, ``out`` rows
    ``stride_out`` apart)."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, CHUNKS):
        total += tl.load(part_ptr + c * M * N + at, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + at % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + (at // N) * stride_out + at % N, total.to(out_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _two_waves(device: torch.device) -> int:
    """Programs that fill the GPU's SMs twice (the interpreter on the CPU counts as a small GPU, so
    every layout is tested there)."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the large layout runs on TMA: a Hopper GPU (where it was measured; not a ROCm card,
    whose capability also reads 9) with a Triton that makes tensor descriptors on the device (3.4
    and later), or Triton's interpreter on the CPU (so the CPU suite runs it)."""
    if not (hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    if device.type != "cuda":
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


def _layout(m: int, n: int, k: int, device: torch.device, wide_out: bool) -> tuple[Tiles, str]:
    """``(tiles, layout)`` for ``[m, k] @ [k, n]`` (``wide_out``: a float32 result): large tiles for
    a trainer's or a prefill's rows when they alone fill the GPU twice (on TMA where the GPU has
    it), else medium ones when those keep two thirds of the SMs busy, else small ones (a decode
    step's), each chunk of K a program of its own (``split``) when those would leave more than half
    the SMs idle. (Measured on an H100 at the 1.7B shape's decode rows: with 128 to 256 tiles a
    tile a program was 1.2-1.6x faster than splitting, which writes and reads back a float32 sum
    per chunk; with 64 or fewer, splitting was faster.)"""
    waves = _two_waves(device)
    large = triton.cdiv(m, LARGE_TILES.block_m) * triton.cdiv(n, LARGE_TILES.block_n)
    if m >= _LARGE_TILES_FROM_ROWS and large >= waves:
        if _has_tma(device):
            return (TMA_WIDE_OUT_TILES if wide_out else TMA_TILES), "tma"
        return LARGE_TILES, "tile"
    sms = waves // 2
    medium = triton.cdiv(m, MEDIUM_TILES.block_m) * triton.cdiv(n, MEDIUM_TILES.block_n)
    if 3 * medium >= 2 * sms:  # two thirds of the SMs busy
        return (MEDIUM_WIDE_OUT_TILES if wide_out else MEDIUM_TILES), "tile"
    few = 2 * triton.cdiv(m, SMALL_TILES.block_m) * triton.cdiv(n, SMALL_TILES.block_n) <= sms  # half idle
    return SMALL_TILES, "split" if few and k > _chunk_k(k) else "tile"


def _tma_ready(*tensors: Tensor) -> bool:
    """Whether TMA can read (or write) these 2-D tensors in place: 16-byte aligned addresses and
    row strides (a column slice of a wider ``x`` may have neither: it runs the pointer kernel)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def invariant_matmul(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``x @ weight.T (+ bias)``, each output element computed the same way whatever ``M`` is.

    ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` (an ``nn.Linear`` weight) in one half dtype (bf16 or
    fp16); ``bias`` ``[N]`` in any float dtype. Both are read in place with any row stride (a column
    slice of a wider ``x``, a row slice of a merged weight) and must have unit stride on ``K``: a
    tensor without one is copied (``.contiguous()``), which changes no value. Returns ``[M, N]`` in
    ``out_dtype`` (``x.dtype`` by default, or float32 for the FP32 LM head), summed in float32 in
    fixed chunks of ``K`` and rounded once; into ``out`` where given (``[M, N]`` of that dtype with
    unit stride on ``N``, any row stride: the columns of a wider result), with the same bits.

    Bitwise invariance holds across ``M`` (and across the column range of a merged weight) for
    calls with the same ``K`` and dtypes. Triton specialises a kernel on the 16-byte alignment of
    its pointers and row strides: an ``x`` whose rows are not 16-byte aligned runs a second compiled
    kernel, which loads differently and is expected (not guaranteed) to sum identically (and, in
    the large layout on a Hopper GPU, the pointer kernel rather than TMA, which needs that alignment).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"invariant_matmul: x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype not in HALF_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"invariant_matmul: x and weight in one of bf16/fp16, got {x.dtype} and {weight.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"invariant_matmul: out_dtype must be {x.dtype} or torch.float32, got {out_dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"invariant_matmul: bias [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(
            f"invariant_matmul: out must be [{m}, {n}] {out_dtype} on {x.device} with unit stride on N, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}"
        )
    if m == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    config, layout = _layout(m, n, k, x.device, out_dtype == torch.float32)
    if layout == "tma" and not _tma_ready(x, weight, out):
        config, layout = LARGE_TILES, "tile"
    b = x if bias is None else bias  # never read without a bias
    if layout == "tma":
        _run_tma(x, weight, b, out, bias is not None, config)
        return out
    split = layout == "split"
    chunk_k = _chunk_k(k)
    tiles, chunks = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), triton.cdiv(k, chunk_k)
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else out
    _matmul_kernel[(tiles, chunks if split else 1)](
        x,
        weight,
        b,
        out,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=_BLOCK_K,
        CHUNK_K=chunk_k,
        GROUP_M=_GROUP_M,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    if split:
        _chunk_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            part, b, out, m, n, chunks, out.stride(0), HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK
        )
    return out


def _scratch(device_type: str, size: int, alignment: int, stream: int | None) -> Tensor:
    """Triton's scratch memory for the descriptors a kernel makes on the device: on the current
    device of the kind (Triton launches there), so the allocator stays right for any kernel that
    asks for it later (torch's allocations are 256-byte aligned, more than Triton asks)."""
    return torch.empty(size, dtype=torch.int8, device=device_type)


def _run_tma(x: Tensor, weight: Tensor, b: Tensor, out: Tensor, has_bias: bool, config: Tiles) -> None:
    """The TMA layout: one program an SM (or a tile, when there are fewer tiles than SMs)."""
    (m, k), n = x.shape, weight.shape[0]
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    triton.set_allocator(functools.partial(_scratch, x.device.type))
    _tma_kernel[(min(tiles, _two_waves(x.device) // 2),)](
        x,
        weight,
        out,
        b,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=_BLOCK_K,
        CHUNK_K=_chunk_k(k),
        GROUP_M=_GROUP_M,
        STAGES=config.stages,
        num_warps=config.warps,
    )


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of half operands, the products summed in float32, a float32 result: a half GEMM
    with float32 output on CUDA (tensor cores), float32 copies elsewhere (exact products as well)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class InvariantLinear(torch.autograd.Function):
    """``x [M, K] @ weight[N, K].T (+ bias)`` by :func:`invariant_matmul`, differentiable.

    The backward runs ordinary torch matmuls (the gradients need not be batch-invariant). For the
    FP32 head (``out_dtype=float32`` on half inputs) it follows
    :class:`~loongsage.core.model_math.head.HalfGemmFp32Out`: the float32 gradient of the output is
    rounded to the half dtype (as a half head's would be) and the products are summed in float32.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        out = invariant_matmul(x, weight, bias, out_dtype)
        ctx.save_for_backward(x, weight)
        ctx.fp32_head = out.dtype == torch.float32  # on half inputs: invariant_matmul takes no others
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.fp32_head:
            g = grad.to(x.dtype)
            if ctx.needs_input_grad[0]:
                grad_x = _mm_fp32(g, weight).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = _mm_fp32(g.T, x).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        else:
            if ctx.needs_input_grad[0]:
                grad_x = grad @ weight
            if ctx.needs_input_grad[1]:
                grad_weight = grad.T @ x
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = grad.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


class InvariantLinears(torch.autograd.Function):
    """``x [M, K]`` times several weights, their results side by side in one ``[M, sum of N]``
    tensor, each written in place by :func:`invariant_matmul`: the trainer's own q/k/v (or gate/up)
    projections laid out as the engine's merged one, with its bits, and no concatenation's copy
    (measured on an H100: 7.6 ms of copies a 32 x 384 micro-batch of the 1.7B shape).
    ``params``: the weights, then as many biases (None where a projection has none). The backward
    is :class:`InvariantLinear`'s for each block, ``x``'s gradient summed over the blocks."""

    @staticmethod
    def forward(ctx, x: Tensor, *params: Tensor | None) -> Tensor:
        weights, biases = params[: len(params) // 2], params[len(params) // 2 :]
        out = x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))
        at = 0
        for weight, bias in zip(weights, biases):
            invariant_matmul(x, weight, bias, out=out[:, at : at + weight.shape[0]])
            at += weight.shape[0]
        ctx.save_for_backward(x, *weights)
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        needs, count = ctx.needs_input_grad, len(weights)
        grad_x, grad_weights, grad_biases = None, [None] * count, [None] * count
        at = 0
        for i, weight in enumerate(weights):
            g = grad[:, at : at + weight.shape[0]]
            at += weight.shape[0]
            if needs[0]:
                grad_x = g @ weight if grad_x is None else grad_x.addmm_(g, weight)
            if needs[1 + i]:
                grad_weights[i] = g.T @ x
            if ctx.bias_dtypes[i] is not None and needs[1 + count + i]:
                grad_biases[i] = g.sum(0).to(ctx.bias_dtypes[i])
        return grad_x, *grad_weights, *grad_biases


def invariant_linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` for ``x [M, K]`` by
    :class:`InvariantLinears`: each block the bits :func:`invariant_matmul` gives it alone."""
    return InvariantLinears.apply(x, *weights, *biases)


def invariant_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` by :class:`InvariantLinear` (leading dims
    flattened into ``M``), in ``out_dtype`` (``x.dtype`` by default; float32 for the FP32 head)."""
    flat = x.reshape(-1, x.shape[-1])
    out = InvariantLinear.apply(flat, weight, bias, out_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])
