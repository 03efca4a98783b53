"""The fused kernels as autograd functions, for the trainer's batch-invariant forward.

Each forward is the kernel itself, so the trainer's numbers stay the engine's bit for bit; each
backward recomputes, in torch, the HF ops that the kernel equals (the norm, q/k norm + rotary,
causal attention, ``silu(gate) * up``) from the inputs it saved, and differentiates them. The
gradient is then the HF model's gradient taken at the invariant forward's own activations: one
forward a micro-batch, where a second (HF) forward only for the backward used to double the cost.
The recomputed pieces are small beside the GEMMs, whose backward (:class:`~.matmul.InvariantLinear`)
already runs torch matmuls on the saved inputs.

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
from loongsage.core.engine.fused.ops import add_rms_norm, qk_rope_store, silu_mul


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's Llama-family RMSNorm: normalise in float32, round, then scale in the model dtype."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` (``cos``/``sin`` broadcast over the heads)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _grads(outputs: tuple[Tensor, ...], inputs: list[Tensor | None], grads: tuple[Tensor, ...]) -> list:
    """``autograd.grad`` of the recomputed ``outputs`` for the ``inputs`` that need one (None elsewhere);
    an output that no such input reaches (a frozen input's copy) carries nothing back."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    if not wanted or not pairs:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if t is not None and t.requires_grad else None for t in inputs]


def _detached(t: Tensor | None, needs: bool) -> Tensor | None:
    return None if t is None else t.detach().requires_grad_(needs)


class AddRmsNorm(torch.autograd.Function):
    """:func:`~.ops.add_rms_norm`: ``(RMSNorm(x + residual) * weight, x + residual)``."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        ctx.eps = eps
        ctx.save_for_backward(x, residual, weight)
        return add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def backward(ctx, g_normed: Tensor, g_total: Tensor) -> tuple[Tensor | None, ...]:
        x, residual, weight = ctx.saved_tensors
        inputs = [_detached(t, need) for t, need in zip((x, residual, weight), ctx.needs_input_grad)]
        with torch.enable_grad():
            total = inputs[0] if inputs[1] is None else inputs[0] + inputs[1]
            normed = _rms_norm(total, inputs[2], ctx.eps)
        return (*_grads((normed, total), inputs, (g_normed, g_total)), None)


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
        heads, kv_heads = ctx.heads, ctx.kv_heads
        inputs = [_detached(t, need) for t, need in zip((qkv, q_norm, k_norm), ctx.needs_input_grad)]
        n, dim = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
        with torch.enable_grad():
            q, k, v = inputs[0].view(n, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], 1)
            if inputs[1] is not None:
                q, k = _rms_norm(q, inputs[1], ctx.eps), _rms_norm(k, inputs[2], ctx.eps)
            q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])

        def tokens(cache: Tensor) -> Tensor:  # [rows, kv, width, d] -> [rows * width, kv, d]
            return cache.transpose(1, 2).reshape(n, kv_heads, dim)

        grads = _grads((q, k, v), inputs, (g_q, tokens(g_keys), tokens(g_values)))
        return (*grads, None, None, None, None, None, None, None, None)


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
        inputs = [_detached(t, need) for t, need in zip((q, keys, values), ctx.needs_input_grad)]
        group = heads // keys.shape[1]
        with torch.enable_grad():
            query = inputs[0].view(rows, width, heads, dim).transpose(1, 2)
            # the kv heads repeated for their query heads, as HF's repeat_kv does: the recompute is
            # the HF model's own attention call
            key, value = (t.repeat_interleave(group, 1) for t in inputs[1:])
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=ctx.scale)
            out = out.transpose(1, 2).reshape(rows * width, heads * dim)
        return (*_grads((out,), inputs, (grad,)), None)


class SiluMul(torch.autograd.Function):
    """:func:`~.ops.silu_mul`: ``silu(gate) * up`` of the merged ``[N, 2 I]`` projection."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        return silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        inputs = [gate_up.detach().requires_grad_()]
        with torch.enable_grad():
            gate, up = inputs[0].chunk(2, -1)
            out = F.silu(gate) * up
        return _grads((out,), inputs, (grad,))[0]
