"""FP8 weights for the native engine's decode GEMMs (``quantization="fp8"``).

A decode step is bound by reading the weights: at batch 128 a Qwen3-1.7B step reads 2.8 GB of
projection weights in bf16, and in float8 (e4m3) half of that. This is online dynamic FP8, as
serving engines run it without a calibrated checkpoint: each projection's weight is quantized per
output channel (its scale is the row's largest magnitude over e4m3's largest, 448), each GEMM's
input per token at run time (one Triton kernel a GEMM: the row's largest magnitude, its scale and
the float8 row in one pass, where torch would run six kernels, each costing more than the
microseconds the halved weight reads save at decode sizes), and ``torch._scaled_mm`` multiplies
them on the FP8 tensor cores,
summing in float32 and scaling back to bf16. The engine keeps its bf16 weights (they are what
``update_weights`` writes, the prefill and the trainer's names read) and quantizes a copy of them
after every update; the LM head stays the FP32 head.

FP8 changes the rollout policy's numbers (e4m3 keeps 3 mantissa bits): the sampled tokens'
log-probs move away from the bf16 trainer's, which the run's importance correction and
``train/is_approx_k3_kl`` account for. It cannot hold a consistency mode (``deterministic``,
``batch_invariant``), which the engine refuses in one line.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0  # the largest finite e4m3 value
_TINY = 1e-12  # a row of zeros gets this scale (any positive one gives zeros back)


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(w8 [N, K] e4m3, scale [1, N] float32)`` with ``weight ~= w8 * scale.T``, per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / _E4M3_MAX).clamp_(min=_TINY)
    return (w / scale[:, None]).to(E4M3), scale.view(1, -1)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, LIMIT: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr
):
    # one row a program: its largest magnitude, the scale, the float8 row; divisions rounded to
    # nearest as torch's are (Triton's default float32 division is an approximate one)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), LIMIT), TINY)
    tl.store(q_ptr + row * K + cols, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x8 [M, K] e4m3, scale [M, 1] float32)`` with ``x ~= x8 * scale``, per row (token): the
    numbers of ``(x.float() / s).to(e4m3)`` with ``s = (|x|.amax(1) / 448).clamp(min=1e-12)``."""
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        if x.stride(1) != 1:
            x = x.contiguous()
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](
            x, x8, scale, k, x.stride(0), LIMIT=_E4M3_MAX, TINY=_TINY, BLOCK=block, num_warps=4 if block <= 2048 else 8
        )
    return x8, scale


def fp8_linear(x: Tensor, w8: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] @ weight.T (+ bias)`` from the quantized weight, ``x`` quantized per token here
    (:func:`quantize_rows`); the result in ``x``'s dtype (bf16)."""
    x8, x_scale = quantize_rows(x)
    out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
    return out if bias is None else out + bias


def unsupported_fp8(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FP8 weights cannot run here (None when they can)."""
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')} (FP8 GEMMs return bf16: run the model in bfloat16)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"compute capability {major}.{minor} (FP8 tensor cores need 8.9 or later: Ada, Hopper)"
    return None
