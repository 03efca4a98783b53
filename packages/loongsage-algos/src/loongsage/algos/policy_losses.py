"""Policy losses: per-token log-probs in, *unreduced* per-token loss ``[B, T]`` out.

The trainer reduces with global denominators (:mod:`loongsage.core.aggregation`), so nothing here
averages. Every loss and metric is exactly zero outside ``response_mask``, and values under a zero
mask (padding garbage) reach neither the loss nor its gradient.

Each loss is a pure function plus a frozen dataclass that binds its parameters (the fields are the
recipe's ``params`` schema) and implements ``__call__(PolicyLossInput) -> LossOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loongsage.core.types import LossOutput, PolicyLossInput

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: finite in fp32/bf16, far beyond any clip range


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
) -> LossOutput:
    """PPO clipped surrogate with clip-higher and optional dual clip, per token.

    ``r = exp(clamp(logprobs - old_logprobs, -20, 20))`` and, with ``A`` the advantage::

        L = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        L = min(L, -clip_c * A)   where A < 0, if clip_c is set (dual clip, clip_c > 1)

    ``old_logprobs`` and ``advantages`` are treated as constants (stop-gradient).
    Shapes: all inputs ``[B, T]``. Returns ``loss [B, T]`` and per-token metrics ``[B, T]``:
    ``clipfrac`` (1 where the clipped branch is active), ``ratio``, ``ppo_kl`` (k1 estimate
    ``old - new`` of KL(old || new)) and, with dual clip, ``dual_clipfrac``.
    """
    mask = response_mask != 0
    adv = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # Padding may hold anything (NaN, +-inf): pin its log-ratio to 0 so nothing below sees it.
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": (clipped > unclipped) & mask}
    if clip_c is not None:
        # Dual clip bounds the loss of negative-advantage tokens whose ratio has exploded.
        dual = (adv < 0) & (loss > -clip_c * adv)
        loss = torch.where(dual, -clip_c * adv, loss)
        metrics["dual_clipfrac"] = dual & mask

    zero = torch.zeros_like(loss)
    metrics = {k: v.to(loss.dtype) for k, v in metrics.items()}
    metrics["ratio"] = torch.where(mask, ratio.detach(), zero)
    metrics["ppo_kl"] = torch.where(mask, -log_ratio.detach(), zero)
    return LossOutput(loss=torch.where(mask, loss, zero), metrics=metrics)


def nll_loss(logprobs: Tensor, response_mask: Tensor) -> LossOutput:
    """Negative log-likelihood (SFT): ``L = -logprobs`` on response tokens, 0 elsewhere.

    Shapes: ``[B, T]`` in, ``loss [B, T]`` out; no metrics (the loss itself is the NLL).
    """
    mask = response_mask != 0
    return LossOutput(loss=torch.where(mask, -logprobs, torch.zeros_like(logprobs)))


@dataclass(frozen=True)
class PPOClip:
    """``ppo_clip``: PPO clip with asymmetric bounds (DAPO: 0.2 / 0.28) and optional dual clip."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = None  # dual-clip constant (> 1); None = off

    needs_old_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"ppo_clip.clip_low={self.clip_low}: must be in [0, 1)")
        if not self.clip_high >= 0:
            raise ValueError(f"ppo_clip.clip_high={self.clip_high}: must be >= 0")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"ppo_clip.clip_c={self.clip_c}: must be > 1 (or null to disable)")

    def __call__(self, inp: PolicyLossInput) -> LossOutput:
        return ppo_clip_loss(
            inp.logprobs,
            inp.old_logprobs,
            inp.advantages,
            inp.response_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            clip_c=self.clip_c,
        )


@dataclass(frozen=True)
class NLL:
    """``nll``: supervised fine-tuning loss; ignores advantages and old log-probs."""

    needs_old_logprobs: ClassVar[bool] = False

    def __call__(self, inp: PolicyLossInput) -> LossOutput:
        return nll_loss(inp.logprobs, inp.response_mask)
