"""Per-token log-probs through the FP32 LM head a chunk of tokens at a time.

The unchunked forward materialises the float32 logits of every trained position of a micro-batch,
then their log-softmax and, in the backward, their gradient: for a 151,936-token vocabulary that is
about 0.6 MB a token each, 7.5 GB apiece for 12,288 tokens. :class:`ChunkedHeadLogprobs` runs the
head, the log-softmax and the gather over ``chunk`` tokens at a time and keeps only each token's
log-prob (and entropy); the backward computes the head again, chunk by chunk, and sums the weight's
gradient in float32. Peak memory of the head falls from the micro-batch's size to the chunk's.

Each chunk computes exactly what the unchunked path computes for its rows (the same head GEMM, the
same ``log_softmax``); the gradient of the log-softmax is its closed form, ``onehot - softmax``
times the incoming gradient, which is what autograd computes for the unchunked path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.model_math.head import half_gemm_applies


def _logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The FP32 head of ``hidden [c, H]`` (no autograd: the backward below is written out)."""
    if half_gemm_applies(hidden, weight):
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return hidden.float() @ weight.float().T


def _matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` summed in float32 (a half GEMM with float32 output where it applies)."""
    if half_gemm_applies(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``log softmax(hidden @ weight.T)[target]`` per row of ``hidden [N, H]``, ``chunk`` rows at a time,
    with the entropy of each row's distribution (no gradient) when asked."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            logp = torch.log_softmax(_logits(hidden[rows], weight), dim=-1)
            lp[rows] = logp.gather(-1, targets[rows, None]).squeeze(-1)
            if ent is not None:
                ent[rows] = -(logp.exp() * logp).sum(-1)
            del logp
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor, grad_ent: Tensor | None):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad_lp[rows].float()
            # d logp[target] / d logits = onehot(target) - softmax: the log-softmax's own backward
            grad = torch.log_softmax(_logits(hidden[rows], weight), dim=-1).exp_().mul_(-g[:, None])
            grad.scatter_add_(-1, targets[rows, None], g[:, None])
            if half_gemm_applies(hidden, weight):
                grad = grad.to(hidden.dtype)  # as the half head's backward rounds it (HalfGemmFp32Out)
            if grad_hidden is not None:
                grad_hidden[rows] = _matmul_fp32(grad, weight).to(hidden.dtype)
            grad_weight += _matmul_fp32(grad.T, hidden[rows])
            del grad
        needs_weight = ctx.needs_input_grad[1]
        return grad_hidden, grad_weight.to(weight.dtype) if needs_weight else None, None, None, None


def chunked_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    first: int,
    chunk: int,
    *,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """What ``logprobs_and_entropy(policy_logits(...), ...)`` gives with the FP32 head (log-probs and
    entropies of tokens ``first..T-1``, [B, T] with zeros before ``first``), the head run ``chunk``
    tokens at a time."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return chunked_head_logprobs(model, hidden, input_ids, first, chunk, with_entropy=with_entropy)


def chunked_head_logprobs(
    model: torch.nn.Module, hidden: Tensor, input_ids: Tensor, first: int, chunk: int, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_logprobs_and_entropy` over final hidden states ``[B, T, H]`` the body gave."""
    b, t = input_ids.shape
    predicting = hidden[:, first - 1 : t - 1].reshape(-1, hidden.shape[-1])  # the positions of tokens first..T-1
    targets = input_ids[:, first:].reshape(-1)
    weight = model.get_output_embeddings().weight
    lp, ent = ChunkedHeadLogprobs.apply(predicting, weight, targets, chunk, with_entropy)
    lp = F.pad(lp.view(b, t - first), (first, 0))
    if ent is not None:
        ent = F.pad(ent.view(b, t - first), (first, 0))
    return lp, ent
