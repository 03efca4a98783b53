"""Fused Triton kernels of a decoder layer's pointwise work: RMSNorm with the residual add, the
per-head q/k norm with rotary embedding and the KV-cache store, and SwiGLU's ``silu(gate) * up``.

Each kernel rounds where the HF modules it replaces round, so its output equals theirs bit for bit
up to the last bit of an ``rsqrt``/``exp``: the sum of the residual stream is rounded to the model
dtype before it is normalised (HF adds two bf16 tensors), the normalised value is rounded before it
is scaled by the norm's weight (HF's ``weight * hidden.to(input_dtype)``), and rotary embedding rounds
``x * cos``, ``rotate_half(x) * sin`` and their sum one by one, as three bf16 tensor ops do. The
consistency of engine and trainer log-probs then rests on the GEMMs and attention alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongsage.core.engine.fused.fp8 import empty_e4m3, row_warps, store_e4m3_row


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    hidden,
    eps,
    x_stride,
    res_stride,
    scale_ptr,
    HAS_RES: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * hidden + cols, x, mask=inside)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    if FP8:  # the next GEMM's input, quantized here: the bf16 value, then its float8 row
        store_e4m3_row(y.to(tl.float32), out_ptr + row * hidden + cols, scale_ptr + row, inside)
    else:
        tl.store(out_ptr + row * hidden + cols, y, mask=inside)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` (or ``x``) and ``RMSNorm(s) * weight``, rows of ``[N, H]``; returns ``(normed, s)``."""
    out, total = _add_rms_norm(x, residual, weight, eps, fp8=False)
    return out[0], total


def add_rms_norm_fp8(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """:func:`add_rms_norm` with the normed rows quantized for an FP8 GEMM: ``((x8, scale), s)``,
    the numbers of :func:`~.fp8.quantize_rows` of the bf16 ``normed``, in the same kernel."""
    return _add_rms_norm(x, residual, weight, eps, fp8=True)


def _add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, *, fp8: bool
) -> tuple[tuple[Tensor, Tensor], Tensor]:
    rows, hidden = x.shape
    total = torch.empty_like(x)
    out, scale = empty_e4m3(rows, hidden, x.device) if fp8 else (torch.empty_like(x), total)
    res = x if residual is None else residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        x,
        res,
        weight,
        out,
        total,
        hidden,
        eps,
        x.stride(0),
        res.stride(0),
        scale,  # never written without fp8
        HAS_RES=residual is not None,
        FP8=fp8,
        BLOCK=block,  # the default warps: their count shapes the sum of squares' reduction tree
    )
    return (out, scale), total


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """HF's ``x * cos + rotate_half(x) * sin`` on the two halves, rounding after each tensor op."""
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dtype)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dtype)
    b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dtype)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dtype)
    return (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype), (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype)


@triton.jit
def _head_norm(x1, x2, w_ptr, half, eps, dim, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / dim + eps)
        cols = tl.arange(0, half)
        w1 = tl.load(w_ptr + cols).to(tl.float32)
        w2 = tl.load(w_ptr + half + cols).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
    return x1, x2


@triton.jit
def _qk_rope_store_kernel(
    qkv_ptr,
    qn_ptr,
    kn_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cols_ptr,
    crow_ptr,
    eps,
    qkv_stride,
    cs_stride,
    cache_row,
    cache_head,
    cache_col,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    CACHE_ROWS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dim = 2 * HALF
    cols = tl.arange(0, HALF)
    base = qkv_ptr + row * qkv_stride + head * dim
    x1 = tl.load(base + cols)
    x2 = tl.load(base + HALF + cols)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + row * cs_stride + cols)
    c2 = tl.load(cos_ptr + row * cs_stride + HALF + cols)
    s1 = tl.load(sin_ptr + row * cs_stride + cols)
    s2 = tl.load(sin_ptr + row * cs_stride + HALF + cols)
    if head < HEADS:
        x1, x2 = _head_norm(x1, x2, qn_ptr, HALF, eps, dim, HAS_NORM, dtype)
        y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, dtype)
        out = q_out_ptr + (row * HEADS + head) * dim
        tl.store(out + cols, y1)
        tl.store(out + HALF + cols, y2)
    else:
        kv = head - HEADS
        x1, x2 = _head_norm(x1, x2, kn_ptr, HALF, eps, dim, HAS_NORM, dtype)
        y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, dtype)
        col = tl.load(cols_ptr + row)
        slot = tl.load(crow_ptr + row).to(tl.int64) if CACHE_ROWS else row
        at = slot * cache_row + kv * cache_head + col * cache_col
        tl.store(k_cache_ptr + at + cols, y1)
        tl.store(k_cache_ptr + at + HALF + cols, y2)
        v = qkv_ptr + row * qkv_stride + (HEADS + KV_HEADS + kv) * dim
        tl.store(v_cache_ptr + at + cols, tl.load(v + cols))
        tl.store(v_cache_ptr + at + HALF + cols, tl.load(v + HALF + cols))


def qk_rope_store(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cols: Tensor,
    cache_rows: Tensor | None = None,
) -> Tensor:
    """Queries of one token per row, ready for attention; that token's key and value go to the cache.

    ``qkv`` ``[B, (heads + 2 kv_heads) * d]`` (the merged projection), ``cos``/``sin`` ``[B, d]`` in the
    model dtype, caches ``[slots, kv_heads, L, d]``: row ``b``'s key/value land at ``[b, :, cols[b]]``
    (at ``[cache_rows[b], :, cols[b]]`` where given: the tokens of one sequence).
    ``q_norm``/``k_norm`` are the per-head RMSNorm weights (Qwen3), or None. Returns ``[B, heads, d]``.
    """
    rows = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = qkv.new_empty(rows, heads, dim)
    norm = q_norm is not None
    _qk_rope_store_kernel[(rows, heads + kv_heads)](
        qkv,
        q_norm if norm else qkv,
        k_norm if norm else qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        cols,
        cols if cache_rows is None else cache_rows,
        eps,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=dim // 2,
        HAS_NORM=norm,
        CACHE_ROWS=cache_rows is not None,
    )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, scale_ptr, inter, gu_stride, FP8: tl.constexpr, BLOCK: tl.constexpr):
    # FP8: one program a whole row (its largest magnitude scales it); else blocks of a row
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=inside, other=0.0)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=inside, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    if FP8:  # the down projection's input, quantized here: the bf16 value, then its float8 row
        store_e4m3_row(y.to(tl.float32), out_ptr + row * inter + cols, scale_ptr + row, inside)
    else:
        tl.store(out_ptr + row * inter + cols, y, mask=inside)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of the merged gate/up projection ``[N, 2 I]`` -> ``[N, I]``."""
    return _silu_mul(gate_up, fp8=False)[0]


def silu_mul_fp8(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`silu_mul` quantized for an FP8 GEMM in the same kernel: ``(x8, scale)``, the numbers
    of :func:`~.fp8.quantize_rows` of the bf16 result."""
    return _silu_mul(gate_up, fp8=True)


def _silu_mul(gate_up: Tensor, *, fp8: bool) -> tuple[Tensor, Tensor]:
    rows, width = gate_up.shape
    inter = width // 2
    if fp8:
        (out, scale), block = empty_e4m3(rows, inter, gate_up.device), triton.next_power_of_2(inter)
    else:
        out, block = gate_up.new_empty(rows, inter), 1024
        scale = out  # never written
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, scale, inter, gate_up.stride(0), FP8=fp8, BLOCK=block, num_warps=row_warps(block) if fp8 else 4
    )
    return out, scale
