"""On a CUDA GPU with FP8 tensor cores: the engine's one-pass FP8 quantization of a GEMM's input
gives torch's per-token scales and float8 rows bit for bit (the CPU suite checks the same in
Triton's interpreter, whose division and casts are numpy's and torch's, not the compiled kernel's).
Run with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
    ),
]


@pytest.mark.parametrize("k", [2048, 6144, 1000])
def test_rows_quantize_as_torch_does_bit_for_bit(k):
    from loongsage.core.engine.fused.fp8 import quantize_rows

    torch.manual_seed(0)
    for m in (1, 64, 256):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda") * torch.logspace(-3, 2, m, device="cuda")[
            :, None
        ].to(torch.bfloat16)
        x8, scale = quantize_rows(x)
        xf = x.float()
        # a tensor divisor: torch's CUDA division by a Python number multiplies by its rounded
        # reciprocal, one ulp away from the rounded quotient the kernel (and the CPU) computes
        amax = xf.abs().amax(dim=1, keepdim=True)
        want = (amax / torch.full_like(amax, 448.0)).clamp_(min=1e-12)
        assert torch.equal(scale, want), (k, m)
        assert torch.equal(x8.view(torch.uint8), (xf / want).to(torch.float8_e4m3fn).view(torch.uint8)), (k, m)


def test_the_norm_and_swiglu_kernels_quantize_as_quantize_rows_does():
    from loongsage.core.engine.fused.fp8 import quantize_rows
    from loongsage.core.engine.fused.ops import add_rms_norm, add_rms_norm_fp8, silu_mul, silu_mul_fp8

    torch.manual_seed(1)
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda") * 4
    weight = torch.randn(2048, dtype=torch.bfloat16, device="cuda")
    (x8, scale), total = add_rms_norm_fp8(x, res, weight, 1e-6)
    normed, want_total = add_rms_norm(x, res, weight, 1e-6)
    want8, want_scale = quantize_rows(normed)
    assert torch.equal(total, want_total) and torch.equal(scale, want_scale)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
    gate_up = torch.randn(64, 2 * 6144, dtype=torch.bfloat16, device="cuda") * 3
    x8, scale = silu_mul_fp8(gate_up)
    want8, want_scale = quantize_rows(silu_mul(gate_up))
    assert torch.equal(scale, want_scale) and torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
