"""FP8 weights for the native engine's decode GEMMs (``quantization="fp8"``).

A decode step is bound by reading the weights: at batch 128 a Qwen3-1.7B step reads 2.8 GB of
projection weights in bf16, and in float8 (e4m3) half of that. This is online dynamic FP8, as
serving engines run it without a calibrated checkpoint: each projection's weight is quantized per
output channel (its scale is the row's largest magnitude over e4m3's largest, 448), each GEMM's
input per token at run time, and ``torch._scaled_mm`` multiplies them on the FP8 tensor cores,
summing in float32 and scaling back to bf16. The engine keeps its bf16 weights (they are what
``update_weights`` writes, the prefill and the trainer's names read) and quantizes a copy of them
after every update; the LM head stays the FP32 head.

FP8 changes the rollout policy's numbers (e4m3 keeps 3 mantissa bits): the sampled tokens'
log-probs move away from the bf16 trainer's, which the run's importance correction and
``train/is_approx_k3_kl`` account for. It cannot hold a consistency mode (``deterministic``,
``batch_invariant``), which the engine refuses in one line.

The per-token quantization of a GEMM's input costs no kernel of its own where the input comes out
of a fused kernel: the residual add + RMSNorm before the q/k/v and gate/up projections and the
SwiGLU before the down projection end by writing float8 rows and their scales
(:func:`store_e4m3_row`); only the attention output, before the output projection, is quantized
by :func:`quantize_rows`, one pass over the rows. Done by torch, a quantization is six kernels,
which at decode sizes cost more than the halved weight reads save.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongsage.core.model_math.fp8_linear import quantize

E4M3 = torch.float8_e4m3fn


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(w8 [N, K] e4m3, scale [1, N] float32)`` with ``weight ~= w8 * scale.T``, per output channel
    (the trainer's FP8 GEMMs quantize their operands the same way)."""
    w8, scale = quantize(weight, "e4m3", rowwise=True)
    return w8, scale.view(1, -1)


@triton.jit
def store_e4m3_row(x, q_ptrs, scale_ptr, inside):
    """Store one row ``x`` (float32, zeros outside ``inside``) as float8 with its per-row scale:
    its largest magnitude over 448, at least 1e-12 (the numbers of
    :func:`~loongsage.core.model_math.fp8_linear.quantize`). The divisions round to nearest, as an exact
    float32 division does (Triton's default one is approximate, and torch's CUDA division by a
    Python number multiplies by the rounded reciprocal, one ulp off at times). The fused norm and SwiGLU kernels
    (:mod:`.ops`) end with this, so a GEMM's input leaves its producer already quantized."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
    tl.store(q_ptrs, tl.math.div_rn(x, scale).to(q_ptrs.dtype.element_ty), mask=inside)
    tl.store(scale_ptr, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    store_e4m3_row(x, q_ptr + row * K + cols, scale_ptr + row, inside)


def row_warps(block: int) -> int:
    """Warps for a kernel holding one row of ``block`` elements in a program."""
    return 4 if block <= 2048 else 8


def empty_e4m3(rows: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Buffers for ``rows`` quantized rows: ``(x8 [rows, width] e4m3, scale [rows, 1] float32)``."""
    return (
        torch.empty((rows, width), dtype=E4M3, device=device),
        torch.empty((rows, 1), dtype=torch.float32, device=device),
    )


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x8 [M, K] e4m3, scale [M, 1] float32)`` with ``x ~= x8 * scale``, per row (token): the
    numbers of ``(x.float() / s).to(e4m3)`` with ``s = (|x|.amax(1) / 448).clamp(min=1e-12)``, both
    divisions exact (rounded to nearest)."""
    m, k = x.shape
    x8, scale = empty_e4m3(m, k, x.device)
    if m:
        if x.stride(1) != 1:
            x = x.contiguous()
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, x8, scale, k, x.stride(0), BLOCK=block, num_warps=row_warps(block))
    return x8, scale


def fp8_matmul(x8: Tensor, x_scale: Tensor, w8: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` in bf16 from a quantized input (:func:`quantize_rows`, or a fused
    kernel's float8 output) and a quantized weight (:func:`quantize_weight`)."""
    out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    return out if bias is None else out + bias
