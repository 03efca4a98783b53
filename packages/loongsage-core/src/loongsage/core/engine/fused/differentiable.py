"""The fused kernels as autograd functions, for the trainer's batch-invariant forward.

Each forward is the kernel itself, so the trainer's numbers stay the engine's bit for bit; each
backward is the gradient of the HF ops that the kernel equals (the norm, q/k norm + rotary, causal
attention, ``silu(gate) * up``), taken at the inputs it saved: the HF model's gradient at the
invariant forward's own activations, from one forward a micro-batch (a second, HF forward only for
the backward used to double the cost). The norms', rotary's and SwiGLU's backwards are written out
(:mod:`.gradients`, compiled on a GPU); attention's recomputes causal SDPA and differentiates it.
The GEMMs' backward (:class:`~.matmul.InvariantLinear`) runs torch matmuls on the saved inputs.

:class:`Attention` and :class:`QkRope` take the trainer's layout: ``rows`` sequences of ``width``
tokens each, token ``n`` = sequence ``n // width`` at position ``n % width``, attending causally
over its own sequence, with one cache ``[rows, kv_heads, width, d]`` per layer that the forward
fills completely (every column is some token's key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.engine.fused.attention import causal_attention
from loongsage.core.engine.fused.gradients import add_rms_norm_backward, qk_norm_rope_backward, silu_mul_backward
from loongsage.core.engine.fused.ops import add_rms_norm, qk_rope_store, silu_mul


class AddRmsNorm(torch.autograd.Function):
    """:func:`~.ops.add_rms_norm`: ``(RMSNorm(x + residual) * weight, x + residual)``."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        ctx.eps = eps
        normed, total = add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(total, weight)  # the sum the norm read: all its backward needs
        return normed, total

    @staticmethod
    def backward(ctx, g_normed: Tensor, g_total: Tensor) -> tuple[Tensor | None, ...]:
        total, weight = ctx.saved_tensors
        grad_total, grad_weight = add_rms_norm_backward(total, weight, ctx.eps, g_normed, g_total)
        need_x, need_residual, need_weight, _ = ctx.needs_input_grad
        return (
            grad_total if need_x else None,
            grad_total if need_residual else None,
            grad_weight if need_weight else None,
            None,
        )


class QkRope(torch.autograd.Function):
    """:func:`~.ops.qk_rope_store` on the trainer's layout (each token's position and sequence in
    ``cols`` and ``sequences``): the queries ``[N, heads, d]`` and this layer's key and value caches
    ``[rows, kv_heads, width, d]``, made here and filled whole."""

    @staticmethod
    def forward(
        ctx,
        qkv: Tensor,
        q_norm: Tensor | None,
        k_norm: Tensor | None,
        eps: float,
        cos: Tensor,
        sin: Tensor,
        heads: int,
        kv_heads: int,
        rows: int,
        cols: Tensor,
        sequences: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = qkv.shape[0]
        width, dim = n // rows, qkv.shape[1] // (heads + 2 * kv_heads)
        keys = qkv.new_empty(rows, kv_heads, width, dim)
        values = torch.empty_like(keys)
        q = qk_rope_store(qkv, heads, kv_heads, q_norm, k_norm, eps, cos, sin, keys, values, cols, sequences)
        ctx.save_for_backward(qkv, q_norm, k_norm, cos, sin)
        ctx.eps, ctx.heads, ctx.kv_heads = eps, heads, kv_heads
        return q, keys, values

    @staticmethod
    def backward(ctx, g_q: Tensor, g_keys: Tensor, g_values: Tensor) -> tuple[Tensor | None, ...]:
        qkv, q_norm, k_norm, cos, sin = ctx.saved_tensors
        n, kv_heads, dim = qkv.shape[0], g_keys.shape[1], g_keys.shape[3]

        def tokens(cache: Tensor) -> Tensor:  # [rows, kv, width, d] -> [rows * width, kv, d]
            return cache.transpose(1, 2).reshape(n, kv_heads, dim)

        grads = qk_norm_rope_backward(qkv, q_norm, k_norm, ctx.eps, cos, sin, g_q, tokens(g_keys), tokens(g_values))
        needs = ctx.needs_input_grad[:3]
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None, None)


class Attention(torch.autograd.Function):
    """Causal attention on the trainer's layout, each token's numbers the batch-invariant decode
    kernel's (:func:`~.attention.causal_attention`): ``q`` ``[rows * width, heads, d]`` over the
    caches from :class:`QkRope`; returns ``[rows * width, heads * d]``. The backward is causal
    SDPA's, recomputed."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(q, keys, values)
        return causal_attention(q, keys, values, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, values = ctx.saved_tensors
        rows, _, width, dim = keys.shape
        heads = q.shape[1]
        needs = ctx.needs_input_grad[:3]
        if not any(needs):
            return None, None, None, None
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, keys, values), needs)]
        with torch.enable_grad():
            query = inputs[0].view(rows, width, heads, dim).transpose(1, 2)
            # SDPA shares each kv head among its query heads itself: the HF model's attention
            # without repeat_kv's copies (the same gradient; 1.4x faster on an H100 at the 1.7B shape)
            out = F.scaled_dot_product_attention(query, *inputs[1:], is_causal=True, scale=ctx.scale, enable_gqa=True)
            out = out.transpose(1, 2).reshape(rows * width, heads * dim)
        got = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad))
        return (*(next(got) if need else None for need in needs), None)


class SiluMul(torch.autograd.Function):
    """:func:`~.ops.silu_mul`: ``silu(gate) * up`` of the merged ``[N, 2 I]`` projection."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        return silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        return silu_mul_backward(gate_up, grad)[0]
