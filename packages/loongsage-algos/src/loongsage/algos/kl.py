"""Per-token KL estimators of KL(pi || ref) from sampled-token log-probs.

With ``x = logprobs - ref_logprobs`` on tokens sampled from pi (Schulman's k1/k2/k3)::

    k1 = x                      unbiased, high variance, can be negative
    k2 = x^2 / 2                biased, low variance, >= 0
    k3 = exp(-x) - 1 + x        unbiased, >= 0
    low_var_kl = min(k3, bound) with x clamped to +-20 first (k3 >= 0: verl's clamp to +-bound)

Unbiased form (DeepSeek-V3.2): the tokens were sampled from the old policy, not from pi, so each
estimate is importance-weighted by ``sg(r)`` with ``r = exp(clamp(logprobs - old_logprobs, +-20))``.
Entries with ``unbiased=True`` need the old log-probs, passed as the keyword ``old_logprobs``.

Each estimator is a pure function ``(logprobs [B, T], ref_logprobs [B, T]) -> [B, T]``;
:func:`loongsage.core.entries.entry` makes the registered entry from it, with the param ``unbiased``
and the call ``(logprobs, ref_logprobs, *, old_logprobs=None)`` of :class:`_Unbiasable`. The flag
``consumes`` tells the trainer what to fetch, and ``needs_old_logprobs`` (``unbiased``) whether to
pass ``old_logprobs``. Masking and reduction are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, ClassVar

import torch
from torch import Tensor

from loongsage.core.contracts import KLEstimator
from loongsage.core.entries import Range, entry

LOG_RATIO_CLAMP = 20.0


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``x = logprobs - ref_logprobs``."""
    return logprobs - ref_logprobs


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``x^2 / 2``."""
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``exp(-x) - 1 + x``, computed as ``expm1(-x) + x`` to keep digits for small ``x``.

    Clamped at 0 from below: the value is >= 0 exactly, and rounding could otherwise leave
    ``-1e-15`` for ``|x| < 1e-7``.
    """
    x = logprobs - ref_logprobs
    return (x.neg().expm1() + x).clamp(min=0.0)


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor, *, bound: Annotated[float, Range(gt=0)] = 10.0) -> Tensor:
    """k3 with ``x`` clamped to +-20 and the result capped at ``bound``.

    Clamping ``x`` before ``exp`` matters for the gradient, not only the value: an overflowed
    ``exp`` would give ``0 * inf = NaN`` through the outer clamp.
    """
    x = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (x.neg().expm1() + x).clamp(min=0.0, max=bound)


def importance_weight(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """``sg(r)``, ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``: pi over the sampling policy."""
    return (logprobs.detach() - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def unbiased_kl(
    estimator: Callable[[Tensor, Tensor], Tensor], logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor
) -> Tensor:
    """``sg(r) * estimator(logprobs, ref_logprobs)`` (DeepSeek-V3.2's unbiased KL).

    The weight has no gradient: the estimator's own gradient is scaled, not changed in direction.
    On-policy (``old_logprobs == logprobs``) the weight is exactly 1.
    """
    return importance_weight(logprobs, old_logprobs) * estimator(logprobs, ref_logprobs)


def kl_in_reward(
    token_rewards: Tensor | None, kl: Tensor, coef: float, *, response_mask: Tensor | None = None
) -> Tensor:
    """Per-token rewards with a KL penalty folded in: ``token_rewards - coef * sg(kl)``.

    ``token_rewards`` None counts as 0. With ``response_mask`` the result is 0 outside it (whatever
    ``kl`` holds there). Shapes: ``[B, T]`` in and out. Feed the result to an estimator as
    ``AdvantageInput.token_rewards`` (REINFORCE++, GAE); the KL is then not also put in the loss.
    """
    out = -coef * kl.detach()
    if token_rewards is not None:
        out = token_rewards + out
    if response_mask is not None:
        out = torch.where(response_mask != 0, out, torch.zeros_like(out))
    return out


@dataclass(frozen=True, kw_only=True)
class _Unbiasable(KLEstimator):
    """The estimators' call: the plain estimate, or with ``unbiased`` the importance-weighted one.

    A class, not only a binding, because the flag follows a param: only the unbiased form needs
    the sampling policy's log-probs, so only then does the trainer fetch and pass them.
    """

    unbiased: bool = False

    name: ClassVar[str]  # set by entry()
    apply: ClassVar[Callable[..., Tensor]]  # the estimator with this entry's params, set by entry()

    @property
    def needs_old_logprobs(self) -> bool:
        return self.unbiased

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, *, old_logprobs: Tensor | None = None) -> Tensor:
        if not self.unbiased:
            return self.apply(logprobs, ref_logprobs)
        if old_logprobs is None:
            raise ValueError(f"{self.name}.unbiased=True: needs old_logprobs (the sampling policy's log-probs)")
        return unbiased_kl(self.apply, logprobs, ref_logprobs, old_logprobs)


@entry("k1", k1, consumes="logprobs")
class K1(_Unbiasable):
    """``k1``: ``logprobs - ref_logprobs`` (``unbiased``: times ``sg(r)``)."""


@entry("k2", k2, consumes="logprobs")
class K2(_Unbiasable):
    """``k2``: ``(logprobs - ref_logprobs)^2 / 2`` (``unbiased``: times ``sg(r)``)."""


@entry("k3", k3, consumes="logprobs")
class K3(_Unbiasable):
    """``k3``: ``exp(-x) - 1 + x``, no upper bound (``unbiased``: times ``sg(r)``)."""


@entry("low_var_kl", low_var_kl, consumes="logprobs")
class LowVarKL(_Unbiasable):
    """``low_var_kl``: k3 capped at ``bound`` (verl's name for it; ``unbiased``: times ``sg(r)``)."""
