"""Policy losses: per-token log-probs in, *unreduced* per-token loss ``[B, T]`` out.

The trainer reduces with global denominators (:mod:`loongsage.core.aggregation`), so nothing here
averages. Every loss and metric is exactly zero outside ``response_mask``, and values under a zero
mask (padding garbage) reach neither the loss nor its gradient.

Each loss is a pure function whose keyword parameters, with their ranges, are the recipe's
``params``; :func:`loongsage.core.entries.entry` makes the registered entry from it, called with a
``PolicyLossInput``. Its flags (:class:`loongsage.core.contracts.PolicyLoss`): ``needs_old_logprobs``
and ``supported_aggregations``, the aggregation modes the loss is defined for (``None`` = every mode
of :mod:`loongsage.core.aggregation`); GSPO's sequence ratio is only GSPO under seq-mean-token-mean.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from loongsage.core.contracts import PolicyLoss
from loongsage.core.entries import Range, entry
from loongsage.core.types import LossOutput

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: finite in fp32/bf16, far beyond any clip range


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: Annotated[float, Range(ge=0, lt=1)] = 0.2,
    clip_high: Annotated[float, Range(ge=0)] = 0.2,
    clip_c: Annotated[float | None, Range(gt=1, note="null = off")] = None,
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


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: Annotated[float, Range(ge=0, lt=1)] = 3e-4,
    clip_high: Annotated[float, Range(ge=0)] = 4e-4,
) -> LossOutput:
    """GSPO (group sequence policy optimisation), token form, per token.

    One ratio per sequence ``i``: the geometric mean of its token ratios over its valid tokens ``m``::

        s_i   = exp( sum_t m (logprobs - old_logprobs) / sum_t m )        (log-ratios clamped to +-20)
        s_i,t = sg(s_i) * pi_t / sg(pi_t)                                  value s_i, d s_i,t / d logpi_t = s_i
        L_t   = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - clip_low, 1 + clip_high))

    The clip range is tested on ``s_i``, so the decision is one per sequence (with a sequence-level
    advantage, as in GRPO, the whole sequence is clipped or none of it). Aggregated with
    seq-mean-token-mean, ``sum_t L_t / len_i`` has exactly the gradient of GSPO's sequence objective
    ``max(-A s_i, -A clip(s_i))``; other aggregations weight sequences by length and are not GSPO.
    Computed in at least fp32: the default range (3e-4 / 4e-4, the GSPO paper's) is finer than bf16's
    resolution around 1.

    Shapes: all inputs ``[B, T]``; a row without valid tokens has ``s_i = 1`` and zero loss.
    Returns ``loss [B, T]`` and per-token metrics: ``clipfrac`` (1 where the clipped branch is
    active), ``seq_ratio`` (``s_i`` on every valid token of row ``i``) and ``ppo_kl`` (per-token k1
    ``old - new``, as for ppo_clip).
    """
    mask = response_mask != 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs.to(dtype), zero)  # padding garbage never reaches exp or the gradient
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    log_ratio = (lp.detach() - old_logprobs.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(mask, log_ratio, zero)
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / lengths  # [B, 1], within +-20

    # lp - sg(lp) is exactly 0 in value and 1 in gradient: every token carries s_i and its own gradient.
    ratio = ((lp - lp.detach()) + seq_log_ratio).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)

    metrics = {
        "clipfrac": ((clipped > unclipped) & mask).to(dtype),
        "seq_ratio": torch.where(mask, ratio.detach(), zero),
        "ppo_kl": torch.where(mask, -log_ratio, zero),
    }
    return LossOutput(loss=torch.where(mask, loss, zero), metrics=metrics)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: Annotated[float, Range(ge=0, note=">= 1 = no lower bound")] = 1.0,
    clip_high: Annotated[float, Range(ge=0)] = 0.28,
) -> LossOutput:
    """CISPO (clipped IS-weight policy optimisation, MiniMax-M1), per token.

    With ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``::

        L = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprobs
        dL/dlogprobs = -clip(r, 1 - clip_low, 1 + clip_high) * A

    Unlike PPO, a token outside the range keeps its gradient (scaled by the clipped weight) instead
    of losing it. ``clip_low >= 1`` means no lower bound (``r > 0`` always): the MiniMax-M1
    convention of a large epsilon_low with only epsilon_high tuned. The loss *value* is a surrogate
    whose gradient is the policy gradient; its level depends on ``logprobs`` and means nothing.

    Shapes: all inputs ``[B, T]``. Returns ``loss [B, T]`` and per-token metrics ``clipfrac``
    (1 where ``r`` lies outside the range, whatever the sign of ``A``), ``ratio`` and ``ppo_kl``.
    """
    mask = response_mask != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = (logprobs.detach() - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(mask, log_ratio, zero)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # a bound <= 0 never binds: r > 0
    # The coefficient is pinned to 0 on padding so that 0 * garbage cannot turn the gradient into NaN.
    coef = torch.where(mask, -weight * advantages.detach(), zero)
    loss = coef * torch.where(mask, logprobs, zero)
    metrics = {
        "clipfrac": ((weight != ratio) & mask).to(loss.dtype),
        "ratio": torch.where(mask, ratio, zero),
        "ppo_kl": torch.where(mask, -log_ratio, zero),
    }
    return LossOutput(loss=loss, metrics=metrics)


@entry("ppo_clip", ppo_clip_loss, needs_old_logprobs=True)
class PPOClip(PolicyLoss):
    """``ppo_clip``: PPO clip with asymmetric bounds (DAPO: 0.2 / 0.28) and optional dual clip."""


@entry("nll", nll_loss, needs_old_logprobs=False, uses_advantages=False)
class NLL(PolicyLoss):
    """``nll``: supervised fine-tuning loss; ignores advantages and old log-probs."""


@entry("gspo", gspo_loss, needs_old_logprobs=True, supported_aggregations=("seq-mean-token-mean",))
class GSPO(PolicyLoss):
    """``gspo``: sequence-level ratio in token form; only defined under seq-mean-token-mean."""


@entry("cispo", cispo_loss, needs_old_logprobs=True)
class CISPO(PolicyLoss):
    """``cispo``: stop-gradient clipped IS weight times ``A * logprobs``; no lower clip by default."""
