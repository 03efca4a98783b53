"""The written-out backwards of the batch-invariant trainer (``engine/fused/gradients.py``) against
autograd through HF's own Qwen3 ops, on float64 inputs (where the forward's roundings vanish; the
formulas compute in float32, so the two agree to float32's precision), and in bf16 within bf16's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half

from loongsage.core.engine.fused import gradients

EPS = 1e-6
F32 = {"rtol": 1e-5, "atol": 1e-5}  # the formulas' float32 arithmetic


def _norm(weight: torch.Tensor) -> Qwen3RMSNorm:
    norm = Qwen3RMSNorm(weight.shape[0], eps=EPS).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def _inputs(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * 2).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_add_rms_norm_backward_is_autograds(dtype):
    torch.manual_seed(0)
    x, residual = _inputs(dtype, 7, 48), _inputs(dtype, 7, 48)
    norm = _norm(torch.randn(48, dtype=dtype))
    g_normed, g_total = torch.randn(7, 48, dtype=dtype), torch.randn(7, 48, dtype=dtype)
    total = x + residual
    torch.autograd.backward((norm(total), total), (g_normed, g_total))
    got_total, got_weight = gradients.add_rms_norm_backward(
        total.detach(), norm.weight.detach(), EPS, g_normed, g_total
    )
    assert got_total.dtype == dtype and got_weight.dtype == dtype
    tol = F32 if dtype == torch.float64 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(got_total, x.grad, **tol)
    torch.testing.assert_close(got_total, residual.grad, **tol)
    torch.testing.assert_close(got_weight, norm.weight.grad, **tol)


@pytest.mark.parametrize("with_norms", [True, False])
def test_qk_norm_rope_backward_is_autograds(with_norms):
    """A merged qkv of 4 query and 2 kv heads: per-head norms (Qwen3) or none (Llama), rotary with
    each token's own cos/sin; the values' gradient passes through."""
    torch.manual_seed(1)
    n, heads, kv, d = 6, 4, 2, 16
    qkv = _inputs(torch.float64, n, (heads + 2 * kv) * d)
    angles = torch.rand(n, d // 2, dtype=torch.float64) * 6
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    q_norm, k_norm = (_norm(torch.randn(d, dtype=torch.float64)) for _ in range(2))
    q, k, v = qkv.view(n, heads + 2 * kv, d).split([heads, kv, kv], 1)
    if with_norms:
        q, k = q_norm(q), k_norm(k)
    q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    grads = torch.randn(n, heads, d, dtype=torch.float64), *torch.randn(2, n, kv, d, dtype=torch.float64)
    torch.autograd.backward((q, k, v), grads)
    weights = (q_norm.weight.detach(), k_norm.weight.detach()) if with_norms else (None, None)
    got_qkv, got_q_norm, got_k_norm = gradients.qk_norm_rope_backward(qkv.detach(), *weights, EPS, cos, sin, *grads)
    torch.testing.assert_close(got_qkv, qkv.grad, **F32)
    if with_norms:
        torch.testing.assert_close(got_q_norm, q_norm.weight.grad, **F32)
        torch.testing.assert_close(got_k_norm, k_norm.weight.grad, **F32)
    else:
        assert got_q_norm is None and got_k_norm is None


def test_silu_mul_backward_is_autograds():
    torch.manual_seed(2)
    gate_up = _inputs(torch.float64, 5, 2, 64)
    gate, up = gate_up.chunk(2, -1)
    grad = torch.randn(5, 2, 32, dtype=torch.float64)
    (F.silu(gate) * up).backward(grad)
    (got,) = gradients.silu_mul_backward(gate_up.detach(), grad)
    torch.testing.assert_close(got, gate_up.grad, **F32)
