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


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_training_gemms_are_the_products_of_their_quantized_operands(recipe):
    """The trainer's FP8 GEMMs on the card (``torch._scaled_mm`` on the FP8 tensor cores; e5m2
    gradients as the first operand, as cuBLAS's row-wise kernels require): each equals the float64
    product of its own quantized operands up to the bf16 output's rounding, so the scales sit on the
    right sides, and the layer's gradients stay within FP8's error of the bf16 layer's."""
    from loongsage.core.model_math.fp8_linear import fp8_linear, quantize

    torch.manual_seed(2)
    rowwise = recipe == "rowwise"
    dev = torch.device("cuda")
    x = (torch.randn(1000, 2048, device=dev) * torch.logspace(-2, 2, 1000, device=dev)[:, None]).bfloat16()
    w = (torch.randn(6144, 2048, device=dev) * 0.02).bfloat16()
    g = torch.randn(1000, 6144, device=dev).bfloat16()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xg, wg, None, "hybrid", recipe)
    y.backward(g)

    def deq(t, fmt):
        t8, scale = quantize(t, fmt, rowwise)
        return t8.double() * scale.double()

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert rel(y, deq(x, "e4m3") @ deq(w, "e4m3").T) < 4e-3
    assert rel(xg.grad, deq(g, "e5m2") @ deq(w.t().contiguous(), "e4m3").T) < 4e-3
    # 1000 tokens, padded to 1008 inside with zero rows, which change no scale
    assert rel(wg.grad, deq(g.t().contiguous(), "e5m2") @ deq(x.t().contiguous(), "e4m3").T) < 4e-3
    plain = x.float() @ w.float().T
    assert rel(y, plain.double()) < 0.06
