"""Packed sequences (``pack_sequences: true``): a micro-batch's rows, right-padded, run as one
sequence of their real tokens back to back, Megatron's ``thd`` layout: no layer computes a padding
token, and attention stays within each row (its boundaries are ``cu_seqlens``).

Each row's positions start at 0, as the HF model numbers a right-padded row. The packed length is
made a multiple of the tensor-parallel size (sequence parallelism splits it evenly) and, under
expert parallelism, the same on every rank of the experts' group (the all-gather dispatcher
exchanges equal token counts), by one more sequence of padding tokens (routed to experts
``0..k-1`` under R3), whose outputs are never read. After the decoder the log-probs' head runs
on the packed tokens it reads (:func:`~loongsage.megatron.forward.gpt_packed_logits`); a divergence
over the whole distribution and a teacher's scoring put the hidden states back in the rows'
padded layout first (:func:`unpack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Packed:
    """One micro-batch packed: the inputs of the packed forward and where its tokens came from."""

    input_ids: Tensor  # [1, length]
    positions: Tensor  # [1, length]
    routes: Tensor | None  # [1, length, layers, top-k] (R3), or None
    params: Any  # Megatron's PackedSeqParams
    real: Tensor  # [b, T] bool: the rows' real tokens, in packing order (row by row)
    tokens: int  # real tokens (the rest of ``length`` is the padding sequence)


def pack(
    input_ids: Tensor, attention_mask: Tensor, routes: Tensor | None, *, multiple: int = 1, ep_group: Any = None
) -> Packed:
    """The rows' real tokens back to back (rows padded on the right only, or one line saying so),
    padded by one sequence to a multiple of ``multiple`` and to the longest over ``ep_group``."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    real = attention_mask.bool()
    if not bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        raise ValueError(
            "pack_sequences: rows must be padded on the right only; allowed: right-padded rows "
            "(as rollouts are), or pack_sequences false"
        )
    lengths = real.sum(1)
    tokens = int(lengths.sum())
    length = -(-max(tokens, 1) // multiple) * multiple
    if ep_group is not None:
        longest = torch.tensor([length])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=ep_group)
        length = int(longest)
    extra = length - tokens
    device = input_ids.device
    ids = F.pad(input_ids[real], (0, extra))
    positions = torch.cat([torch.arange(int(n), device=device) for n in lengths] + [torch.arange(extra, device=device)])
    seqlens = [int(n) for n in lengths if n > 0] + ([extra] if extra else [])
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest_row = max(seqlens)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest_row,
        max_seqlen_kv=longest_row,
        cp_group=parallel_state.get_context_parallel_group(),
    )
    if routes is not None:
        topk = routes.shape[-1]
        padding = torch.arange(topk, device=routes.device).expand(extra, routes.shape[2], topk)
        routes = torch.cat([routes[real], padding])[None]
    return Packed(ids[None], positions[None], routes, params, real, tokens)


def unpack(hidden: Tensor, packed: Packed) -> Tensor:
    """The packed decoder output ``[length, 1, hidden]`` (whole, not a sequence-parallel share) in
    the rows' padded layout ``[T, b, hidden]``, zeros at the padding (no gradient flows there)."""
    b, t = packed.real.shape
    rows, cols = packed.real.nonzero(as_tuple=True)  # row by row: the packing order
    out = hidden.new_zeros(t, b, hidden.shape[-1])
    return out.index_put((cols, rows), hidden[: packed.tokens, 0])


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, scale: float | None, gqa: bool) -> Tensor:
    """Causal attention within each packed sequence, ``[tokens, heads, dim]`` in and
    ``[tokens, heads * dim]`` out: torch's fused kernel once per sequence (no mask over the whole
    packed length)."""
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, is_causal=True, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1).reshape(end - start, -1))
    return torch.cat(outs)
