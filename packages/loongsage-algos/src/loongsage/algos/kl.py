"""Per-token KL estimators of KL(pi || ref) from sampled-token log-probs.

With ``x = logprobs - ref_logprobs`` on tokens sampled from pi (Schulman's k1/k2/k3)::

    k1 = x                      unbiased, high variance, can be negative
    k2 = x^2 / 2                biased, low variance, >= 0
    k3 = exp(-x) - 1 + x        unbiased, >= 0
    low_var_kl = min(k3, bound) with x clamped to +-20 first (k3 >= 0: verl's clamp to +-bound)

Each estimator is a pure function ``(logprobs [B, T], ref_logprobs [B, T]) -> [B, T]`` plus a frozen
dataclass implementing the same call; class attribute ``consumes`` tells the trainer what to fetch.
Masking and reduction are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

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


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor, *, bound: float = 10.0) -> Tensor:
    """k3 with ``x`` clamped to +-20 and the result capped at ``bound``.

    Clamping ``x`` before ``exp`` matters for the gradient, not only the value: an overflowed
    ``exp`` would give ``0 * inf = NaN`` through the outer clamp.
    """
    x = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (x.neg().expm1() + x).clamp(min=0.0, max=bound)


@dataclass(frozen=True)
class K1:
    """``k1``: ``logprobs - ref_logprobs``."""

    consumes: ClassVar[str] = "logprobs"

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return k1(logprobs, ref_logprobs)


@dataclass(frozen=True)
class K2:
    """``k2``: ``(logprobs - ref_logprobs)^2 / 2``."""

    consumes: ClassVar[str] = "logprobs"

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return k2(logprobs, ref_logprobs)


@dataclass(frozen=True)
class K3:
    """``k3``: ``exp(-x) - 1 + x``, no upper bound."""

    consumes: ClassVar[str] = "logprobs"

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return k3(logprobs, ref_logprobs)


@dataclass(frozen=True)
class LowVarKL:
    """``low_var_kl``: k3 capped at ``bound`` (verl's name for it)."""

    bound: float = 10.0

    consumes: ClassVar[str] = "logprobs"

    def __post_init__(self) -> None:
        if not self.bound > 0:
            raise ValueError(f"low_var_kl.bound={self.bound}: must be > 0")

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return low_var_kl(logprobs, ref_logprobs, bound=self.bound)
