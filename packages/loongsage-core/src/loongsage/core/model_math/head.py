"""The FP32 LM head: ``hidden @ weight.T`` with float32 logits, the one kernel the trainer's forward,
the native engine's decoder and the Megatron trainer's output layer all run, so their logits differ
only by a GEMM's reduction order."""

from __future__ import annotations

import torch
from torch import Tensor

from loongsage.core.model_math.dtypes import HALF_DTYPES


def fp32_head(hidden: Tensor, weight: Tensor) -> Tensor:
    """``hidden @ weight.T`` in float32: the FP32 LM head.

    The final norm returns the model's dtype, so for a bf16/fp16 model both operands are exactly
    representable in their half type and the float32 head differs from a plain half GEMM only in
    where the products are summed. On CUDA a half GEMM with a float32 output (``out_dtype``) computes
    exactly that on tensor cores, an order of magnitude faster than a float32 GEMM over upcast copies.
    """
    if half_gemm_applies(hidden, weight):
        return HalfGemmFp32Out.apply(hidden, weight)
    return hidden.float() @ weight.float().T


def half_gemm_applies(hidden: Tensor, weight: Tensor) -> bool:
    """Whether :class:`HalfGemmFp32Out` computes ``hidden @ weight.T`` (CUDA, both in one half type)."""
    return hidden.device.type == "cuda" and hidden.dtype in HALF_DTYPES and weight.dtype == hidden.dtype


class HalfGemmFp32Out(torch.autograd.Function):
    """``hidden [..., H] @ weight[V, H].T`` as a half GEMM with float32 output, differentiable.

    The trainer's head and the engine's both run this one kernel, so their logits differ only by
    the GEMM's shape-dependent reduction order, not by float32 FMA against tensor-core sums. The
    backward runs on tensor cores too: the float32 gradient of the logits is rounded to the half
    type (as a half head's would be) and the products are summed in float32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(flat, weight.T, out_dtype=torch.float32).view(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        hidden, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(hidden.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(g, weight, out_dtype=torch.float32).to(hidden.dtype).view(hidden.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(g.T, hidden.reshape(-1, hidden.shape[-1]), out_dtype=torch.float32).to(weight.dtype)
        return grad_hidden, grad_weight
