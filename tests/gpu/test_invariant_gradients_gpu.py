"""On a CUDA GPU: the batch-invariant trainer's written-out backwards (``engine/fused/gradients.py``),
compiled by Inductor there, give the eager formulas' gradients (the CPU suite checks the eager
formulas against autograd through HF's ops; this checks what the compiler made of them).
Run with ``LOONGSAGE_RUN_GPU=1 pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _eager(fn, *args):
    return fn.__wrapped__(*args)  # the formula itself, as the CPU runs it


def _same(compiled, eager):
    for got, want in zip(compiled, eager):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [384, 1000])  # a second shape: the recompile with dynamic shapes
def test_compiled_backwards_give_the_eager_formulas_gradients(tokens):
    from loongsage.core.engine.fused import gradients

    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, heads, kv, d = 2048, 16, 8, 128
    total, weight = torch.randn(tokens, hidden, dtype=bf16, device=dev), torch.rand(hidden, dtype=bf16, device=dev)
    g_normed, g_total = torch.randn_like(total), torch.randn_like(total)
    args = (total, weight, 1e-6, g_normed, g_total)
    _same(gradients.add_rms_norm_backward(*args), _eager(gradients.add_rms_norm_backward, *args))

    qkv = torch.randn(tokens, (heads + 2 * kv) * d, dtype=bf16, device=dev)
    angles = torch.rand(tokens, d // 2, device=dev) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(bf16) for f in (torch.cos, torch.sin))
    norms = torch.rand(d, dtype=bf16, device=dev), torch.rand(d, dtype=bf16, device=dev)
    grads = tuple(torch.randn(tokens, h, d, dtype=bf16, device=dev) for h in (heads, kv, kv))
    for q_norm, k_norm in (norms, (None, None)):
        args = (qkv, q_norm, k_norm, 1e-6, cos, sin, *grads)
        _same(gradients.qk_norm_rope_backward(*args), _eager(gradients.qk_norm_rope_backward, *args))

    gate_up = torch.randn(tokens, 2 * 6144, dtype=bf16, device=dev)
    grad = torch.randn(tokens, 6144, dtype=bf16, device=dev)
    _same(gradients.silu_mul_backward(gate_up, grad), _eager(gradients.silu_mul_backward, gate_up, grad))
