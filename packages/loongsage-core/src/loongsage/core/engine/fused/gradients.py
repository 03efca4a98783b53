"""Closed-form backwards of the HF ops the fused kernels equal: pure functions over tensors.

:mod:`.differentiable` differentiates the batch-invariant forward with these. Each takes the op's
saved inputs and the gradient of its outputs and returns the gradient of its inputs, computed in
float32 (the gradients need not be batch-invariant, only the forward's numbers must be). Written
out rather than recomputed under autograd, so that on a GPU each compiles (:func:`on_device`) into
a few fused kernels: recomputed eagerly, the norms', rotary's and SwiGLU's backwards ran as some
900 small kernels a micro-batch of the 1.7B shape, more time than the forward's GEMMs.

The HF forwards they differentiate (``x`` in the model dtype, every rounding to it taken as the
identity, as autograd does):

* RMSNorm: ``weight * (f * rsqrt(mean(f^2) + eps))`` with ``f = x.float()``, over the last dim;
* rotary: ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x2, x1)`` of the halves;
* SwiGLU: ``silu(gate) * up`` of a merged ``[..., 2 I]`` projection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor


def on_device(fn: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, ...]]:
    """``fn`` compiled where its first argument is a CUDA tensor (Inductor fuses its pointwise work
    and reductions), eager elsewhere (the CPU suite runs the same formulas). Compiled on first use:
    a process that never differentiates on a GPU never loads the compiler."""

    @functools.cache
    def compiled() -> Callable[..., tuple[Tensor, ...]]:
        return torch.compile(fn)

    @functools.wraps(fn)
    def run(*args: Tensor | float | None) -> tuple[Tensor, ...]:
        first = args[0]
        return compiled()(*args) if isinstance(first, Tensor) and first.is_cuda else fn(*args)

    return run


def _rms_norm_backward(x: Tensor, weight: Tensor, eps: float, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(d x, d weight)`` in float32 of RMSNorm over the last dim; ``weight`` broadcasts over the
    leading dims (a q/k norm's ``[d]`` over tokens and heads), whose gradient it sums."""
    f = x.float()
    rstd = torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    normed = f * rstd
    grad = grad.float()
    grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
    g = grad * weight.float()
    grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
    return grad_x, grad_weight


def _rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``d x`` of ``x * cos + rotate_half(x) * sin``: ``grad * cos + rotate_half^T(grad * sin)``,
    ``rotate_half^T(z) = cat(z2, -z1)``."""
    z = grad * sin
    half = z.shape[-1] // 2
    return grad * cos + torch.cat((z[..., half:], -z[..., :half]), -1)


@on_device
def add_rms_norm_backward(
    total: Tensor, weight: Tensor, eps: float, grad_normed: Tensor, grad_total: Tensor
) -> tuple[Tensor, Tensor]:
    """``(d total, d weight)`` of ``(RMSNorm(total) * weight, total)``, ``total = x + residual``:
    ``d total`` is both ``d x`` and ``d residual`` (in ``total``'s dtype; ``d weight`` in
    ``weight``'s)."""
    grad_x, grad_weight = _rms_norm_backward(total, weight, eps, grad_normed)
    return (grad_x + grad_total.float()).to(total.dtype), grad_weight.to(weight.dtype)


@on_device
def qk_norm_rope_backward(
    qkv: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    grad_q: Tensor,
    grad_k: Tensor,
    grad_v: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(d qkv, d q_norm, d k_norm)`` of the queries and keys of a merged ``qkv`` ``[N, (h + 2 kv) d]``
    through their per-head RMSNorm (when the model has one) and rotary (``cos``/``sin`` ``[N, d]``);
    ``grad_q`` ``[N, h, d]``, ``grad_k``/``grad_v`` ``[N, kv, d]`` (the values pass through)."""
    n, heads, kv_heads = qkv.shape[0], grad_q.shape[1], grad_k.shape[1]
    q, k, _ = qkv.view(n, heads + 2 * kv_heads, -1).split([heads, kv_heads, kv_heads], 1)
    cos, sin = cos[:, None].float(), sin[:, None].float()
    grad_q, grad_k = _rotary_backward(grad_q.float(), cos, sin), _rotary_backward(grad_k.float(), cos, sin)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk_norm_rope_backward: a q norm and a k norm, or neither (as the forward kernel)")
    grad_q_norm = grad_k_norm = None
    if q_norm is not None and k_norm is not None:
        grad_q, grad_q_norm = _rms_norm_backward(q, q_norm, eps, grad_q)
        grad_k, grad_k_norm = _rms_norm_backward(k, k_norm, eps, grad_k)
        grad_q_norm, grad_k_norm = grad_q_norm.to(q_norm.dtype), grad_k_norm.to(k_norm.dtype)
    grad_qkv = torch.cat((grad_q, grad_k, grad_v.float()), 1).to(qkv.dtype).view(n, -1)
    return grad_qkv, grad_q_norm, grad_k_norm


@on_device
def silu_mul_backward(gate_up: Tensor, grad: Tensor) -> tuple[Tensor]:
    """``d gate_up`` of ``silu(gate) * up`` for ``gate_up = cat(gate, up)`` on the last dim."""
    gate, up = gate_up.float().chunk(2, -1)
    grad = grad.float()
    sig = torch.sigmoid(gate)
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))
    return (torch.cat((grad_gate, grad * gate * sig), -1).to(gate_up.dtype),)
