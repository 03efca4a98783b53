"""Context parallelism: each of ``cp`` ranks holds a share of every sequence's tokens.

A sequence (padded to a multiple of ``2 cp``) is cut into ``2 cp`` equal chunks; rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r``, so under causal attention every rank does the same work (an
early chunk attends to little, a late one to much). This is the layout Megatron's rotary
embedding assumes under context parallelism (it gives each rank the positions of those chunks).

* **Attention** (the SDPA core attention, :mod:`loongsage.megatron.model`): the keys and values of
  every rank are gathered, each local query chunk attends causally to the keys up to its own end.
  In the backward each rank's key and value gradients are summed over the ranks (every rank's
  queries read them) and each rank keeps those of its own tokens.
* **Log-probs**: each rank scores its own tokens (its head and its shard of the loss), and the
  per-token log-probs are gathered into the whole sequence; every rank computes the same loss, and
  the gradient of each token's log-prob flows back on the rank that holds the token.
* **Gradients** of the (replicated) parameters are summed over the data-parallel and
  context-parallel ranks together: each rank's are the contributions of its own tokens.

Megatron's own context parallelism needs Transformer Engine's attention; this one runs on torch's
fused kernels (and on gloo ranks for tests).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def size_and_rank() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def local_positions(length: int, cp: int, rank: int) -> Tensor:
    """The positions of a ``length``-token sequence (a multiple of ``2 cp``) rank ``rank`` holds."""
    chunk = length // (2 * cp)
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )


def natural_order(cp: int) -> Tensor:
    """Where each of the ``2 cp`` chunks lies when the ranks' pairs are concatenated in rank order."""
    order = [0] * (2 * cp)
    for rank in range(cp):
        order[rank], order[2 * cp - 1 - rank] = 2 * rank, 2 * rank + 1
    return torch.tensor(order)


def _gather(local: Tensor, dim: int) -> Tensor:
    """Every rank's ``local`` (its two chunks along ``dim``), in sequence order."""
    cp, _ = size_and_rank()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group())
    chunks = torch.cat(parts, dim=dim).chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in natural_order(cp).tolist()], dim=dim)


def _own(whole: Tensor, dim: int) -> Tensor:
    """This rank's two chunks of a whole sequence along ``dim``."""
    cp, rank = size_and_rank()
    chunks = whole.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim).contiguous()


class GatherTokens(torch.autograd.Function):
    """Per-token values of the ranks' chunks, gathered into the whole sequence; every rank computes
    the same loss from them, so a token's gradient goes back on its own rank only."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return _gather(local, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _own(grad, ctx.dim), None


class GatherKeys(GatherTokens):
    """Keys or values of every rank, in sequence order; each rank's queries read all of them, so
    the gradients are summed over the ranks before each keeps its own tokens'."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group())  # gloo has no reduce-scatter: the sum, then this rank's share
        return _own(grad, ctx.dim), None


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, gqa: bool) -> Tensor:
    """Causal attention of this rank's query chunks ``q`` ``[b, heads, 2 L, dim]`` over the keys and
    values of every rank (``k``, ``v``: this rank's, ``[b, groups, 2 L, dim]``); ``[b, heads, 2 L, dim]``."""
    cp, rank = size_and_rank()
    keys, values = GatherKeys.apply(k, 2), GatherKeys.apply(v, 2)
    chunk = q.shape[2] // 2
    out = []
    for half, index in enumerate((rank, 2 * cp - 1 - rank)):
        end = (index + 1) * chunk
        rows = torch.arange(index * chunk, end, device=q.device)[:, None]
        allowed = torch.arange(end, device=q.device)[None, :] <= rows  # causal, from this chunk's place
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, half * chunk : (half + 1) * chunk],
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=allowed,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(out, dim=2)
