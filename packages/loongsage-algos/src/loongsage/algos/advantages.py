"""Advantage estimators: ``[B]`` rewards (and groups) in, ``[B, T]`` per-token advantages out.

Each estimator is a pure function plus a frozen dataclass that binds its parameters (the fields are
the recipe's ``params`` schema) and implements ``__call__(AdvantageInput) -> Tensor[B, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loongsage.core.types import AdvantageInput


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages, one value per sequence broadcast over its response tokens.

    For row ``i`` in group ``g`` with ``n_g`` rows::

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps)   if std_normalize   (GRPO)
        A_i =  R_i - mean_g(R)                        otherwise          (Dr.GRPO)

    ``std_g`` is the unbiased (n - 1) standard deviation, as in TRL and verl. A group of one row
    has no baseline, so its advantage is 0. Rows with a non-finite reward (a failed scorer) are
    left out of their group's statistics and get advantage 0 instead of skewing the baseline.

    Shapes: ``rewards [B]``, ``group_ids [B]`` (any integers), ``response_mask [B, T]``.
    Returns ``[B, T]`` in the reward dtype, zero outside ``response_mask``.
    """
    # float64 statistics: rewards are few and small, and sums of squares lose digits in fp32.
    r = rewards.detach().to(torch.float64)
    valid = torch.isfinite(r)
    r = torch.where(valid, r, torch.zeros_like(r))
    w = valid.to(torch.float64)

    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = r.new_zeros(num_groups)
    count = zeros.index_add(0, inverse, w)
    total = zeros.index_add(0, inverse, r * w)
    mean = total / count.clamp(min=1.0)
    centered = (r - mean[inverse]) * w

    adv = centered
    if std_normalize:
        sq = zeros.index_add(0, inverse, centered**2)
        std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()
        adv = centered / (std[inverse] + eps)
    adv = torch.where(count[inverse] > 1, adv, torch.zeros_like(adv))

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(out_dtype)[:, None] * response_mask.to(out_dtype)


@dataclass(frozen=True)
class GRPO:
    """``grpo``: group z-score (``std_normalize=True``) or Dr.GRPO mean-centring (``False``)."""

    std_normalize: bool = True
    eps: float = 1e-6  # added to the group std so an all-equal group gives 0, not 0/0

    needs_values: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"grpo.eps={self.eps}: must be > 0")

    def __call__(self, inp: AdvantageInput) -> Tensor:
        return grpo_advantages(
            inp.rewards, inp.group_ids, inp.response_mask, std_normalize=self.std_normalize, eps=self.eps
        )
