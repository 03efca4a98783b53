"""Loss aggregation with global denominators.

Policy losses return an *unreduced* per-token loss ``L [B, T]``. The trainer turns it into one
scalar per optimizer mini-batch with per-token weights ``w`` computed once, over the whole
mini-batch, before it is split into micro-batches and data-parallel shards::

    loss = sum(w * L)   summed over every micro-batch of every rank (gradients SUMMED across ranks)

Because every denominator is fixed up front, the result and its gradient do not depend on how the
rows are split. (A DP wrapper that averages gradients must be scaled back by the world size.)

Modes, with ``m`` the response mask, ``len_i = sum_t m[i, t]`` and ``B`` the number of rows with at
least one response token (rows with none are padding: they neither count nor produce NaN)::

    token-mean               w = m / sum(m)               sum m L / sum m
    seq-mean-token-mean      w = m / (len_i * B)          (1/B) sum_i (sum_t m L / len_i)
    seq-mean-token-sum       w = m / B                    (1/B) sum_i sum_t m L
    seq-mean-token-sum-norm  w = m / C                    sum m L / C   (Dr.GRPO; C defaults to T)
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def loss_weights(response_mask: Tensor, mode: str, *, constant: float | None = None) -> Tensor:
    """Per-token weights ``[B, T]`` of a whole optimizer mini-batch (see the module docstring).

    ``response_mask`` is ``[B, T]`` (bool or 0/1 numbers). ``constant`` is ``C`` of
    ``seq-mean-token-sum-norm`` only (default ``T``, the padded length; pass the maximum response
    length to match Dr.GRPO exactly). Returns a float tensor, zero where the mask is zero.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregation mode {mode!r}: allowed: {', '.join(AGGREGATION_MODES)}")
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected shape [B, T], got {tuple(response_mask.shape)}")
    if constant is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"aggregation constant={constant}: only used by seq-mean-token-sum-norm")
    if constant is not None and not constant > 0:
        raise ValueError(f"aggregation constant={constant}: must be > 0")

    m = response_mask.float() if not response_mask.is_floating_point() else response_mask
    if mode == "token-mean":
        return m / m.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        return m / float(constant if constant is not None else m.shape[1])

    lengths = m.sum(dim=1, keepdim=True)
    num_seqs = (lengths > 0).sum().clamp(min=1).to(m.dtype)
    if mode == "seq-mean-token-sum":
        return m / num_seqs
    # seq-mean-token-mean: empty rows have m = 0 everywhere, so clamping their length is exact.
    return m / (lengths.clamp(min=1.0) * num_seqs)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is non-zero (``mask`` acts as a weight).

    Returns 0, not NaN, where the mask is empty; values under a zero mask (NaN, inf, garbage in
    padding) never reach the result or its gradient.
    """
    mask = mask.to(x.dtype)
    num = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    num = num.sum() if dim is None else num.sum(dim=dim)
    den = mask.sum() if dim is None else mask.sum(dim=dim)
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))
