"""Train-inference consistency corrections: per-token loss weights and loss masks, no gradient.

``is``, ``decoupled`` and ``m2po`` read ``delta_t = clamp(old_logprobs - rollout_logprobs, -20, 20)``, the log of
the IS weight between the trainer's policy (``old``: recomputed before the step's first update) and
the behaviour policy that sampled the tokens (``rollout``: the engine's log-probs). The framework
calls them once per optimizer mini-batch, over the whole mini-batch of every DP rank
(:meth:`loongsage.core.loss.LossPlan.prepare`), before micro-batching. ``opsm`` compares the
current policy with ``old`` (or ``rollout``) and is called per micro-batch (``needs_logprobs``).

A correction returns ``CorrectionOutput(token_weights, response_mask, metrics)`` and can act on the
loss in two ways, which differ in what happens to the loss *denominator*:

* ``token_weights`` multiply the per-token loss *after* the aggregation weights are computed: the
  denominator is unchanged (a weight of 0 drops a token from the numerator only);
* ``response_mask``: the framework recomputes the aggregation weights from the *returned* mask, so
  a token masked here leaves numerator and denominator (the token count of token-mean, the
  sequence length of seq-mean-token-mean, and, for a row with nothing left, the sequence count of
  the seq-mean modes).

Every correction keeps ``token_weights = 1`` outside the mask it received, never turns a masked
token on, and ignores whatever padding holds. Metrics are per-token tensors, zero outside the
received mask (the framework reports their token mean over it).

Each correction is a pure function whose keyword parameters, with their ranges, are the recipe's
``params``; :func:`loongsage.core.entries.entry` makes the registered entry from it, called with a
``CorrectionInput`` (whose fields feed the function's inputs of the same names).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from torch import Tensor

from loongsage.core.contracts import Correction
from loongsage.core.entries import Range, entry
from loongsage.core.types import CorrectionOutput

LOG_RATIO_CLAMP = 20.0
DECOUPLED_METRICS = {
    "is_weight_mean": "decoupled_weight_mean",
    "is_clipfrac": "decoupled_clipfrac",
    "is_maskfrac": "decoupled_maskfrac",
}
OPSM_REFERENCES = ("old", "rollout")


def _log_gap(numerator: Tensor, denominator: Tensor, mask: Tensor) -> Tensor:
    """``clamp(numerator - denominator, -20, 20)`` in at least fp32, detached, 0 where ``mask`` is off."""
    dtype = torch.promote_types(numerator.dtype, torch.float32)
    gap = (numerator.detach().to(dtype) - denominator.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, gap, torch.zeros((), dtype=dtype, device=gap.device))


def _keep(response_mask: Tensor, keep: Tensor) -> Tensor:
    """``response_mask`` (same dtype and values) with the entries where ``keep`` is False set to 0."""
    return torch.where(keep, response_mask, torch.zeros_like(response_mask))


def is_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: Literal["token", "sequence", "geometric"] = "token",
    mode: Literal["clip", "mask"] = "clip",
    low: Annotated[float, Range(ge=0, le=1, note="0 = no lower bound")] = 0.5,
    high: Annotated[float, Range(ge=1)] = 2.0,
    veto: Annotated[float | None, Range(gt=0, le=1, note="null = off")] = None,
) -> CorrectionOutput:
    """Importance-sampling correction between the trainer's and the engine's policy.

    The IS weight, with ``m`` the mask and ``delta`` as in the module docstring::

        token      w_t = exp(delta_t)
        sequence   w_i = exp(sum_t m delta_t)             (broadcast over row i)
        geometric  w_i = exp(sum_t m delta_t / sum_t m)

    ``mode="clip"`` (truncated IS, "TIS"): ``token_weights = clamp(w, low, high)``; the mask is
    unchanged, so the denominator is unchanged. ``mode="mask"`` (masked IS, "MIS" / IcePop): tokens
    (token level) or whole sequences (sequence, geometric) whose raw ``w`` lies outside ``[low,
    high]`` (bounds included) are removed from the *mask*, so they leave numerator and denominator,
    and the tokens that stay keep their raw IS weight, ``token_weights = w`` (inside the range
    ``w = clamp(w, low, high)``, so both modes return ``clamp(w, low, high)`` as weights and differ
    only in the mask). ``veto``: a sequence with any valid token whose ``exp(delta_t) < veto`` is
    removed from the mask, in either mode. Range tests are made on log-weights, which stay finite
    for any length; ``low = 0`` means no lower bound.

    Shapes: all inputs ``[B, T]``. Metrics (per token): ``is_weight_mean`` (raw ``w`` before
    clipping, its log clamped to +-20 to stay finite), ``is_clipfrac`` (clip mode: 1 where ``w``
    was clipped) or ``is_maskfrac`` (mask mode: 1 where this correction removed the token, veto
    included), and ``is_vetofrac`` when ``veto`` is set.
    """
    mask = response_mask != 0
    delta = _log_gap(old_logprobs, rollout_logprobs, mask)
    dtype = delta.dtype
    if level == "token":
        log_w = delta
    else:
        total = delta.sum(dim=-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
        log_w = torch.where(mask, total.expand_as(delta), torch.zeros_like(delta))
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high)
    inside = (log_w >= log_low) & (log_w <= log_high)

    raw = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    metrics = {"is_weight_mean": torch.where(mask, raw, torch.zeros_like(raw))}
    # clip: every token carries clamp(w); mask: the kept ones (inside the range) carry w itself
    token_weights = torch.where(mask, log_w.clamp(log_low, log_high).exp(), torch.ones_like(raw))
    keep = torch.ones_like(mask)
    if mode == "clip":
        metrics["is_clipfrac"] = (mask & ~inside).to(dtype)
    else:
        keep = inside
    if veto is not None:
        vetoed = (mask & (delta < math.log(veto))).any(dim=-1, keepdim=True).expand_as(mask)
        keep = keep & ~vetoed
        metrics["is_vetofrac"] = (mask & vetoed).to(dtype)
    if mode == "mask":
        metrics["is_maskfrac"] = (mask & ~keep).to(dtype)
    return CorrectionOutput(token_weights=token_weights, response_mask=_keep(response_mask, keep), metrics=metrics)


def decoupled_correction(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    *,
    cap: Annotated[float | None, Range(gt=1, note="null = no cap")] = 5.0,
    mode: Literal["mask", "clip"] = "mask",
) -> CorrectionOutput:
    """Decoupled PPO (AReaL): the behaviour-policy weight of asynchronous, partially rolled-out data.

    Three policies meet in an asynchronous step: the *behaviour* policies that sampled the tokens
    (the engine's log-probs; a partial rollout's tokens come from several versions, each token with
    its own), the *proximal* policy (the trainer's weights before the step's first update: the
    recomputed ``old_logprobs``) and the current one. The policy loss clips the current policy's
    ratio to the proximal one, so the trust region is around the newest weights however stale the
    data; this correction weights every token by the behaviour importance ratio::

        w_t = pi_proximal / pi_behaviour = exp(log pi_old - log pi_rollout)     (per token)

    ``mode="mask"`` (AReaL's ``behav_imp_weight_cap``): tokens with ``w_t > cap`` leave the loss
    (numerator and denominator), the others keep ``w_t``. ``mode="clip"``: ``min(w_t, cap)``, the
    denominator unchanged. ``cap=None``: no bound (``mode`` then does not matter). There is no lower
    bound: a token the proximal policy finds unlikely simply counts less.

    The same arithmetic as :func:`is_correction` at token level with ``low = 0``; the name, the
    defaults and the metrics (``decoupled_weight_mean``, ``decoupled_maskfrac`` /
    ``decoupled_clipfrac``) are those of the decoupled objective.
    """
    out = is_correction(
        proximal_logprobs,
        behaviour_logprobs,
        response_mask,
        level="token",
        mode=mode,
        low=0.0,
        high=math.inf if cap is None else cap,
    )
    metrics = {DECOUPLED_METRICS[k]: v for k, v in out.metrics.items()}
    return CorrectionOutput(token_weights=out.token_weights, response_mask=out.response_mask, metrics=metrics)


def m2po_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau: Annotated[float, Range(gt=0)] = 0.04,
    harmful_only: bool = False,
) -> CorrectionOutput:
    """M2PO (second-moment trust region for stale data): mask the largest ``delta^2`` tokens.

    The trust region is between the trainer's policy and the behaviour policy, so ``delta``
    (old vs rollout) is the log IS weight whose second moment ``M2 = mean(delta^2)`` is bounded.
    Over the *candidate* tokens of the whole mini-batch, sorted by ``delta^2``, the fewest largest
    are removed from the mask so that the mean ``delta^2`` of the kept candidates is ``<= tau``
    (all candidates are removed if even the smallest exceeds ``tau``; ties are broken by position,
    later tokens first). Removed tokens leave numerator and denominator, as in AReaL.

    Candidates are all valid tokens, or with ``harmful_only`` only those whose update would widen
    the gap to the behaviour policy: ``A > 0`` with ``r > 1`` or ``A < 0`` with ``r < 1``, where
    ``r = exp(delta) = pi_old / pi_rollout`` (an update along ``A`` pushes ``pi`` further from
    ``pi_rollout``). Then ``M2`` is measured over the candidates only: a token whose update shrinks
    the gap is no risk to the trust region and is neither counted nor masked.

    Shapes: all inputs ``[B, T]``. Metrics (per token): ``m2po_masked_frac`` (1 where removed) and
    ``m2po_mean_delta2`` (``delta^2``; its token mean is the mini-batch's ``M2`` before masking).
    """
    mask = response_mask != 0
    delta = _log_gap(old_logprobs, rollout_logprobs, mask)
    delta2 = delta.square()
    candidates = mask
    if harmful_only:
        adv = advantages.detach()
        candidates = mask & (((adv > 0) & (delta > 0)) | ((adv < 0) & (delta < 0)))
    # float64 prefix sums: a mini-batch holds up to millions of tokens.
    values = delta2[candidates].to(torch.float64)
    order = torch.argsort(values, stable=True)  # ascending
    prefix = values[order].cumsum(0)
    counts = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
    # Prefix means of an ascending sequence never decrease: the kept set is the longest prefix.
    within = (prefix <= tau * counts).nonzero()
    kept = int(within[-1]) + 1 if within.numel() else 0
    dropped = torch.zeros_like(values, dtype=torch.bool)
    dropped[order[kept:]] = True
    removed = torch.zeros_like(mask)
    removed[candidates] = dropped
    metrics = {
        "m2po_masked_frac": removed.to(delta.dtype),
        "m2po_mean_delta2": delta2,
    }
    return CorrectionOutput(
        token_weights=torch.ones_like(delta), response_mask=_keep(response_mask, ~removed), metrics=metrics
    )


def opsm_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    logprobs: Tensor | None = None,
    delta: Annotated[float, Range(ge=0)] = 0.1,
    reference: Literal["old", "rollout"] = "old",
) -> CorrectionOutput:
    """Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage tokens of drifted sequences.

    Per sequence, the k1 estimate of KL(reference || target) over its valid tokens::

        KL_i = sum_t m (log pi_reference - log pi_target) / sum_t m      (log-ratios clamped to +-20)
        token_weights[i, t] = 0   where A_t < 0 and KL_i > delta, else 1

    The target is the current policy ``logprobs`` when given (the framework always gives it),
    else the trainer's ``old_logprobs``. The reference is

    * ``"old"`` (default, as upstream LoongSage): ``old_logprobs``, the trainer's policy
      before the step's first update, so ``KL_i`` is the drift of this step's updates. With one
      optimizer step per rollout the current policy *is* the old one and nothing is dropped.
    * ``"rollout"``: the engine's ``rollout_logprobs``, the policy that sampled the tokens, so
      ``KL_i`` also covers the train-inference mismatch and staleness (DeepSeek-V3.2 measures from
      the sampling probabilities).

    With a sequence-level advantage (GRPO) the whole sequence is dropped. The loss *denominator is
    unchanged* (token weights, not the mask), as in DeepSeek-V3.2 and slime.

    Shapes: all inputs ``[B, T]``. Metrics (per token): ``opsm_clipfrac`` (1 where zeroed) and
    ``opsm_seq_kl`` (``KL_i`` on every valid token of row ``i``).
    """
    if reference not in OPSM_REFERENCES:
        raise ValueError(f"opsm.reference={reference!r}: allowed: {', '.join(OPSM_REFERENCES)}")
    mask = response_mask != 0
    target = old_logprobs if logprobs is None else logprobs
    source = old_logprobs if reference == "old" else rollout_logprobs
    gap = _log_gap(source, target, mask)
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(gap.dtype)
    seq_kl = (gap.sum(dim=-1, keepdim=True) / lengths).expand_as(gap)
    dropped = mask & (advantages.detach() < 0) & (seq_kl > delta)
    metrics = {
        "opsm_clipfrac": dropped.to(gap.dtype),
        "opsm_seq_kl": torch.where(mask, seq_kl, torch.zeros_like(seq_kl)),
    }
    token_weights = (~dropped).to(gap.dtype)
    return CorrectionOutput(token_weights=token_weights, response_mask=response_mask, metrics=metrics)


@entry("is", is_correction, needs_logprobs=False)  # decided once per mini-batch from old vs rollout
class ImportanceSampling(Correction):
    """``is``: token / sequence / geometric IS weight, clipped (TIS) or masked (MIS, IcePop), optional veto."""


@entry(
    "decoupled",
    decoupled_correction,
    inputs={"proximal_logprobs": "old_logprobs", "behaviour_logprobs": "rollout_logprobs"},
)
class Decoupled(Correction):
    """``decoupled``: decoupled PPO's behaviour weight pi_proximal / pi_behaviour per token, tokens
    above ``cap`` masked (``mode: mask``, AReaL's) or clipped to it (``mode: clip``).

    Meant for asynchronous scheduling: the old log-probs are recomputed (the proximal policy) because
    this correction reads them up front, and the PPO clip then bounds the update around the newest
    weights while this weight accounts for the versions that sampled each token. ``cap: 5.0`` is
    what AReaL's asynchronous recipes run (its own default is no cap: ``cap: null``).
    """


@entry("m2po", m2po_correction, needs_logprobs=False)
class M2PO(Correction):
    """``m2po``: mask the fewest largest-``delta^2`` tokens so that the kept mean is ``<= tau``."""


@entry("opsm", opsm_correction, needs_logprobs=True)
class OPSM(Correction):
    """``opsm``: zero negative-advantage tokens of sequences whose KL(reference || current) exceeds
    ``delta``; denominator kept.

    ``reference: old`` (default, with ``delta`` 0.1: upstream LoongSage's) measures the drift from
    the trainer's policy before the step's first update; ``reference: rollout`` measures from the
    engine's log-probs (mismatch and staleness included). slime's default ``delta`` is 1e-4. Applied by the
    framework per micro-batch with the current policy's
    (detached) log-probs, which it may do because it only sets weights of whole sequences and
    leaves the mask alone.
    """
